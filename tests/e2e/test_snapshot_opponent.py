"""A textarena game against a frozen snapshot of another job's weights, through the REST API
with a real Celery worker: a training job and eval jobs whose opponent seat is played by a
finished job's adapter (or the base model), sampled beside the policy and never trained.

The opponent is those weights and no others: with both seats greedy, an eval of job A against
A's snapshot plays exactly the games of A's self-play, and against the base model it does not.
"""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import JobState
from tests.e2e.test_eval_and_sample import download_lines, submit_eval
from tests.e2e.test_managed_training import finished, rl_spec, series, submit

pytest.importorskip("textarena")
pytestmark = [pytest.mark.timeout(360), pytest.mark.django_db(transaction=True)]

GAME = {"game": "TicTacToe-v0"}


def game_spec(env_config: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "method": "rl",
        "env": "textarena",
        "env_config": {**GAME, **env_config},
        "steps": 2,
        "seed": 5,
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_tokens": 6, "max_turns": 6},
        "lora": {"rank": 8, "alpha": 16},
        "eval_every": 2,
        "eval_examples": 4,
        "checkpoint_every": 1,
    }
    spec.update(overrides)
    return spec


def eval_spec(env_config: dict[str, Any], from_job: str | None) -> dict[str, Any]:
    return {
        "method": "rl",
        "env": "textarena",
        "env_config": {**GAME, **env_config},
        "seed": 5,
        "eval_examples": 4,
        "rollout": {"max_tokens": 6, "max_turns": 6},
        "eval": {"from_job": from_job} if from_job else {},
    }


def test_it_trains_and_evaluates_against_a_frozen_snapshot_of_another_job(
    trainer: Any, owner_client: APIClient, addition_dataset: str
) -> None:
    worker = trainer()
    # Job A: any LoRA job on the same base model. Its games against a random opponent would
    # all be forfeits, equal rewards that train nothing; additions at a high rate move its
    # weights far enough from the base model's to play other (still illegal) moves.
    spec = rl_spec(addition_dataset, steps=2, checkpoint_every=1, optimizer={"lr": 2e-2})
    first = submit(owner_client, spec)
    assert finished(first, 180).state == JobState.SUCCEEDED, worker.log()[-3000:]

    # Training against job A's final adapter, and against its checkpoint of step 1.
    versus = submit(owner_client, game_spec({"opponent": "snapshot", "opponent_job": first}))
    versus_ckpt = submit(
        owner_client,
        game_spec(
            {
                "opponent": "snapshot",
                "opponent_job": first,
                "opponent_checkpoint": "step-000001",
                "model_seat": "random",
            }
        ),
    )
    # Seat 1 of A's greedy self-play; A's seat 1 against A's snapshot; against the base model.
    selfplay = submit_eval(owner_client, eval_spec({"opponent": "selfplay"}, first))
    vs_snapshot = submit_eval(
        owner_client,
        eval_spec({"opponent": "snapshot", "opponent_job": first, "model_seat": 1}, first),
    )
    vs_base = submit_eval(owner_client, eval_spec({"opponent": "snapshot", "model_seat": 1}, first))
    for job_id in (versus, versus_ckpt, selfplay, vs_snapshot, vs_base):
        job = finished(job_id, 180)
        assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])

    for job_id in (versus, versus_ckpt):
        got = series(owner_client, job_id)
        # Only the learner's episodes are trained on: G per prompt, the opponent's dropped.
        assert [n for _, n in got["episodes"]] == [4.0, 4.0], got.keys()
        assert [s for s, _ in got["eval/episodes"]] == [0, 2]
        assert {v for _, v in got["eval/episodes"]} == {4.0}
        transcripts = download_lines(owner_client, job_id, "eval/step-000002.jsonl")
        assert len(transcripts) == 4 and all(t["turns"] for t in transcripts)

    pairs = download_lines(owner_client, selfplay, "eval/transcripts.jsonl")
    assert len(pairs) == 8  # 4 games x 2 seats
    seat_one = [t for t in pairs if t["info"].get("seat") == 1]
    assert len(seat_one) == 4
    assert download_lines(owner_client, vs_snapshot, "eval/transcripts.jsonl") == seat_one
    assert download_lines(owner_client, vs_base, "eval/transcripts.jsonl") != seat_one
