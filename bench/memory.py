"""Memory of a training step on a real-sized model: peak RSS, and the largest batch in a budget.

    .venv/bin/python bench/memory.py [--threads 2] [--seq 512] [--budget-gib 8] [--write]

The model is `bench/mfu.py`'s (Qwen2 architecture, ~76M parameters, float32, cached under
``var/mfu-model``). Each measurement is one process that loads the engine, runs one
``forward_backward`` + ``optim_step`` on ``rows`` x ``seq`` tokens and reports its peak RSS
(``ru_maxrss``), so no run inherits another's high-water mark. For LoRA r16 and full
fine-tuning, each with and without activation checkpointing (``recompute=True``):

- peak RSS at 2 and 6 rows, hence the RSS of the step without activations (the intercept)
  and the bytes each token adds (the slope);
- the largest batch (rows of ``seq`` tokens) those predict within the budget, then run at that
  size to check it does fit (its peak RSS is printed), and at one row more;
- the step's tokens/s at 6 rows, so that recomputation's price is a ratio of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_section as record

SMALL, LARGE = 2, 6
LORA_RANK = 16


def probe(mode: str, rows: int, seq: int, recompute: bool, threads: int) -> dict[str, float]:
    """Run one step in a fresh process; its peak RSS and timing."""
    command = [
        sys.executable,
        __file__,
        "--probe",
        json.dumps({"mode": mode, "rows": rows, "seq": seq, "recompute": recompute}),
        "--threads",
        str(threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"probe {mode} rows={rows} failed: {done.stderr[-2000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def run_probe(spec: dict[str, Any]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.mfu import batch, build_model
    from training import ops
    from training.engine import Engine
    from training.types import AdamParams

    engine = Engine(str(build_model()), device="cpu")
    if spec["mode"] == "full":
        policy = engine.create_policy(full_finetune=True)
    else:
        policy = engine.create_policy(rank=LORA_RANK, alpha=2 * LORA_RANK, seed=0)
    datums = batch(engine.model.config.vocab_size, spec["rows"], spec["seq"])
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    start = time.perf_counter()
    ops.forward_backward(policy, datums, "cross_entropy", recompute=spec["recompute"])
    ops.optim_step(policy, AdamParams(learning_rate=1e-5))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    tokens = spec["rows"] * spec["seq"]
    print(json.dumps({"peak_gib": peak, "loaded_gib": loaded, "tok_s": tokens / seconds}))


def measure(mode: str, recompute: bool, args: argparse.Namespace) -> dict[str, Any]:
    small = probe(mode, SMALL, args.seq, recompute, args.threads)
    large = probe(mode, LARGE, args.seq, recompute, args.threads)
    per_row = (large["peak_gib"] - small["peak_gib"]) / (LARGE - SMALL)
    base = small["peak_gib"] - SMALL * per_row
    # The line through the last two runs predicts the largest batch; each prediction is run,
    # and the next line goes through it, between the largest size that fitted (`fit`) and the
    # smallest that did not (`over`), until they are one row apart or the cap is reached.
    runs = {SMALL: small["peak_gib"], LARGE: large["peak_gib"]}
    last = (LARGE, large["peak_gib"])
    fit, over = (LARGE, None) if large["peak_gib"] <= args.budget_gib else (0, LARGE)
    for _ in range(args.max_probes):
        slope = (last[1] - runs[SMALL]) / (last[0] - SMALL)
        guess = int(SMALL + (args.budget_gib - runs[SMALL]) / slope) if slope > 0 else args.max_rows
        upper = (over - 1) if over is not None else args.max_rows
        guess = max(fit + 1, min(guess, upper))
        if guess > upper or guess in runs:
            break
        runs[guess] = probe(mode, guess, args.seq, recompute, args.threads)["peak_gib"]
        last = (guess, runs[guess])
        if runs[guess] <= args.budget_gib:
            fit = guess
        else:
            over = guess
        if over is not None and over - fit <= 1:
            break
    result = {
        "base_gib": base,
        "per_token_kib": per_row / args.seq * 2**20,
        "rows": fit,
        "at_least": over is None,
        "peak_gib": runs.get(fit, float("nan")),
        "over_rows": over,
        "over_peak_gib": runs[over] if over is not None else None,
        "tok_s": large["tok_s"],
        "peak_small": small["peak_gib"],
        "peak_large": large["peak_gib"],
    }
    print(f"  {mode:4s} recompute={recompute!s:5s} {json.dumps(result)}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--max-rows", type=int, default=64)
    parser.add_argument("--max-probes", type=int, default=4)
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.probe:
        run_probe(json.loads(args.probe))
        return
    loadavg = "/".join(f"{x:.1f}" for x in os.getloadavg())
    from bench.mfu import build_model

    build_model()
    print(f"memory: seq {args.seq}, budget {args.budget_gib} GiB, load {loadavg}", flush=True)
    results = {
        (mode, recompute): measure(mode, recompute, args)
        for mode in ("lora", "full")
        for recompute in (False, True)
    }
    after = "/".join(f"{x:.1f}" for x in os.getloadavg())
    for mode in ("lora", "full"):
        plain, saved = results[(mode, False)], results[(mode, True)]
        print(
            f"{mode}: largest batch in {args.budget_gib:g} GiB {plain['rows']} x {args.seq} "
            f"tokens, recomputing {'>= ' if saved['at_least'] else ''}{saved['rows']} x {args.seq} "
            f"({saved['rows'] / max(plain['rows'], 1):.1f}x); activations {plain['per_token_kib']:.0f} "
            f"vs {saved['per_token_kib']:.0f} KiB/token; tokens/s recomputing "
            f"{saved['tok_s'] / plain['tok_s']:.2f}x of plain"
        )
    if args.write:
        command = (
            f".venv/bin/python bench/memory.py --threads {args.threads} --seq {args.seq} "
            f"--budget-gib {args.budget_gib:g} --write"
        )
        print(f"wrote {write_section(results, args, command, f'{loadavg} -> {after}')}")


def write_section(
    results: dict[tuple[str, bool], dict[str, Any]],
    args: argparse.Namespace,
    command: str,
    load: str,
) -> Path:
    rows = []
    for mode, label in (("lora", f"LoRA r{LORA_RANK}"), ("full", "full fine-tuning")):
        for recompute in (False, True):
            r = results[(mode, recompute)]
            if r["over_rows"] is not None:
                over = f"{r['over_rows']} rows: {r['over_peak_gib']:.2f} GiB"
            else:
                over = "none run (at least this many fit)"
            least = "at least " if r["at_least"] else ""
            rows.append(
                f"| {label} | {'yes' if recompute else 'no'} | {r['peak_small']:.2f} / "
                f"{r['peak_large']:.2f} | {r['base_gib']:.2f} | {r['per_token_kib']:.0f} | "
                f"**{least}{r['rows']}** x {args.seq} ({r['peak_gib']:.2f} GiB) | {over} | "
                f"{r['tok_s']:.0f} |"
            )
    ratios = []
    for mode in ("lora", "full"):
        plain, saved = results[(mode, False)], results[(mode, True)]
        ratios.append(
            f"{mode}: {'at least ' if saved['at_least'] else ''}"
            f"{saved['rows'] / max(plain['rows'], 1):.1f}x the batch, "
            f"{saved['tok_s'] / plain['tok_s']:.2f}x the tokens/s"
        )
    section = f"""## Memory of a training step (76M-parameter model)

Command: `{command}` ({time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, {os.cpu_count()}
CPU cores, {args.threads} torch threads, Python {platform.python_version()}, load average
{load}).

`bench/mfu.py`'s model (Qwen2 architecture, 12 layers, hidden 768, float32), one
`forward_backward` + `optim_step` per process on rows of {args.seq} tokens, peak RSS
(`ru_maxrss`). The step's memory without activations and the bytes each token adds come from
two sizes ({SMALL} and {LARGE} rows); the largest batch within {args.budget_gib:g} GiB is
predicted from them, run, and predicted again through the last run (at most
{args.max_probes} runs, at most {args.max_rows} rows). Recomputation is
`forward_backward(recompute=True)` (JobSpec `activation_checkpointing`).

| Policy | Recompute | Peak at {SMALL} / {LARGE} rows (GiB) | Without activations (GiB) | KiB per token | Largest batch in {args.budget_gib:g} GiB | Smallest run over it | tokens/s at {LARGE} rows |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Recomputing activations, same run: {"; ".join(ratios)}.
"""
    return record("Memory of a training step (76M-parameter model)", section)


if __name__ == "__main__":
    main()
