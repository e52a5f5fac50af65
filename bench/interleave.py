"""What a Tinker sampling batch does to the chat streams of the same model worker.

    .venv/bin/python bench/interleave.py [--model tiny|mfu] [--rows 32] [--tokens 64]
                                         [--repeats 3] [--write]

A model worker serves the Tinker protocol's sampling batches (an RL loop's rollouts: many
rows, run to their end) and the OpenAI-style chat batch (streams) of one base model. The
sampling batch runs one forward per turn of the worker's loop, with the chat batch's decode
step between two of them (``tinker_api.worker.sampling.SampleBatch``). Measured here on one
in-process ``ModelWorker`` (embedded Valkey, SQLite, one torch thread), one streaming chat
request of ``--tokens`` tokens, and a sampling request of ``--rows`` rows of ``--tokens``
tokens arriving while it streams:

- chat alone: the request on the idle worker (the baseline for its latencies);
- beside the batch, interleaved: what the worker does;
- beside the batch, whole: the batch run to its end in one turn (what the worker did
  before), the same requests in the same run;
- and the sampling batch's own wall time alone and in both modes.

For the chat request: the longest gap between two of its tokens and the time to all of them
(counted as the worker produces them, in-process, not through Redis); the sampling
request arrives once the stream has a quarter of its tokens, so the gap measures the stall. Medians of
``--repeats`` rounds, the modes alternating in each.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench.report import write_section
from bench.site import setup_site

TITLE = "Chat streams beside a Tinker sampling batch"
BASE = "bench-interleave"
MODES = ("chat alone", "sampling alone", "interleaved", "whole")


def sample_op(rows: int, tokens: int) -> dict[str, Any]:
    return {
        "op": "sample",
        "target": {},
        "prompt": list(range(5, 21)),
        "n": rows,
        "params": {
            "max_tokens": tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "seed": 3,
            "stop_on_eos": False,
        },
    }


def chat_op(tokens: int) -> dict[str, Any]:
    return {
        "op": "chat",
        "target": {},
        "mode": "chat",
        "messages": [{"role": "user", "content": "What is 12+7?"}],
        "n": 1,
        "stream": True,
        "logprobs": False,
        "top_logprobs": 0,
        "max_context": 512,
        "params": {
            "max_tokens": tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "seed": 1,
            "stop": [],
            "ignore_eos": True,
        },
    }


def run_mode(worker: Any, mode: str, args: argparse.Namespace) -> dict[str, float]:
    from tinker_api import futures

    def submit(op: dict[str, Any]) -> str:
        rid = futures.new_request_id()
        futures.submit(rid, {**op, "rid": rid}, team_id=1, base=BASE)
        return rid

    def ended(rid: str | None) -> bool:
        fut = futures.get(rid) if rid else None
        return rid is None or (fut is not None and fut["status"] in (futures.DONE, futures.FAILED))

    # The chat request streams; the sampling request arrives once it has a quarter of its
    # tokens (at once when there is no chat request).
    chat = submit(chat_op(args.tokens)) if mode != "sampling alone" else None
    chat_sent = time.perf_counter()
    sample: str | None = None
    started = sample_done = None
    times: list[float] = []
    running: Any = None
    while True:
        quarter = chat is None or len(times) >= args.tokens // 4
        if sample is None and mode != "chat alone" and quarter:
            sample = submit(sample_op(args.rows, args.tokens))
            started = time.perf_counter()
        # Redis is asked only once the worker holds neither request: the benchmark's own
        # round trips stay out of the steps it times.
        chat_over = chat is None or (running is not None and running.ended and ended(chat))
        if chat_over and (mode == "chat alone" or (sample is not None and sample_done)):
            break
        worker.read(0)
        worker.step()
        now = time.perf_counter()
        if chat is not None and running is None:
            running = next((run for run in worker.chat.runs if run.rid == chat), None)
        # The request object outlives its place in the batch: its last tokens count too.
        made = sum(c.tokens for c in running.choices) if running is not None else 0
        if made > len(times):
            times += [now] * (made - len(times))
        idle = worker.sampling_batch is None and not worker.samples
        if sample is not None and sample_done is None and idle and ended(sample):
            sample_done = now
    assert chat is None or len(times) == args.tokens, len(times)
    out: dict[str, float] = {}
    if sample is not None and started is not None:
        assert futures.get(sample)["status"] == futures.DONE, futures.get(sample)
        out["sampling_wall"] = (sample_done or time.perf_counter()) - started
    if chat is not None:
        assert futures.get(chat)["status"] == futures.DONE, futures.get(chat)
        out["max_gap"] = max(b - a for a, b in itertools.pairwise(times))
        out["chat_wall"] = times[-1] - chat_sent
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "mfu"), default="tiny")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args()
    if min(args.rows, args.tokens, args.repeats) < 1 or args.tokens < 2:
        parser.error("--rows and --repeats must be >= 1, --tokens >= 2")
    setup_site("bench-interleave-")
    import torch

    from tinker_api.worker import sampling
    from tinker_api.worker.server import ModelWorker
    from training.model import DEFAULT_BASE_MODEL

    if args.model == "mfu":
        from bench.mfu import build_model

        path = str(build_model())
    else:
        path = DEFAULT_BASE_MODEL
    worker = ModelWorker(BASE, path, "cpu", "w-bench-interleave")
    torch.set_num_threads(1)

    interleaved_advance = sampling.SampleBatch.advance

    def whole_advance(self: Any) -> bool:
        while not interleaved_advance(self):
            pass
        return True

    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    run_mode(worker, "interleaved", args)  # warm-up: allocations, the chat template
    for _ in range(args.repeats):
        for mode in MODES:
            sampling.SampleBatch.advance = whole_advance if mode == "whole" else interleaved_advance  # type: ignore[method-assign]
            results[mode].append(run_mode(worker, mode, args))
    sampling.SampleBatch.advance = interleaved_advance  # type: ignore[method-assign]

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    def span(mode: str, key: str, scale: float = 1000.0) -> str:
        values = sorted(r[key] * scale for r in results[mode])
        return f"{statistics.median(values):.0f} ({values[0]:.0f}-{values[-1]:.0f})"

    load = os.getloadavg()
    rows = [
        f"| {mode} | {span(mode, 'max_gap') if 'max_gap' in results[mode][0] else ''} | "
        f"{span(mode, 'chat_wall') if 'chat_wall' in results[mode][0] else ''} | "
        f"{span(mode, 'sampling_wall') if 'sampling_wall' in results[mode][0] else ''} |"
        for mode in MODES
    ]
    table = "\n".join(
        [
            "| mode | chat: longest gap between tokens (ms) "
            "| chat: all its tokens (ms) | sampling batch: wall (ms) |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    ratios = (
        f"Longest gap beside the batch / alone: interleaved "
        f"{med('interleaved', 'max_gap') / med('chat alone', 'max_gap'):.1f}x, whole "
        f"{med('whole', 'max_gap') / med('chat alone', 'max_gap'):.1f}x. The sampling batch's wall "
        f"time beside the stream / alone: interleaved "
        f"{med('interleaved', 'sampling_wall') / med('sampling alone', 'sampling_wall'):.2f}x, "
        f"whole {med('whole', 'sampling_wall') / med('sampling alone', 'sampling_wall'):.2f}x."
    )
    print(table)
    print(ratios)
    if args.write:
        command = (
            f".venv/bin/python bench/interleave.py --model {args.model} --rows {args.rows} "
            f"--tokens {args.tokens} --repeats {args.repeats} --write"
        )
        section = (
            f"## {TITLE}\n\n`{command}` ({os.cpu_count()} CPUs, load average "
            f"{load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} at the end; {args.model} model, "
            f"one torch thread). One in-process model worker: one streaming chat request of "
            f"{args.tokens} tokens, and a Tinker sampling request of {args.rows} rows x "
            f"{args.tokens} tokens arriving once the stream has a quarter of its tokens. Medians of {args.repeats} rounds, range in "
            f"brackets (bench/interleave.py's docstring has the method).\n\n{table}\n\n{ratios}\n"
        )
        print(f"wrote {write_section(TITLE, section, keep_subsections=True)}")


if __name__ == "__main__":
    main()
