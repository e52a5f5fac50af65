"""An inspect-ai task over a job's held-out prompts (``math``, or ``geometry`` with its diagrams
as images), graded by the env itself.

``prompts`` names a JSON file: a list of ``{"messages": [...], "group": {...}}``, where
``messages`` are the env's first observation of a held-out row (what the job's evaluation
rendered) and ``group`` the group spec that builds its episode again. The scorer steps that
episode with the model's completion, so a completion is graded exactly as the job graded its
own (``environments.grading`` through ``MathEpisode.step``). Nothing is downloaded: the dataset
is in memory.

Run by tests/tinker_api/test_openai_harness.py as
``inspect eval tests/tinker_api/harness_task.py@held_out -T prompts=FILE --model
openai-api/opentinker/job:<id> --model-base-url http://.../v1 ...``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.model import ChatMessageSystem, ChatMessageUser, ContentImage, ContentText
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate

from environments.registry import build_group

ROLES = {"system": ChatMessageSystem, "user": ChatMessageUser}


def content(given: Any) -> Any:
    """An env message's content in inspect's types: its text, or text and image parts (the
    images as the data URIs the env wrote, which inspect's OpenAI provider sends as
    ``image_url`` parts)."""
    if isinstance(given, str):
        return given
    return [
        ContentImage(image=part["image"])
        if part["type"] == "image"
        else ContentText(text=part["text"])
        for part in given
    ]


@scorer(metrics=[accuracy()])
def env_grade() -> Any:
    async def score(state: TaskState, target: Target) -> Score:
        episode = build_group(state.metadata["group"]).make_episodes()[0]
        episode.initial_observation()
        result = episode.step(state.output.completion)
        return Score(
            value=CORRECT if result.metrics["correct"] == 1.0 else INCORRECT,
            answer=str(result.info.get("given")),
            explanation=state.output.completion,
        )

    return score


@task
def held_out(prompts: str) -> Task:
    rows = json.loads(Path(prompts).read_text(encoding="utf-8"))
    samples = [
        Sample(
            id=i,
            input=[ROLES[m["role"]](content=content(m["content"])) for m in row["messages"]],
            target=str(row["group"]["row"]["answer"]),
            metadata={"group": row["group"]},
        )
        for i, row in enumerate(rows)
    ]
    return Task(dataset=MemoryDataset(samples), solver=generate(), scorer=env_grade())
