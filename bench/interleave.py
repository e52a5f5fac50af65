"""What a Tinker sampling request does to the chat streams of the same model worker.

    .venv/bin/python bench/interleave.py [--model tiny|mfu] [--rows 32] [--tokens 64]
                                         [--repeats 3] [--write]

A model worker serves the Tinker protocol's sample requests (an RL loop's rollouts: many
rows) and the OpenAI-style chat requests (streams) of one base model. Their rows decode in
one continuous batch, one forward per turn of the worker's loop for both
(``tinker_api.worker.chat.ChatHandler`` with its ``SamplingHandler``). Measured here on one
in-process ``ModelWorker`` (embedded Valkey, SQLite, one torch thread), one streaming chat
request of ``--tokens`` tokens, and a sample request of ``--rows`` rows of ``--tokens``
tokens arriving while it streams:

- chat alone: the request on the idle worker (the baseline for its latencies);
- shared: what the worker does, both in one batch;
- two batches, interleaved: the sample request in a generation batch of its own
  (``training.sampler.generation``) that runs one forward per turn, the chat batch's decode
  step between two of them (what the worker did before the batch was shared);
- two batches, whole: that batch run to its end in one turn (what it did before that);
- and the sample request's own wall time alone and in each mode.

The two-batch modes are built here from the same handler's pieces (``prepare``, ``finish``)
around ``generation``, the same requests in the same run. For the chat request: the longest
gap between two of its tokens and the time to all of them (counted as the worker produces
them, in-process, not through Redis); the sample request arrives once the stream has a
quarter of its tokens, so the gap measures the stall. Medians of ``--repeats`` rounds, the
modes alternating in each.
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
MODES = ("chat alone", "sampling alone", "shared", "interleaved", "whole")


class TwoBatches:
    """The sample requests of ``worker`` in a generation batch of their own, beside its
    chat batch: one forward per turn (``whole``: the batch to its end in one turn)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.whole = False
        self.batch: tuple[Any, Any] | None = None
        self.shared_step = worker.step

    @property
    def busy(self) -> bool:
        """Whether sample rows still decode, in either mode."""
        return self.batch is not None or self.worker.sampling.busy

    def step(self) -> bool:
        from training.sampler import generation

        worker = self.worker
        samples = [op for op in worker.chats if op.kind == "sample"]
        worker.chats = [op for op in worker.chats if op.kind != "sample"]
        for op in samples:
            run, rows = worker.sampling.prepare(op)
            steps = generation(
                worker.engine.model,
                worker.engine.tokenizer,
                [r.prompt for r in rows],
                [r.params for r in rows],
                adapters=[r.adapter for r in rows],
                host=worker.engine.host,
                sample_indices=[r.sample_index for r in rows],
                stop_on_eos=[r.stop_on_eos for r in rows],
                topk_logprobs=[r.topk for r in rows],
            )
            self.batch = (run, steps)
        if self.batch is not None:
            run, steps = self.batch
            try:
                next(steps)
                while self.whole:
                    next(steps)
            except StopIteration as done:
                run.rows = done.value
                worker.sampling.finish([run])
                self.batch = None
        self.shared_step()
        return True


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


def run_mode(worker: Any, two: TwoBatches, mode: str, args: argparse.Namespace) -> dict[str, float]:
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
        idle = not two.busy
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

    from tinker_api.worker.server import ModelWorker
    from training.model import DEFAULT_BASE_MODEL

    if args.model == "mfu":
        from bench.mfu import build_model

        path = str(build_model())
    else:
        path = DEFAULT_BASE_MODEL
    worker = ModelWorker(BASE, path, "cpu", "w-bench-interleave")
    torch.set_num_threads(1)

    two = TwoBatches(worker)
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    run_mode(worker, two, "shared", args)  # warm-up: allocations, the chat template
    for _ in range(args.repeats):
        for mode in MODES:
            two.whole = mode == "whole"
            worker.step = two.step if mode in ("interleaved", "whole") else two.shared_step  # type: ignore[method-assign]
            results[mode].append(run_mode(worker, two, mode, args))
    worker.step = two.shared_step  # type: ignore[method-assign]

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

    def ratio(mode: str, key: str, base: str) -> float:
        return med(mode, key) / med(base, key)

    ratios = (
        "Longest gap beside the sample request / alone: "
        + ", ".join(f"{m} {ratio(m, 'max_gap', 'chat alone'):.1f}x" for m in MODES[2:])
        + ". The sample request's wall time beside the stream / alone: "
        + ", ".join(f"{m} {ratio(m, 'sampling_wall', 'sampling alone'):.2f}x" for m in MODES[2:])
        + ". The stream's time to all its tokens beside it / alone: "
        + ", ".join(f"{m} {ratio(m, 'chat_wall', 'chat alone'):.2f}x" for m in MODES[2:])
        + "."
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
