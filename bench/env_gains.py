"""Held-out accuracy before and after an RL run of the native loop on any environment.

    .venv/bin/python bench/env_gains.py ENV 'ENV_CONFIG_JSON' [--steps 60] [--lr 1e-3]
        [--eval-every N] [--max-tokens 16] [--threads 2]
        [--sft-rows ROWS.jsonl --sft-steps 40]

Runs the managed jobs' training loop (`workers.runners.loop.TrainingLoop`) in-process on the
tiny model: LoRA r8, 16 prompts x 8 samples per step (`--prompts`, `--group`), GRPO, greedy evaluation on 100 held-out
prompts (seeds the training groups never draw) at step 0, every `--eval-every` steps and at
the end. It prints the held-out accuracy (a game's mean reward) at each evaluation, the mean
reward of the first and last steps and the wall time: whether the task is one the tiny model
can learn in minutes.

`--sft-rows`: first an SFT run (`env: math`, 32 rows a step, lr 1e-3, same LoRA) on those rows
(e.g. scripts/build_textarena_demos.py's), then the RL run starts from its adapter, as a
managed RL job with `init.from_job` naming the SFT job does; step 0's evaluation is then the
SFT policy's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("env")
    parser.add_argument("env_config", type=json.loads)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16, help="groups per step")
    parser.add_argument("--group", type=int, default=8, help="samples per group")
    parser.add_argument("--sft-rows", type=Path)
    parser.add_argument("--sft-steps", type=int, default=40)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.local")
    import django

    django.setup()
    import torch

    torch.set_num_threads(args.threads)
    from bench.pipeline import Recorder
    from jobs.spec import parse_spec
    from training.engine import Engine
    from workers.runners.loop import TrainingLoop

    spec = parse_spec(
        {
            "method": "rl",
            "base_model": "tiny",
            "env": args.env,
            "env_config": args.env_config,
            "steps": args.steps,
            "seed": 1,
            "rollout": {
                "group_size": args.group,
                "prompts_per_step": args.prompts,
                "max_tokens": args.max_tokens,
            },
            "algorithm": {"advantage": "grpo", "normalize_std": True},
            "lora": {"rank": 8, "alpha": 16},
            "optimizer": {"lr": args.lr},
            "eval_every": args.eval_every or args.steps,
            "eval_examples": 100,
            "checkpoint_every": 0,
        }
    )
    engine = Engine(ROOT / "models" / "tiny-chat")
    started = time.perf_counter()
    init = None
    if args.sft_rows is not None:
        init = warm_start(engine, args.sft_rows, args.sft_steps, spec.lora.model_dump())
        print(
            f"SFT on {args.sft_rows}: {args.sft_steps} steps, {time.perf_counter() - started:.0f} s"
        )
    ctx = Recorder(Path(tempfile.mkdtemp(prefix="env-gains-")))
    loop = TrainingLoop(
        ctx, spec, engine, rows=None, eval_rows=None, policy_id="gains", init_weights=init
    )
    try:
        loop.run()
    finally:
        loop.close()
    wall = time.perf_counter() - started
    # Envs without a correctness flag (games) are judged by their mean held-out reward.
    judged = (
        "eval/accuracy"
        if any("eval/accuracy" in m for m in ctx.metrics.values())
        else ("eval/reward")
    )
    accuracy = {s: m[judged] for s, m in sorted(ctx.metrics.items()) if judged in m}
    rewards = [ctx.metrics[s].get("reward/mean", 0.0) for s in range(1, args.steps + 1)]
    head, tail = rewards[:10], rewards[-10:]
    print(
        f"{args.env} {json.dumps(args.env_config)}: held-out "
        + ("accuracy " if judged == "eval/accuracy" else "mean reward ")
        + ", ".join(f"step {s}: {a:.2f}" for s, a in accuracy.items())
        + f"; mean reward first 10 steps {sum(head) / len(head):.3f}, last 10 "
        f"{sum(tail) / len(tail):.3f}; {wall:.0f} s"
    )


def warm_start(engine: Any, rows_file: Path, steps: int, lora: dict[str, Any]) -> Path:
    """Run the SFT job's loop on `rows_file` and return its exported adapter."""
    from bench.pipeline import Recorder
    from jobs.spec import parse_spec
    from workers.runners.loop import TrainingLoop

    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    spec = parse_spec(
        {
            "method": "sft",
            "base_model": "tiny",
            "env": "math",
            "steps": steps,
            "batch_size": 32,
            "seed": 1,
            "lora": lora,
            "optimizer": {"lr": 1e-3},
            "checkpoint_every": 0,
        }
    )
    ctx = Recorder(Path(tempfile.mkdtemp(prefix="env-gains-sft-")))
    loop = TrainingLoop(ctx, spec, engine, rows=rows, eval_rows=None, policy_id="gains-sft")
    try:
        loop.run()
    finally:
        loop.close()
    losses = [ctx.metrics[s]["loss"] for s in sorted(ctx.metrics) if "loss" in ctx.metrics[s]]
    print(f"SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return Path(ctx.workdir) / "adapter"


if __name__ == "__main__":
    main()
