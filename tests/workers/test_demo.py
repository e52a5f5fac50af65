"""`manage.py demo` from an empty data directory: the README's main command, end to end.

The default demo (an RL job on the tiny model, minutes long) is measured in
docs/benchmarks.md; here the smoke variant runs the same path through the HTTP API, and the
default spec is checked against the same validation a submission gets.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.fixtures.served import embedded_env

ROOT = Path(__file__).resolve().parents[2]


def run_demo(data_dir: Path, node: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`manage.py demo --smoke` on the embedded defaults in `data_dir`, on a free port."""
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "manage.py"),
            "demo",
            "--smoke",
            *args,
            "--port",
            "0",
            "--timeout",
            "120",
        ],
        cwd=ROOT,
        env=embedded_env(data_dir, node),
        capture_output=True,
        text=True,
        check=False,
        timeout=170,
    )


@pytest.mark.live
@pytest.mark.timeout(180)
def test_it_runs_the_demo_job_through_the_http_api(tmp_path: Path) -> None:
    out = run_demo(tmp_path, "demonode", "--steps", "2", "--step-seconds", "0.2")
    serve_log = tmp_path / "serve.log"
    log = serve_log.read_text(errors="replace") if serve_log.exists() else ""
    assert out.returncode == 0, out.stdout + out.stderr + log
    assert re.search(r"^\s+otk_\S+$", out.stdout, re.MULTILINE), out.stdout
    assert "state SUCCEEDED on demonode" in out.stdout
    assert re.search(r"step 2: .*residual=", out.stdout)
    assert out.stdout.rstrip().endswith("demo job SUCCEEDED")


def test_it_ships_a_default_demo_spec_that_validates() -> None:
    from jobs.spec import check_base_model_limits, parse_spec
    from workers.management.commands.demo import DEMO_DATASET, demo_rows, demo_spec
    from workers.runners.inputs import split_holdout

    spec = parse_spec(demo_spec())
    assert (spec.method, spec.env, spec.base_model, spec.dataset) == (
        "rl",
        "math",
        "tiny",
        DEMO_DATASET,
    )
    # Evaluated at step 0 and at the last step: held-out accuracy before and after.
    assert spec.eval_every == spec.steps
    # The tiny model's registry limits (jobs/0003): rank 64, context 1024.
    assert check_base_model_limits(spec, max_lora_rank=64, max_context=1024) == []
    rows = demo_rows()
    # The job holds out at most a fifth of the rows: all `eval_examples` fit, all distinct.
    train, held = split_holdout(rows, spec.eval_examples, spec.seed)
    assert len(held) == spec.eval_examples and len(train) >= spec.rollout.prompts_per_step
    assert len({r["question"] for r in rows}) == len(rows)
    assert all(set(r) == {"question", "answer"} and r["answer"].isdigit() for r in rows)


@pytest.mark.live
@pytest.mark.timeout(180)
def test_a_service_left_running_keeps_running_jobs_after_the_demo_exits(tmp_path: Path) -> None:
    # The demo's own embedded Valkey stops with it: the service it leaves owns another one.
    out = run_demo(tmp_path, "keptnode", "--steps", "1", "--step-seconds", "0.1", "--keep-serving")
    url = re.search(r"started the service at (\S+)", out.stdout)
    key = re.search(r"^\s+(otk_\S+)$", out.stdout, re.MULTILINE)
    try:
        assert out.returncode == 0 and url and key, out.stdout + out.stderr
        with httpx.Client(
            base_url=url.group(1), headers={"Authorization": f"Bearer {key.group(1)}"}
        ) as client:
            spec = {"method": "smoke", "smoke_steps": 1, "smoke_step_seconds": 0.1}
            job = client.post("/api/v1/jobs", json={"name": "after", "spec": spec})
            assert job.status_code == 201, job.text
            deadline = time.monotonic() + 60
            state = ""
            while time.monotonic() < deadline and state != "SUCCEEDED":
                time.sleep(0.5)
                state = client.get(f"/api/v1/jobs/{job.json()['id']}").json()["state"]
            assert state == "SUCCEEDED", (tmp_path / "serve.log").read_text(errors="replace")
    finally:
        port = url.group(1).rsplit(":", 1)[1] if url else None
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if port and "serve" in cmdline and port in cmdline:
                os.killpg(os.getpgid(proc.pid), signal.SIGTERM)
