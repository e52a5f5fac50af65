"""A managed RL job on the `geometry` env with the tiny vision-language model, through a
running service: its held-out accuracy before, during and after, and its wall time.

    .venv/bin/python manage.py demo --smoke --steps 1 --keep-serving   # prints URL and key
    .venv/bin/python bench/geometry_rl.py --url URL --key KEY \\
        [--kinds supplementary,complementary,triangle_angle] [--figure-only] \\
        [--rows 4096] [--eval 128] [--steps 200] [--eval-every 25] [--lr 1e-3] \\
        [--temperature 1.0] [--prompts 16] [--group 8] [--seed 1]

Draws geometry3k-shaped problems (`training.geometry`: a diagram and a question; with the
values also stated in the question unless `--figure-only`) from seeds no pre-training of
models/tiny-vl used, uploads them as a `geometry` dataset, and runs an RL job on `tiny-vl`
(GRPO, LoRA r8, greedy evaluation on `--eval` rows the job holds out of the upload). Only the
thin client talks to the service.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "client"))

# models/tiny-vl pre-trained on seeds 0..2,000,000 (scripts/build_tiny_vl_model.py).
FIRST_SEED = 3_000_000


def main() -> None:
    from training import geometry

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--kinds", default=",".join(geometry.KINDS))
    parser.add_argument("--figure-only", action="store_true", help="values on the figure only")
    parser.add_argument(
        "--rows", type=int, default=4096, help="problems uploaded, held-out included"
    )
    parser.add_argument("--eval", type=int, default=128, help="held out by the job")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--temperature", type=float, default=1.0, help="of the RL rollouts")
    parser.add_argument("--prompts", type=int, default=16, help="groups per step")
    parser.add_argument("--group", type=int, default=8, help="samples per group")
    parser.add_argument("--seed", type=int, default=1, help="of the job")
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    try:
        rows = geometry.dataset_rows(
            range(FIRST_SEED, FIRST_SEED + args.rows), kinds, values_in_text=not args.figure_only
        )
    except ValueError as exc:
        parser.error(f"--kinds: {exc}")
    if args.eval >= args.rows:
        parser.error("--eval must be smaller than --rows")
    from opentinker import Client

    client = Client(args.url, args.key)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "geometry.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        dataset = client.datasets.upload(path, env="geometry", name=f"geometry-{len(rows)}")
    job = client.jobs.submit(
        {
            "method": "rl",
            "base_model": "tiny-vl",
            "env": "geometry",
            "env_config": {"max_tokens": 16},
            "dataset": str(dataset.id),
            "steps": args.steps,
            "seed": args.seed,
            "rollout": {
                "group_size": args.group,
                "prompts_per_step": args.prompts,
                "max_tokens": 16,
                "temperature": args.temperature,
            },
            "algorithm": {"advantage": "grpo", "normalize_std": True},
            "lora": {"rank": 8, "alpha": 16},
            "optimizer": {"lr": args.lr},
            "eval_every": args.eval_every,
            "eval_examples": args.eval,
            "checkpoint_every": 0,
        },
        name="geometry-rl",
    )
    print(f"job {job.id}: {len(rows)} rows of {', '.join(kinds)} uploaded", flush=True)
    job.wait(poll=2.0, max_poll=10.0)
    wall = time.perf_counter() - started
    if job.record.state != "SUCCEEDED":
        raise SystemExit(f"job {job.id} ended {job.record.state}: {job.record.error_message}")
    series = job.metrics(["eval/accuracy", "reward/mean"]).series
    accuracy = series.get("eval/accuracy", [])
    print("held-out accuracy: " + ", ".join(f"step {int(s)}: {v:.3f}" for s, v in accuracy))
    rewards = [v for _, v in series.get("reward/mean", [])]
    head, tail = rewards[:10], rewards[-10:]
    print(
        f"before {accuracy[0][1]:.3f}, after {accuracy[-1][1]:.3f} ({args.eval} held-out); "
        f"train reward first 10 steps {sum(head) / len(head):.3f}, last 10 "
        f"{sum(tail) / len(tail):.3f}; {wall:.0f} s from upload to the job's end"
    )


if __name__ == "__main__":
    main()
