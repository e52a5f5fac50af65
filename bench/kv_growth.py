"""What a continuous batch's KV cache holds when rows may run to the end of the context.

    .venv/bin/python bench/kv_growth.py [--rows 16] [--context 4096] [--steps 512]
                                        [--threads N] [--repeats 2] [--write]

A chat request without ``max_tokens`` may generate up to the rest of the base model's context,
as OpenAI's API defines it. A cache sized for that at prefill holds ``rows x context`` columns
from the first token; the cache of ``training.continuous`` starts with room for
``INITIAL_ROOM`` tokens and doubles when a row needs more. Both are measured in one process on
bench/mfu.py's 76M-parameter Qwen2 (its position limit raised to ``--context``), ``--rows``
rows of a 32-token prompt allowed ``context - 32`` tokens each, decoded for ``--steps``
steps (ignoring EOS): the bytes of the cache's stores after the last step, and decode
tokens/s (the growing cache pays its copies; the one sized at prefill, none), alternating the
two, the best round of each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.mfu import build_model
from bench.report import write_section
from training import continuous
from training.continuous import ContinuousBatch, Row
from training.engine import Engine
from training.types import SamplingParams

TITLE = "KV cache of rows allowed the rest of the context"
PROMPT = 32


def run(engine: Engine, args: argparse.Namespace, room: int) -> tuple[float, int]:
    """Decode tokens/s and the cache's bytes at the end, with ``room`` columns at prefill."""
    continuous.INITIAL_ROOM = room
    batch = ContinuousBatch(engine.model, engine.tokenizer)
    params = SamplingParams(max_tokens=args.context - PROMPT, temperature=1.0, seed=1)
    prompts = [[5 + (i * 7 + j) % 200 for j in range(PROMPT)] for i in range(args.rows)]
    batch.add([Row(p, params, stop_on_eos=False, sample_index=i) for i, p in enumerate(prompts)])
    started = time.perf_counter()
    for _ in range(args.steps):
        batch.step()
    elapsed = time.perf_counter() - started
    state = batch.state
    size = state.key_store.nbytes + state.value_store.nbytes
    return args.rows * args.steps / elapsed, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args()
    if min(args.rows, args.steps, args.threads, args.repeats) < 1:
        parser.error("--rows, --steps, --threads and --repeats must be >= 1")
    if args.context < PROMPT + args.steps:
        parser.error(f"--context must hold the prompt ({PROMPT}) and --steps")
    torch.set_num_threads(args.threads)
    engine = Engine(build_model())
    engine.model.config.max_position_embeddings = args.context
    before = "/".join(f"{v:.2f}" for v in os.getloadavg())
    grown = continuous.INITIAL_ROOM
    best: dict[str, tuple[float, int]] = {}
    for _ in range(args.repeats):
        for name, room in (("sized at prefill", args.context), ("grows from 256", grown)):
            rate, size = run(engine, args, room)
            if name not in best or rate > best[name][0]:
                best[name] = (rate, size)
            print(f"{name}: {rate:.1f} tokens/s, cache {size / 2**20:.1f} MiB", flush=True)
    continuous.INITIAL_ROOM = grown
    after = "/".join(f"{v:.2f}" for v in os.getloadavg())
    fixed, growing = best["sized at prefill"], best["grows from 256"]
    ratio = growing[0] / fixed[0]
    print(
        f"growing / sized at prefill: {ratio:.3f}x tokens/s, "
        f"{growing[1] / 2**20:.1f} vs {fixed[1] / 2**20:.1f} MiB"
    )
    if args.write:
        command = (
            f".venv/bin/python bench/kv_growth.py --rows {args.rows} --context {args.context} "
            f"--steps {args.steps} --threads {args.threads} --repeats {args.repeats} --write"
        )
        lines = [
            f"## {TITLE}",
            "",
            f"`{command}` ({torch.get_num_threads()} torch threads, float32, load average "
            f"{before} before and {after} after; the best of {args.repeats} alternating rounds). "
            f"bench/mfu.py's 76M-parameter Qwen2, {args.rows} rows of a {PROMPT}-token prompt "
            f"each allowed {args.context - PROMPT} tokens (the rest of a {args.context}-token "
            f"context: /v1's default when a request names no max_tokens), {args.steps} decode "
            "steps.",
            "",
            "| cache | decode tokens/s | cache bytes after the last step |",
            "|---|---|---|",
            f"| sized at prefill for every row's max_tokens | {fixed[0]:.1f} "
            f"| {fixed[1] / 2**20:.1f} MiB |",
            f"| starts with room for {grown} tokens, doubles when full | {growing[0]:.1f} "
            f"| {growing[1] / 2**20:.1f} MiB |",
            "",
            f"Growing / sized at prefill: {ratio:.3f}x the tokens/s, "
            f"{growing[1] / fixed[1]:.3f}x the memory.",
        ]
        print(f"wrote {write_section(TITLE, chr(10).join(lines) + chr(10))}")


if __name__ == "__main__":
    main()
