"""`manage.py demo` from an empty data directory: the README's main command, end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_it_runs_the_demo_job_through_the_http_api(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(
        DJANGO_SETTINGS_MODULE="opentinker_site.settings.local",
        OPENTINKER_DATA_DIR=str(tmp_path),
        OPENTINKER_NODE_NAME="demonode",
        OPENTINKER_GPUS="",
        CUDA_VISIBLE_DEVICES="",
    )
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "manage.py"),
            "demo",
            "--steps",
            "2",
            "--step-seconds",
            "0.2",
            "--port",
            "0",
            "--timeout",
            "120",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=170,
    )
    serve_log = tmp_path / "serve.log"
    log = serve_log.read_text(errors="replace") if serve_log.exists() else ""
    assert out.returncode == 0, out.stdout + out.stderr + log
    assert re.search(r"^\s+otk_\S+$", out.stdout, re.MULTILINE), out.stdout
    assert "state SUCCEEDED on demonode" in out.stdout
    assert re.search(r"step 2: .*residual=", out.stdout)
    assert out.stdout.rstrip().endswith("demo job SUCCEEDED")
