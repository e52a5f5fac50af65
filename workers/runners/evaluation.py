"""Evaluation: a snapshot (or the base model) played greedily on the held-out prompts.

The same builders, renderer and env code as training; the training loop evaluates every
``eval_every`` steps, an eval job (`run_eval`) once with training switched off.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from environments.registry import get_env, pairs_episodes
from environments.renderer import Renderer
from environments.types import DataSource
from jobs.spec import JobSpec
from training.engine import Engine
from training.policy import Policy
from workers.runners.data_processing import correct_flag, mean
from workers.runners.loop_types import EVAL_DIR, SUMMARY_FILE, LoopContext, TrainingError
from workers.runners.pictures import renderer_for
from workers.runners.rollouts import Opponent, play_groups

__all__ = ["EVAL_SEED_OFFSET", "evaluate_snapshot", "run_eval"]

# Generator envs: evaluation seeds live far away from every training seed.
EVAL_SEED_OFFSET = 1_000_000_007


def evaluate_snapshot(
    engine: Engine,
    renderer: Renderer,
    spec: JobSpec,
    eval_rows: list[dict[str, Any]] | None,
    *,
    policy: Policy | None,
    version: int | None,
    out_path: Path,
    opponent: Opponent | None = None,
) -> dict[str, float]:
    """Play the held-out prompts greedily with one snapshot (None: the base model).

    The same builders, renderer and env code as training; `spec.eval_examples` prompts: the
    first rows of `eval_rows` for a dataset env, seeds from EVAL_SEED_OFFSET for a generator.
    Writes one JSON line per episode (the transcript) to `out_path` and returns the metrics.
    """
    env = get_env(str(spec.env))
    n = spec.eval_examples
    rows: list[dict[str, Any] | None]
    if env.data_source is DataSource.DATASET:
        rows = list((eval_rows or [])[:n])
        if not rows:
            raise TrainingError(f"env {env.name!r} reads a dataset, and no evaluation rows exist")
    else:
        rows = [None] * n
    group_specs = [
        {
            "env": env.name,
            "config": dict(spec.env_config),
            "row": row,
            "seed": EVAL_SEED_OFFSET + i,
            "group_size": 2 if pairs_episodes(env.name, spec.env_config) else 1,
        }
        for i, row in enumerate(rows)
    ]
    started = time.perf_counter()
    groups = play_groups(
        engine,
        renderer,
        group_specs,
        policy=policy,
        version=version,
        temperature=0.0,
        top_p=1.0,
        max_tokens=spec.rollout.max_tokens,
        max_turns=spec.rollout.max_turns,
        seed_of=lambda g, e, t: 0,
        env_execution=spec.rollout.env_execution,
        opponent=opponent,
    )
    trajectories = [t for group in groups for t in group]
    rewards = [t.total_reward for t in trajectories]
    correct = [c for c in (correct_flag(t) for t in trajectories) if c is not None]
    metrics = {
        "eval/reward": mean(rewards),
        "eval/episodes": float(len(trajectories)),
        "eval/seconds": time.perf_counter() - started,
    }
    if correct:
        metrics["eval/accuracy"] = mean(correct)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for traj in trajectories:
            last = traj.turns[-1] if traj.turns else None
            fh.write(
                json.dumps(
                    {
                        "reward": traj.total_reward,
                        "error": traj.error,
                        "turns": [
                            {
                                "observation": t.observation_messages,
                                "action": t.action_text,
                                "reward": t.reward,
                                "metrics": t.metrics,
                            }
                            for t in traj.turns
                        ],
                        "info": last.info if last else {},
                    },
                    default=str,
                )
                + "\n"
            )
    os.replace(tmp, out_path)
    return metrics


def run_eval(
    ctx: LoopContext,
    spec: JobSpec,
    engine: Engine,
    *,
    eval_rows: list[dict[str, Any]] | None,
    policy: Policy | None,
    source: Mapping[str, Any],
    opponent: Opponent | None = None,
) -> dict[str, float] | None:
    """An eval job: evaluate `policy` (None: the base model) once, training switched off.

    Logs the metrics at step 0 and leaves ``eval/transcripts.jsonl`` and ``summary.json`` in
    the workdir. Returns None when cancelled before it finished.
    """
    workdir = Path(ctx.workdir)
    ctx.event(f"eval on {spec.env}: {spec.eval_examples} prompts", dict(source))
    if ctx.cancelled():
        return None
    version = policy.snapshot() if policy is not None else None
    metrics = evaluate_snapshot(
        engine,
        renderer_for(engine),
        spec,
        eval_rows,
        policy=policy,
        version=version,
        out_path=workdir / EVAL_DIR / "transcripts.jsonl",
        opponent=opponent,
    )
    if ctx.cancelled():
        return None
    ctx.log_metrics(0, metrics)
    ctx.flush_metrics()
    summary = {
        "kind": "eval",
        "env": spec.env,
        "source": dict(source),
        "eval": {k: v for k, v in metrics.items() if k != "eval/seconds"},
    }
    (workdir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    ctx.heartbeat(0, force=True)
    return metrics
