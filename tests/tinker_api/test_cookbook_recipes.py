"""tinker-cookbook 0.6.1's DPO and on-policy distillation trainers against a live OpenTinker,
on local data in the cookbook's own formats (nothing downloaded).

- DPO: ``tinker_cookbook.preference.train_dpo.main``, the entry point the recipe
  ``recipes/preference/dpo/train.py`` builds its config for. The recipe picks its data by name
  among hub datasets only (``hhh``, ``helpsteer3``, ``ultrafeedback``), so the test hands
  ``train_dpo`` the recipe's own ``DPODatasetBuilderFromComparisons`` over its
  ``HHHComparisonBuilder`` parser, reading Anthropic hh-rlhf rows from a local JSONL file.
- On-policy distillation: ``tinker_cookbook.distillation.train_on_policy.main``, what
  ``recipes/distillation/on_policy_distillation.py`` runs; its prompts come from hub datasets
  by name (``deepmath``, ``tulu3``), so the test gives it the cookbook's ``PromptOnlyDataset``
  over local prompts. Teacher and student start from the same base model.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "tinker_cookbook.preference.train_dpo",
    reason="tinker-cookbook 0.6.1 (a test dependency) is not importable with its runtime deps",
    exc_type=ImportError,
)
import chz
import datasets
from tinker_cookbook import renderers
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import (
    DistillationDatasetConfig,
    PromptOnlyDataset,
    TeacherConfig,
)
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.recipes.preference.datasets import HHHComparisonBuilder
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

from tests.tinker_api.conftest import BASE_NAME
from tests.tinker_api.test_cookbook import RENDERER, _metrics, _rows, _tiny_model_or_skip, server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

__all__ = ["server"]


@chz.chz
class LocalHHHComparisons(HHHComparisonBuilder):
    """The recipe's hh-rlhf parser over a local JSONL file of ``{chosen, rejected}`` rows."""

    path: str

    def get_train_and_test_datasets(self) -> tuple[datasets.Dataset, datasets.Dataset | None]:
        rows = [json.loads(line) for line in Path(self.path).read_text().splitlines()]
        return datasets.Dataset.from_list(rows), None


def _hh_rows(count: int) -> list[dict[str, str]]:
    """Arithmetic questions in hh-rlhf's format: the right answer chosen, a wrong one rejected."""
    out = []
    for r in _rows("add", count):
        prompt = f"\n\nHuman: {r['question']}\n\nAssistant:"
        wrong = str(int(r["answer"]) + 1) if r["answer"].lstrip("-").isdigit() else "no idea"
        out.append(
            {"chosen": f"{prompt} \\boxed{{{r['answer']}}}", "rejected": f"{prompt} {wrong}"}
        )
    return out


def test_it_runs_the_dpo_trainer_on_local_preference_pairs(
    server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    _tiny_model_or_skip(base_model_dir)
    data = tmp_path / "hh.jsonl"
    # The same four pairs three times over: later steps see pairs already trained on.
    data.write_text("".join(json.dumps(r) + "\n" for r in _hh_rows(4) * 3))
    log_path = tmp_path / "dpo"
    config = train_dpo.Config(
        log_path=str(log_path),
        model_name=BASE_NAME,
        recipe_name="opentinker_test_dpo",
        renderer_name=RENDERER,
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=BASE_NAME,
                renderer_name=RENDERER,
                max_length=128,
                batch_size=4,
            ),
            comparison_builder=LocalHHHComparisons(path=str(data)),
        ),
        learning_rate=5e-3,
        lr_schedule="constant",
        dpo_beta=0.1,
        lora_rank=8,
        save_every=0,
        eval_every=0,
        infrequent_eval_every=0,
        max_steps=3,
        base_url=server,
    )
    train_dpo.main(config)
    steps = [m for m in _metrics(log_path) if "dpo_loss" in m]
    assert [m["step"] for m in steps] == [0, 1, 2], steps
    assert all(math.isfinite(m["dpo_loss"]) for m in steps), steps
    # Step 0 trains the reference weights themselves: the reference log-probs (the sampler's
    # compute_logprobs) equal the trainer's forward pass, so the loss is log 2, no margin.
    assert steps[0]["dpo_loss"] == pytest.approx(math.log(2), abs=1e-3), steps[0]
    assert abs(steps[0]["margin"]) < 1e-3, steps[0]
    assert steps[-1]["dpo_loss"] < steps[0]["dpo_loss"], steps


@chz.chz
class LocalPromptsBuilder(RLDatasetBuilder):
    """The cookbook's prompt-only distillation dataset over local questions."""

    base_model_dir: str
    groups_per_batch: int = 2
    group_size: int = 2

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.base_model_dir)
        prompts = [r["question"] for r in _rows("add", 8)]
        dataset = PromptOnlyDataset(
            prompts=prompts,
            batch_size=self.groups_per_batch,
            group_size=self.group_size,
            renderer=renderers.get_renderer(RENDERER, tokenizer),
            tokenizer=tokenizer,
            max_prompt_tokens=64,
            dataset_name="arith_prompts",
        )
        return dataset, None


def test_it_runs_on_policy_distillation_from_a_teacher_on_the_server(
    server: str, base_model_dir: Path, tmp_path: Path
) -> None:
    _tiny_model_or_skip(base_model_dir)
    log_path = tmp_path / "distill"
    config = train_on_policy.Config(
        recipe_name="opentinker_test_distillation",
        learning_rate=1e-3,
        dataset_configs=[
            DistillationDatasetConfig(
                dataset_builder=LocalPromptsBuilder(base_model_dir=str(base_model_dir)),
                teacher_config=TeacherConfig(base_model=BASE_NAME),
                groups_per_batch=2,
            )
        ],
        model_name=BASE_NAME,
        renderer_name=RENDERER,
        lora_rank=8,
        max_tokens=12,
        log_path=str(log_path),
        eval_every=0,
        save_every=0,
        max_steps=2,
        base_url=server,
    )
    asyncio.run(train_on_policy.main(config))
    steps: list[dict[str, Any]] = [m for m in _metrics(log_path) if "teacher_kl" in m]
    assert [m["step"] for m in steps] == [0, 1], steps
    assert all(math.isfinite(m["teacher_kl"]) for m in steps), steps
    # The student starts as the teacher (a fresh LoRA adds nothing): the sampler's logprobs
    # of the student's samples and the teacher's compute_logprobs agree, so the KL is ~0.
    assert abs(steps[0]["teacher_kl"]) < 1e-3, steps[0]
