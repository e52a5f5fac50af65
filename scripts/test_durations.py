"""Merge the durations that test runs recorded into tests/durations.json (the shards' costs).

    python scripts/test_durations.py var/durations/*.json

Each file is what a run wrote under ``OPENTINKER_TEST_DURATIONS_OUT`` (tests/sharding.py).
A test measured again gets its new figure; tests of files that no longer exist are dropped;
tests under ``MIN_SECONDS`` are left out (the shards count them at a default cost).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "tests" / "durations.json"
MIN_SECONDS = 1.0


def merge(current: dict[str, float], runs: list[dict[str, float]]) -> dict[str, float]:
    merged = dict(current)
    for run in runs:
        merged.update(run)
    return {
        test: round(seconds, 1)
        for test, seconds in sorted(merged.items())
        if seconds >= MIN_SECONDS and (ROOT / test.split("::", 1)[0]).is_file()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files the runs wrote")
    args = parser.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            runs.append({str(k): float(v) for k, v in json.loads(path.read_text()).items()})
        except (OSError, ValueError, AttributeError) as exc:
            print(f"{path}: not a durations file ({exc})", file=sys.stderr)
            return 2
    current = json.loads(TARGET.read_text()) if TARGET.is_file() else {}
    merged = merge(current, runs)
    TARGET.write_text(json.dumps(merged, indent=0, sort_keys=True) + "\n")
    print(f"{TARGET.relative_to(ROOT)}: {len(merged)} tests, {sum(merged.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
