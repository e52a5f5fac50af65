"""Requests joining a running decode batch on the model's own forward (Hugging Face cache).

    .venv/bin/python bench/join_hf.py [--requests 32] [--every-ms 20] [--tokens 24]
                                      [--threads N] [--repeats 3] [--write]

A model outside the fused decoder's architectures (here models/tiny-vl, a Qwen2.5-VL, with a
picture in every prompt) decodes through its own forward with a ``DynamicCache``. A server's
requests arrive while others decode: ``--requests`` requests, one every ``--every-ms``
milliseconds, each generating ``--tokens`` tokens (EOS ignored). Two ways of serving them, alternated
in one process on the same requests: rows join the running batch at the next step
(``HFDecoder.join``: the shorter cache padded on the left under the mask), or arrivals wait
until the batch is empty and then start together (what a decoder that cannot merge caches
does). Reported: completion tokens/s from the first arrival to the last token, and the mean
and worst wait from a request's arrival to its first token, the best round of each (by mean
wait).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.report import write_section
from training import geometry, vision
from training.continuous import ContinuousBatch, Row
from training.engine import Engine
from training.model import TINY_VL_MODEL
from training.types import SamplingParams

TITLE = "Joining a running batch on the model's own forward"


def requests(engine: Engine, count: int, tokens: int) -> list[Row]:
    """``count`` chat prompts about a picture each, rendered as the /v1 worker renders them."""
    rng = random.Random(0)
    spec = vision.spec_of(engine.model)
    assert spec is not None
    out = []
    for i in range(count):
        png, _shape, _colour = geometry.shape_picture(rng)
        image = engine.encode_image(png)
        question = "What colour is the shape?" + " Look closely." * (i % 4)
        messages = [
            {"role": "user", "content": [{"type": "text", "text": question}, {"type": "image"}]}
        ]
        text = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        prompt = vision.expand_placeholders(
            engine.tokenizer.encode(text, add_special_tokens=False), [image], spec.image_token_id
        )
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=i)
        out.append(Row(prompt, params, stop_on_eos=False, images=(image,)))
    return out


def run(engine: Engine, rows: list[Row], every_ms: float, join: bool) -> tuple[float, list[float]]:
    """Completion tokens/s from the first arrival to the last token, and each request's wait
    from its arrival to its first token (s)."""
    batch = ContinuousBatch(engine.model, engine.tokenizer, engine.host)
    waiting: list[int] = []
    first: dict[int, float] = {}
    owner: dict[int, int] = {}
    produced = arrived = 0
    started = time.perf_counter()
    due = [started + i * every_ms / 1000.0 for i in range(len(rows))]
    while len(first) < len(rows) or len(batch):
        now = time.perf_counter()
        while arrived < len(rows) and due[arrived] <= now:
            waiting.append(arrived)
            arrived += 1
        if not waiting and not len(batch):
            time.sleep(max(0.0, due[arrived] - now))
            continue
        if waiting and (join or not len(batch)):
            for ident, request in zip(batch.add([rows[r] for r in waiting]), waiting, strict=True):
                owner[ident] = request
            waiting = []
        for token in batch.step():
            produced += 1
            first.setdefault(owner[token.row], time.perf_counter())
    elapsed = time.perf_counter() - started
    return produced / elapsed, [first[r] - due[r] for r in range(len(rows))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--every-ms", type=float, default=20.0, help="time between arrivals")
    parser.add_argument("--tokens", type=int, default=24, help="completion tokens a request")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args()
    if min(args.requests, args.tokens, args.threads, args.repeats) < 1:
        parser.error("--requests, --tokens, --threads and --repeats must be >= 1")
    if args.every_ms <= 0:
        parser.error("--every-ms must be > 0")
    if not (Path(TINY_VL_MODEL) / "config.json").is_file():
        parser.error("no models/tiny-vl: run scripts/build_tiny_vl_model.py")
    torch.set_num_threads(args.threads)
    engine = Engine(TINY_VL_MODEL, device="cpu")
    rows = requests(engine, args.requests, args.tokens)
    before = "/".join(f"{v:.2f}" for v in os.getloadavg())
    best: dict[str, tuple[float, float, float]] = {}
    for _ in range(args.repeats):
        for name, join in (("join", True), ("wait", False)):
            rate, waits = run(engine, rows, args.every_ms, join)
            mean, worst = statistics.mean(waits), max(waits)
            if name not in best or mean < best[name][1]:
                best[name] = (rate, mean, worst)
            print(
                f"{name}: {rate:.1f} tokens/s, first token after {mean * 1000:.0f} ms mean, "
                f"{worst * 1000:.0f} ms worst",
                flush=True,
            )
    after = "/".join(f"{v:.2f}" for v in os.getloadavg())
    joined, waited = best["join"], best["wait"]
    print(
        f"join / wait: {joined[0] / waited[0]:.2f}x tokens/s, mean first-token wait "
        f"{joined[1] * 1000:.0f} vs {waited[1] * 1000:.0f} ms"
    )
    if args.write:
        command = (
            f".venv/bin/python bench/join_hf.py --requests {args.requests} "
            f"--every-ms {args.every_ms:g} "
            f"--tokens {args.tokens} --threads {args.threads} --repeats {args.repeats} --write"
        )
        lines = [
            f"## {TITLE}",
            "",
            f"`{command}` (torch threads: {torch.get_num_threads()}, float32, load average "
            f"{before} before and {after} after; the best round of {args.repeats}, alternating "
            f"the two). models/tiny-vl (Qwen2.5-VL, decoded by its own forward), "
            f"{args.requests} requests with a picture each, one arriving every "
            f"{args.every_ms:g} ms, {args.tokens} tokens each.",
            "",
            "| arrivals | completion tokens/s | first token after, mean | worst |",
            "|---|---|---|---|",
            f"| join the running batch (`HFDecoder.join`) | {joined[0]:.1f} "
            f"| {joined[1] * 1000:.0f} ms | {joined[2] * 1000:.0f} ms |",
            f"| wait for the batch to empty | {waited[0]:.1f} | {waited[1] * 1000:.0f} ms "
            f"| {waited[2] * 1000:.0f} ms |",
            "",
            f"Joining / waiting: {joined[0] / waited[0]:.2f}x the tokens/s, "
            f"{waited[1] / joined[1]:.1f}x shorter mean wait for a first token.",
        ]
        print(f"wrote {write_section(TITLE, chr(10).join(lines) + chr(10))}")


if __name__ == "__main__":
    main()
