"""Write the JobSpec JSON schema that the thin client ships (client/opentinker/jobspec.schema.json).

The CLI type-checks ``key=value`` overrides against this file, so it must follow
``jobs.spec.JobSpec``; ``tests/client/test_jobspec_schema.py`` fails when they drift.
Run ``python scripts/export_jobspec_schema.py`` after changing the spec (``--check`` only compares).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "client" / "opentinker" / "jobspec.schema.json"


def jobspec_schema() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from jobs.spec import CURRENT_VERSION, JobSpec

    schema = JobSpec.model_json_schema()
    schema["title"] = "JobSpec"
    schema["x-spec-version"] = CURRENT_VERSION
    return schema


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--out", type=Path, default=SHIPPED)
    args = parser.parse_args(argv)
    text = render(jobspec_schema())
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is stale: run scripts/export_jobspec_schema.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
