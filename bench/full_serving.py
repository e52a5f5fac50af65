"""Serving a fully fine-tuned policy on /v1: its own model and decode batch beside the base's.

A full fine-tuning job (a job row of the team with the ``model/`` directory a run exports,
weights moved away from the base so that it samples its own text) is served through
``/v1/chat/completions`` with ``stream: true`` by the official ``openai`` client, on
bench/tinker_stack.py's stack (gunicorn, a Celery worker running the model worker, embedded
Valkey, SQLite). One run measures, on one stack:

(a) 8 clients on the full model at once, ``--requests`` requests each, against (b) the same
    requests on the base model: completion tokens/s. (a)/(b) near 1: a full model's batch
    decodes as fast as the base model's (same architecture, same decoder);
(c) 4 clients on the base and 4 on the full model at once, against (b): the two models decode
    in two batches of 4 rows, one after the other in the worker's loop, where 8 rows of one
    model (or of adapters over it) share one batch. (c)/(b) is what that costs;
(d) the time to first token of one request alone on the full model when the worker holds it
    (warm) and when it must load it first (cold: the model was dropped after
    ``OPENTINKER_OPENAI_FULL_IDLE_SECONDS``, set to 1 here), against one on the base model.

Every request decodes exactly ``--max-tokens`` tokens (``ignore_eos``). ``--repeat`` measures
again on the same stack; figures are medians with their range.

Run: ``.venv/bin/python bench/full_serving.py`` (``--write`` updates docs/benchmarks.md;
``--model mfu`` serves bench/mfu.py's 76M-parameter model).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_section
from bench.serving import MODELS, Request, serve, spread
from bench.tinker_stack import BASE, Stack

CLIENTS = 8
IDLE_SECONDS = 1
TITLE = "OpenAI serving of a fully fine-tuned policy"


def title(model: str) -> str:
    return TITLE if model == "tiny" else f"{TITLE}, {MODELS[model].title.split(', ')[-1]}"


def make_full_job(engine: Any) -> str:
    """A finished full fine-tuning job of the bench team on disk; its model name."""
    import torch
    from django.conf import settings
    from django.contrib.auth import get_user_model

    from accounts.models import Team
    from jobs.models import Job, JobState

    team = Team.objects.get(slug__startswith="bench-")
    job = Job.objects.create(
        team=team,
        created_by=get_user_model().objects.get(username=team.slug),
        name="full",
        spec={"method": "rl", "env": "bandit", "base_model": BASE, "full_finetune": True},
        spec_version=1,
        state=JobState.SUCCEEDED,
    )
    policy = engine.create_policy(full_finetune=True, policy_id="bench-full")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in policy.model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.02)
    out = Path(settings.OPENTINKER_DATA_DIR) / "jobs" / str(job.pk) / "model"
    policy.export_full(policy.snapshot(), out)
    engine.tokenizer.save_pretrained(str(out))
    engine.remove_policy(policy.id)
    return f"job:{job.pk}"


def clients_on(models: list[int], requests: int) -> list[list[Request]]:
    """One client per entry of ``models`` (0: the base, 1: the full model)."""
    return [
        [
            Request(
                policy=m,
                messages=[{"role": "user", "content": f"What is {c + 10}+{r * 7 + 3}?"}],
                seed=1000 * c + r,
            )
            for r in range(requests)
        ]
        for c, m in enumerate(models)
    ]


def tps(run: dict[str, Any]) -> float:
    return float(run["tokens"]) / float(run["seconds"])


def measure(
    url: str, key: str, names: list[str], args: argparse.Namespace, turn: int
) -> dict[str, float]:
    def go(models: list[int], requests: int = args.requests) -> dict[str, Any]:
        return serve(url, key, names, clients_on(models, requests), args.max_tokens)

    # Which of (a) and (b) goes first alternates between repeats, so that neither always
    # follows the cold load of the repeat before.
    if turn % 2:
        base = tps(go([0] * CLIENTS))
        full = tps(go([1] * CLIENTS))
    else:
        full = tps(go([1] * CLIENTS))
        base = tps(go([0] * CLIENTS))
    mixed = tps(go([0, 1] * (CLIENTS // 2)))
    warm = go([1], 1)["ttft"][0]
    alone = go([0], 1)["ttft"][0]
    time.sleep(IDLE_SECONDS + 2.5)  # the worker drops the idle full model
    cold = go([1], 1)["ttft"][0]
    return {
        "full_tps": full,
        "base_tps": base,
        "mixed_tps": mixed,
        "full_vs_base": full / base,
        "mixed_vs_base": mixed / base,
        "warm_ms": 1000.0 * warm,
        "cold_ms": 1000.0 * cold,
        "alone_ms": 1000.0 * alone,
    }


def section(runs: list[dict[str, float]], args: argparse.Namespace, load: tuple[str, str]) -> str:
    def col(k: str, fmt: str = ".0f") -> str:
        return spread([r[k] for r in runs], fmt)

    return f"""## {title(args.model)}

`python bench/full_serving.py --model {args.model} --requests {args.requests} --repeat {args.repeat} --write`
({platform.machine()}, {os.cpu_count()} CPUs shared with other work, load average {load[0]}
before and {load[1]} after; {MODELS[args.model].description}; torch threads
{args.threads}). A full fine-tuning job's exported model served on `/v1` beside its base
model: {CLIENTS} streaming `openai` clients, {args.requests} chat requests each,
{args.max_tokens} tokens each (`ignore_eos`). Medians of {args.repeat} repeats on one stack,
range in brackets (bench/full_serving.py's docstring says what each side is).

| measurement | tokens/s or ms | ratio |
|---|---|---|
| (a)/(b) {CLIENTS} clients on the full model vs the same on the base model | {col("full_tps")} vs {col("base_tps")} | {col("full_vs_base", ".2f")}x |
| (c)/(b) {CLIENTS // 2} clients on each at once (two decode batches) vs {CLIENTS} on the base (one) | {col("mixed_tps")} vs {col("base_tps")} | {col("mixed_vs_base", ".2f")}x |
| (d) time to first token alone: the full model held / loaded first / the base model | {col("warm_ms")} / {col("cold_ms")} / {col("alone_ms")} ms | |

A full model decodes as the base does (a); two models cost two decode steps per turn, so a
worker serving the base and a full model at once gives each about what half the rows of one
batch would cost (c), unlike adapters, which share the base model's batch. The first request
after the model was dropped pays its load from disk (d).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="whole measurements, one stack")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args()
    if min(args.threads, args.requests, args.max_tokens, args.repeat) < 1:
        parser.error("every count must be >= 1")
    import logging

    import torch

    torch.set_num_threads(args.threads)
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ["OPENTINKER_OPENAI_FULL_IDLE_SECONDS"] = str(IDLE_SECONDS)
    before = f"{os.getloadavg()[0]:.2f}"
    print(f"load average {before}", flush=True)
    base_path = MODELS[args.model].path()
    stack = Stack(args.threads, 32, base_path=base_path)
    runs = []
    try:
        stack.start()
        from training.engine import Engine

        names = [BASE, make_full_job(Engine(base_path, "cpu"))]
        url, key = stack.url + "v1", stack.key.removeprefix("tml-")
        serve(url, key, names, clients_on([0, 1], 1), 4)  # warm-up: the worker starts
        for i in range(args.repeat):
            run = measure(url, key, names, args, i)
            runs.append(run)
            print(
                f"[{i + 1}/{args.repeat}] full {run['full_tps']:.0f} tok/s, base "
                f"{run['base_tps']:.0f} ({run['full_vs_base']:.2f}x); both at once "
                f"{run['mixed_tps']:.0f} ({run['mixed_vs_base']:.2f}x); TTFT alone: full held "
                f"{run['warm_ms']:.0f} ms, loaded first {run['cold_ms']:.0f} ms, base "
                f"{run['alone_ms']:.0f} ms; load average {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    finally:
        stack.stop()
    after = f"{os.getloadavg()[0]:.2f}"
    print(f"load average {after}", flush=True)
    if args.write:
        path = write_section(title(args.model), section(runs, args, (before, after)))
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
