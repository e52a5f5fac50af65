"""The JobSpec schema shipped with the client is the server's model: they cannot drift."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from jobs.spec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "client" / "opentinker" / "jobspec.schema.json"


def test_the_shipped_schema_matches_the_servers_jobspec() -> None:
    shipped = json.loads(SHIPPED.read_text(encoding="utf-8"))
    server = JobSpec.model_json_schema()
    shipped_core = {k: v for k, v in shipped.items() if k not in ("title", "x-spec-version")}
    server_core = {k: v for k, v in server.items() if k != "title"}
    assert shipped_core == server_core, (
        "client/opentinker/jobspec.schema.json is stale: run scripts/export_jobspec_schema.py"
    )


def test_the_export_script_reports_a_stale_file(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "export_jobspec_schema.py"
    out = tmp_path / "schema.json"
    out.write_text("{}\n")
    stale = subprocess.run(
        [sys.executable, str(script), "--check", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert stale.returncode == 1 and "stale" in stale.stderr
    subprocess.run(
        [sys.executable, str(script), "--out", str(out)], check=True, capture_output=True
    )
    fresh = subprocess.run([sys.executable, str(script), "--check", "--out", str(out)], check=False)
    assert fresh.returncode == 0
    assert out.read_text() == SHIPPED.read_text()
