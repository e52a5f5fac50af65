"""Generate the small built-in datasets for `math`, `math_code` and `geometry` (offline,
deterministic).

    .venv/bin/python scripts/build_datasets.py [--out environments/data] [--seed 1234] [--check]

Writes {arith,word}_{train,test}.jsonl with rows {"id", "question", "answer", "kind"} (test
questions never appear in the train split) and geometry_{train,test}.jsonl with geometry3k-shaped
rows {"id", "images" (base64 PNG), "problem", "answer", "kind", "seed"} drawn from disjoint
seeds. `--check` regenerates in memory and fails if the committed files differ (used by the
tests to keep the files and this script in step).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "environments" / "data"
DEFAULT_SEED = 1234
SIZES = {"train": 2000, "test": 300}

_NAMES = (
    "Ada",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Gus",
    "Hana",
    "Ivan",
    "Jo",
    "Kofi",
    "Lena",
    "Mateo",
    "Nia",
    "Omar",
    "Priya",
)
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards")

Problem = tuple[str, str, str]  # question, answer, kind


def _fmt(value: Fraction) -> str:
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


def arith_problem(rng: random.Random) -> Problem:
    kind = rng.choice(("add", "sub", "mul", "two_step", "paren", "frac", "big_mul"))
    if kind == "add":
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        return f"What is {a}+{b}?", str(a + b), kind
    if kind == "sub":
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        return f"What is {a}-{b}?", str(a - b), kind
    if kind == "mul":
        a, b = rng.randint(2, 99), rng.randint(2, 20)
        return f"What is {a}*{b}?", str(a * b), kind
    if kind == "two_step":
        a, b, c = rng.randint(2, 50), rng.randint(2, 50), rng.randint(2, 12)
        return f"Compute {a} + {b} * {c}.", str(a + b * c), kind
    if kind == "paren":
        a, b, c = rng.randint(2, 50), rng.randint(2, 50), rng.randint(2, 12)
        return f"Compute ({a} + {b}) * {c}.", str((a + b) * c), kind
    if kind == "frac":
        p = Fraction(rng.randint(1, 9), rng.randint(2, 9))
        q = Fraction(rng.randint(1, 9), rng.randint(2, 9))
        question = (
            f"What is {p.numerator}/{p.denominator} + {q.numerator}/{q.denominator}? "
            "Give the answer as a fraction in lowest terms."
        )
        return question, _fmt(p + q), kind
    a, b = rng.randint(100, 9999), rng.randint(100, 999)
    return f"What is {a}*{b}?", str(a * b), kind


def word_problem(rng: random.Random) -> Problem:
    name, friend = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    kind = rng.choice(("gain_loss", "groups", "share", "price", "age"))
    if kind == "gain_loss":
        a, b = rng.randint(5, 60), rng.randint(1, 40)
        c = rng.randint(1, a + b)
        question = (
            f"{name} has {a} {item}. {friend} gives {name} {b} more, and then {name} gives "
            f"away {c}. How many {item} does {name} have now?"
        )
        return question, str(a + b - c), kind
    if kind == "groups":
        g, n = rng.randint(2, 12), rng.randint(2, 15)
        question = (
            f"{name} packs {item} into {g} boxes with {n} {item} in each box. How many "
            f"{item} are packed?"
        )
        return question, str(g * n), kind
    if kind == "share":
        k, each = rng.randint(2, 9), rng.randint(2, 20)
        extra = rng.randint(1, k - 1)
        total = k * each + extra
        question = (
            f"{name} shares {total} {item} equally among {k} friends and keeps the "
            f"{extra} left over. How many {item} does each friend get?"
        )
        return question, str(each), kind
    if kind == "price":
        n, price = rng.randint(2, 12), rng.randint(2, 30)
        paid = n * price + rng.randint(0, 50)
        question = (
            f"{name} buys {n} {item} at {price} dollars each and pays with {paid} dollars. "
            f"How much change does {name} get?"
        )
        return question, str(paid - n * price), kind
    age, diff, years = rng.randint(5, 40), rng.randint(1, 30), rng.randint(1, 20)
    question = (
        f"{name} is {age} years old. {friend} is {diff} years older than {name}. How old "
        f"will {friend} be in {years} years?"
    )
    return question, str(age + diff + years), kind


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    "arith": arith_problem,
    "word": word_problem,
}


def build(name: str, seed: int) -> dict[str, list[dict[str, str]]]:
    """Both splits of one dataset; the test split is drawn first and excluded from train."""
    rng = random.Random(f"{name}-{seed}")
    gen = GENERATORS[name]
    seen: set[str] = set()
    splits: dict[str, list[dict[str, str]]] = {}
    for split in ("test", "train"):
        rows: list[dict[str, str]] = []
        attempts = 0
        while len(rows) < SIZES[split]:
            attempts += 1
            if attempts > SIZES[split] * 50:
                raise RuntimeError(f"{name}/{split}: generator ran out of distinct questions")
            question, answer, kind = gen(rng)
            if question in seen:
                continue
            seen.add(question)
            rows.append(
                {
                    "id": f"{name}-{split}-{len(rows):05d}",
                    "question": question,
                    "answer": answer,
                    "kind": kind,
                }
            )
        splits[split] = rows
    return splits


def render(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)


# geometry3k-shaped rows drawn by training.geometry: the splits are disjoint ranges of seeds
# (and none of them is a seed the tiny vision-language model pre-trained on).
GEOMETRY_SEEDS = {"test": range(128), "train": range(10_000, 10_512)}


def geometry_rows(split: str) -> list[dict[str, Any]]:
    from training import geometry

    rows = geometry.dataset_rows(GEOMETRY_SEEDS[split])
    return [{"id": f"geometry-{split}-{i:05d}", **row} for i, row in enumerate(rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--check", action="store_true", help="compare with the files in --out instead of writing"
    )
    args = parser.parse_args(argv)
    stale: list[str] = []
    built: list[tuple[str, str, list[dict[str, Any]]]] = [
        (name, split, rows) for name in GENERATORS for split, rows in build(name, args.seed).items()
    ]
    built += [("geometry", split, geometry_rows(split)) for split in GEOMETRY_SEEDS]
    for name, split, rows in built:
        path = args.out / f"{name}_{split}.jsonl"
        text = render(rows)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path} ({len(rows)} rows, {len(text.encode())} bytes)")
    if stale:
        print("out of date (run scripts/build_datasets.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
