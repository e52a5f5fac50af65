"""SFT on demonstrations, then RL from the SFT job's adapter, as managed jobs of a running
service: the held-out game reward before and after the RL job.

    .venv/bin/python manage.py demo --smoke --steps 1 --keep-serving   # prints URL and key
    .venv/bin/python scripts/build_textarena_demos.py --game Nim-v0 --out var/nim-demos.jsonl
    .venv/bin/python bench/sft_then_rl.py --url URL --key KEY --rows var/nim-demos.jsonl \\
        [--game Nim-v0] [--sft-steps 40] [--sft-lr 1e-3] [--rl-steps 30] [--prompts 8] [--group 8] \\
        [--max-tokens 10] [--temperature 1.0] [--top-p 1.0] [--rl-lr 1e-3] [--sft-job ID] [--seed 1] [--algorithm JSON] \\
        [--action-format boxed|text] [--no-rules]

Uploads the rows (`env: math`), runs an SFT job on them, then an RL job on the `textarena`
game against its random opponent (`action_format` "boxed", or "text" for rows built with
`--action-format text`) whose `init.from_job` names the
SFT job, with greedy evaluation on 100 held-out games at step 0 (the SFT policy), every 10
steps and at the end. Only the thin client talks to the service.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "client"))

LORA = {"rank": 8, "alpha": 16}


def _finish(job: Any, what: str, started: float) -> Any:
    job.wait(poll=2.0, max_poll=10.0)
    state = job.record.state
    print(f"{what} {job.id}: {state} after {time.perf_counter() - started:.0f} s", flush=True)
    if state != "SUCCEEDED":
        raise SystemExit(f"{what} ended {state}: {job.record.error_message}")
    return job


def _sft(client: Any, args: argparse.Namespace, started: float) -> Any:
    dataset = client.datasets.upload(args.rows, env="math", name=f"demos-{int(time.time())}")
    sft = client.jobs.submit(
        {
            "method": "sft",
            "env": "math",
            "dataset": str(dataset.id),
            "steps": args.sft_steps,
            "batch_size": 32,
            "seed": 1,
            "lora": LORA,
            "optimizer": {"lr": args.sft_lr},
            "checkpoint_every": 0,
        },
        name="demos-sft",
    )
    return _finish(sft, "SFT job", started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--rows", type=Path, required=True)
    parser.add_argument("--game", default="Nim-v0")
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument(
        "--max-tokens", type=int, default=10, help="of a move (\\boxed{...} whole: 16 for words)"
    )
    parser.add_argument(
        "--action-format",
        choices=("boxed", "text"),
        default="boxed",
        help="of the RL job; the rows' (scripts/build_textarena_demos.py) must match",
    )
    parser.add_argument(
        "--no-rules",
        action="store_true",
        help="the env's `rules: false`; the rows must be built with --no-rules too",
    )
    parser.add_argument("--seed", type=int, default=1, help="of the RL job")
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--rl-lr", type=float, default=1e-3)
    parser.add_argument("--temperature", type=float, default=1.0, help="of the RL rollouts")
    parser.add_argument("--top-p", type=float, default=1.0, help="of the RL rollouts")
    parser.add_argument("--sft-job", help="start RL from this finished SFT job (no upload, no SFT)")
    parser.add_argument(
        "--algorithm",
        type=json.loads,
        default={},
        help='more of the RL job\'s algorithm section, e.g. \'{"loss_aggregation": "sequence_mean"}\'',
    )
    args = parser.parse_args()
    from opentinker import Client

    client = Client(args.url, args.key)
    started = time.perf_counter()
    if args.sft_job:
        sft = client.jobs.get(args.sft_job)
    else:
        sft = _sft(client, args, started)
    rl = client.jobs.submit(
        {
            "method": "rl",
            "env": "textarena",
            "env_config": {
                "game": args.game,
                "action_format": args.action_format,
                "rules": not args.no_rules,
                "max_tokens": args.max_tokens,
            },
            "init": {"from_job": str(sft.id)},
            "steps": args.rl_steps,
            "seed": args.seed,
            "rollout": {
                "group_size": args.group,
                "prompts_per_step": args.prompts,
                "max_tokens": args.max_tokens,
                "max_turns": 16,
                "temperature": args.temperature,
                "top_p": args.top_p,
            },
            "algorithm": {"advantage": "grpo", "normalize_std": True, **args.algorithm},
            "lora": LORA,
            "optimizer": {"lr": args.rl_lr},
            "eval_every": 10,
            "eval_examples": 100,
            "checkpoint_every": 10,
        },
        name="demos-rl",
    )
    _finish(rl, "RL job", started)
    series = rl.metrics(["eval/reward", "eval/win", "reward/mean"]).series
    for name in ("eval/reward", "eval/win"):
        points = series.get(name, [])
        print(f"held-out {name}: " + ", ".join(f"step {int(s)}: {v:.2f}" for s, v in points))
    rewards = [v for _, v in series.get("reward/mean", [])]
    head, tail = rewards[:5], rewards[-5:]
    print(
        f"train reward/mean first 5 steps {sum(head) / len(head):.3f}, last 5 "
        f"{sum(tail) / len(tail):.3f}; {time.perf_counter() - started:.0f} s in all"
    )


if __name__ == "__main__":
    main()
