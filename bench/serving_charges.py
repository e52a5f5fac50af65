"""What charging the shared model workers' GPU time costs a request and a decode step.

    .venv/bin/python bench/serving_charges.py [--calls 2000] [--rows 16] [--steps 64]
                                              [--rounds 3] [--write]

Every request to the model workers checks its team's month (``jobs.quotas.check_month_budget``):
timed as it runs (the team's usage reused for a moment, the limit read each time), counted
afresh every time (what it would cost without the reuse), against one plain query (``Team``
by its key) as the baseline, on the database the settings name (SQLite in a temporary
directory unless ``DATABASE_URL`` is set). And every batch the worker runs is timed and split
between its teams (``Meter.charge`` by the rows' teams): per decode step of ``--rows`` rows of
four teams, against a decode step of the same rows of the tiny model on its continuous batch.
The best of ``--rounds`` interleaved rounds of each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TITLE = "Charging the model workers' GPU time"


def per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds a call, over ``calls`` calls."""
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args()
    if min(args.calls, args.rows, args.steps, args.rounds) < 1:
        parser.error("--calls, --rows, --steps and --rounds must be >= 1")
    from bench.site import setup_site

    setup_site("bench-charges-")
    import torch
    from django.db import connection
    from django.utils import timezone

    from accounts.models import Quota, Team
    from jobs.charge_services import charge_serving
    from jobs.quotas import check_month_budget
    from tinker_api.worker.meter import Meter
    from tinker_api.worker.requests import Op
    from training.continuous import ContinuousBatch, Row
    from training.engine import Engine
    from training.model import DEFAULT_BASE_MODEL
    from training.types import SamplingParams

    team, _ = Team.objects.get_or_create(slug="bench-charges", defaults={"name": "bench"})
    Quota.objects.get_or_create(team=team)
    charge_serving("tiny", {team.pk: 1.0}, {team.pk: 1})

    torch.set_num_threads(1)
    engine = Engine(DEFAULT_BASE_MODEL, device="cpu")
    prompt = engine.tokenizer.encode("What is 12+7?", add_special_tokens=False)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=1.0, seed=0)
    ops = [Op({"op": "chat", "rid": f"r{i}", "team": i % 4, "n": 1}) for i in range(args.rows)]
    meter = Meter("tiny", gpus=1)

    def charge_step() -> None:
        shares = Counter(op.team for op in ops)
        started = time.perf_counter()
        meter.charge(shares, time.perf_counter() - started + 0.003)

    def fresh() -> None:
        # A moment given: the usage is counted afresh, never reused.
        check_month_budget(team.pk, now)

    def decode_step() -> float:
        batch = ContinuousBatch(engine.model, engine.tokenizer, engine.host)
        batch.add([Row(prompt, params, stop_on_eos=False) for _ in range(args.rows)])
        started = time.perf_counter()
        for _ in range(args.steps):
            batch.step()
        return (time.perf_counter() - started) / args.steps

    before = "/".join(f"{v:.2f}" for v in os.getloadavg())
    best: dict[str, float] = {}
    now = timezone.now()
    for _ in range(args.rounds):
        for name, seconds in (
            ("reused", per_call(lambda: check_month_budget(team.pk), args.calls)),
            ("fresh", per_call(fresh, max(1, args.calls // 4))),
            ("query", per_call(lambda: Team.objects.get(pk=team.pk), args.calls)),
            ("charge", per_call(charge_step, args.calls * 10)),
            ("step", decode_step()),
        ):
            best[name] = min(best.get(name, float("inf")), seconds)
            print(f"{name}: {seconds * 1e6:.1f} us", flush=True)
    after = "/".join(f"{v:.2f}" for v in os.getloadavg())
    us = {name: seconds * 1e6 for name, seconds in best.items()}
    database = connection.vendor
    print(
        f"budget check {us['reused']:.0f} us ({us['reused'] / us['query']:.1f} plain queries), "
        f"counted afresh {us['fresh']:.0f} us ({us['fresh'] / us['query']:.1f}); charging a "
        f"decode step {us['charge']:.1f} us = {100 * us['charge'] / us['step']:.2f}% of the "
        f"step ({us['step'] / 1000:.2f} ms)"
    )
    if args.write:
        command = ("DATABASE_URL=postgres://... " if os.environ.get("DATABASE_URL") else "") + (
            f".venv/bin/python bench/serving_charges.py --calls {args.calls} --rows {args.rows} "
            f"--steps {args.steps} --rounds {args.rounds} --write"
        )
        title = f"{TITLE} ({database})"
        lines = [
            f"## {title}",
            "",
            f"`{command}` ({database}, torch threads 1, load average {before} before and "
            f"{after} after; the best of {args.rounds} interleaved rounds).",
            "",
            "| what | per call | against |",
            "|---|---|---|",
            f"| a request's budget check, the team's usage reused (as it runs) "
            f"| {us['reused']:.0f} us | {us['reused'] / us['query']:.1f}x one plain query "
            f"({us['query']:.0f} us) |",
            f"| the same check, usage counted afresh each time "
            f"| {us['fresh']:.0f} us | {us['fresh'] / us['query']:.1f}x one plain query; "
            f"{us['fresh'] / us['reused']:.1f}x the check as it runs |",
            f"| charging one decode step of {args.rows} rows of 4 teams "
            f"| {us['charge']:.1f} us | {100 * us['charge'] / us['step']:.2f}% of the tiny "
            f"model's decode step of those rows ({us['step'] / 1000:.2f} ms) |",
        ]
        print(f"wrote {write_section_here(title, lines)}")


def write_section_here(title: str, lines: list[str]) -> Path:
    from bench.report import write_section

    return write_section(title, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
