"""What a Tinker model worker giving its block back costs the client whose model it held.

    .venv/bin/python bench/handover.py [--model mfu|tiny] [--threads N] [--repeats 3] [--write]

A model worker that leaves (idle, a queued job waiting for its GPUs, a warm shutdown) writes
each live model's whole state (``Policy.save_state``: weights, Adam moments, step, RNG), and
the next worker of that base model loads the base model and takes the model up from that file
(``tinker_api.worker.policies``). Measured here in one process on the same threads, for LoRA
r16 on every linear layer and for full fine-tuning:

- leave: ``save_state`` of the model after one optimizer step (its moments exist), and the
  file's size;
- take up: a new ``Engine`` loaded from the model directory, ``create_policy`` and
  ``load_state`` of that file (what the next worker does before the client's request runs;
  a new worker also pays its process's imports and the Celery task's start, not counted);
- baseline: one training step of the same model (``forward_backward`` + ``optim_step`` on
  ``--batch`` rows of ``--seq`` tokens), so each cost reads as a number of steps.

The models are bench/mfu.py's 76M-parameter Qwen2 (``--model mfu``, cached under
``var/mfu-model``) or the tiny test model (``--model tiny``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.engine import median_time
from bench.mfu import batch, build_model
from bench.report import write_section
from training import ops
from training.engine import Engine
from training.model import DEFAULT_BASE_MODEL
from training.types import AdamParams

LORA_RANK = 16
TITLE = "Model worker handover"


def measure(path: Path, full: bool, args: argparse.Namespace) -> dict[str, float]:
    engine = Engine(path)
    datums = batch(engine.model.config.vocab_size, args.batch, args.seq)
    policy = engine.create_policy(rank=LORA_RANK, alpha=2 * LORA_RANK, full_finetune=full)
    adam = AdamParams(learning_rate=1e-5)

    def step() -> None:
        ops.forward_backward(policy, datums, "cross_entropy")
        ops.optim_step(policy, adam)

    step()  # warm-up, and the Adam moments a real state has
    step_s = median_time(step, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "live.pt"
        leave_s = median_time(lambda: policy.save_state(state), args.repeats)
        size = state.stat().st_size
        engine.remove_policy(policy.id)

        def take_up() -> None:
            fresh = Engine(path)
            taken = fresh.create_policy(
                rank=LORA_RANK, alpha=2 * LORA_RANK, full_finetune=full, policy_id="taken"
            )
            taken.load_state(state)

        take_s = median_time(take_up, args.repeats)
    return {"step": step_s, "leave": leave_s, "size": size, "take": take_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mfu", "tiny"), default="mfu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args()
    if min(args.threads, args.batch, args.seq, args.repeats) < 1:
        parser.error("--threads, --batch, --seq and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    path = build_model() if args.model == "mfu" else Path(DEFAULT_BASE_MODEL)
    before = "/".join(f"{v:.2f}" for v in os.getloadavg())
    rows = {}
    for name, full in (("LoRA r16", False), ("full fine-tuning", True)):
        r = measure(path, full, args)
        rows[name] = r
        print(
            f"{name}: step {r['step']:.3f} s; leave {r['leave']:.3f} s "
            f"({r['leave'] / r['step']:.2f} steps, {r['size'] / 2**20:.1f} MiB); "
            f"take up {r['take']:.3f} s ({r['take'] / r['step']:.2f} steps)"
        )
    after = "/".join(f"{v:.2f}" for v in os.getloadavg())
    if args.write:
        command = (
            f".venv/bin/python bench/handover.py --model {args.model} --threads {args.threads} "
            f"--batch {args.batch} --seq {args.seq} --repeats {args.repeats} --write"
        )
        lines = [
            f"## {TITLE}",
            "",
            f"`{command}` ({args.model} model, {torch.get_num_threads()} torch threads, "
            f"load average {before} before and {after} after; medians of {args.repeats}). "
            "What a model worker that gives its block back (idle, a queued job waiting for its "
            "GPUs, a warm shutdown) costs the client whose model it held: writing the model's "
            "whole state, and the next worker loading the base model and that state before "
            "the client's next request runs, each against one training step of the same model "
            f"({args.batch} x {args.seq} tokens, `forward_backward` + `optim_step`) measured in "
            "the same run. A new worker also pays its process's imports and its task's start, "
            "not counted here.",
            "",
            "| policy | training step (s) | leave: write the state (s) | in steps | state size "
            "| take up: load base model + state (s) | in steps |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in rows.items():
            lines.append(
                f"| {name} | {r['step']:.3f} | {r['leave']:.3f} | {r['leave'] / r['step']:.2f} "
                f"| {r['size'] / 2**20:.1f} MiB | {r['take']:.3f} | {r['take'] / r['step']:.2f} |"
            )
        print(f"wrote {write_section(TITLE, chr(10).join(lines) + chr(10))}")


if __name__ == "__main__":
    main()
