"""Cancel benchmark: seconds from ``POST /api/v1/jobs/{id}/cancel`` to a freed block.

An RL job runs on a real Celery worker subprocess (with beat, as ``serve`` runs it); once it
has logged two steps, the cancel is posted and the clock runs until both the GPU lease is
gone from the lock table and the job row says CANCELLED. Rounds alternate between a quiet
machine and a loaded one (one busy process per core beside the worker, so the job's step
and the cancel share the CPU with them); the figure is the loaded median and maximum
against the goal of 5 s, and the loaded / quiet ratio of medians.

Run: ``.venv/bin/python bench/cancel.py`` (``--write`` updates docs/benchmarks.md). It uses a
throw-away data directory (SQLite + embedded Valkey) unless DATABASE_URL/REDIS_URL are set.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_section as record

GOAL_S = 5.0

# The managed-job benchmark's set-up (Django, the worker, an API key) serves here as it is.
_spec = importlib.util.spec_from_file_location("bench_jobs", ROOT / "bench" / "jobs.py")
assert _spec is not None and _spec.loader is not None
bench_jobs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_jobs)


def start_worker(log_path: Path) -> subprocess.Popen[bytes]:
    # Beat runs the reaper, the canceller's fallback; two pool processes, so the enforcement
    # task is not queued behind the job it enforces.
    cmd = [sys.executable, str(ROOT / "manage.py"), "runworker", "--concurrency", "2"]
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            [*cmd, "--loglevel", "WARNING"],
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextmanager
def load(busy: int) -> Any:
    """``busy`` processes spinning on the CPU for the duration."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        yield
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def wait(predicate: Any, timeout: float, what: str, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(
                f"timed out waiting for {what}; worker log:\n{log_path.read_text()[-3000:]}"
            )
        time.sleep(0.02)


def cancel_round(client: Any, log_path: Path) -> float:
    """Seconds from the cancel request to a free block and a CANCELLED job."""
    from jobs.models import Job, JobMetric
    from workers import conf
    from workers.locktable import GpuLockTable

    table = GpuLockTable(conf.get_redis())
    response = client.post(
        "/api/v1/jobs", {"name": "cancel", "spec": bench_jobs.job_spec(500)}, format="json"
    )
    if response.status_code != 201:
        raise SystemExit(f"submit failed: {response.status_code} {response.content[:500]!r}")
    job_id = response.json()["id"]
    wait(
        lambda: JobMetric.objects.filter(job_id=job_id, name="loss", step__gte=2).exists(),
        300,
        "two steps",
        log_path,
    )
    started = time.perf_counter()
    answer = client.post(f"/api/v1/jobs/{job_id}/cancel")
    if answer.status_code != 200:
        raise SystemExit(f"cancel failed: {answer.status_code} {answer.content[:500]!r}")
    wait(
        lambda: (
            table.lease_of(job_id) is None
            and Job.objects.filter(pk=job_id, state="CANCELLED").exists()
        ),
        120,
        "the cancel",
        log_path,
    )
    return time.perf_counter() - started


def write_section(result: dict[str, Any], command: str, database: str) -> Path:
    quiet = ", ".join(f"{s:.2f}" for s in result["quiet"])
    loaded = ", ".join(f"{s:.2f}" for s in result["loaded"])
    section = f"""## Cancel to a free block

Command: `{command}` ({time.strftime("%Y-%m-%d")}, {os.cpu_count()} CPU cores,
Python {platform.python_version()}, {database}, load average before the run
{result["loadavg"]}).

Seconds from `POST /api/v1/jobs/{{id}}/cancel` to the lease gone from the lock table and the
job CANCELLED, with the RL job (8 prompts x 8 samples per step) two steps in, on a real
worker with beat. Loaded rounds run {result["busy"]} busy processes beside the worker (one
per core); quiet and loaded rounds alternate.

| Machine | Median | Max | Rounds |
|---|---|---|---|
| Loaded | **{statistics.median(result["loaded"]):.2f} s** | {max(result["loaded"]):.2f} s | {loaded} |
| Quiet | {statistics.median(result["quiet"]):.2f} s | {max(result["quiet"]):.2f} s | {quiet} |

Goal: at most {GOAL_S:.0f} s under load. Loaded / quiet ratio of medians: {result["ratio"]:.2f}.
The runner reads the cancel flag before and after each phase of a step and stops at the
next read; when it does not stop within {result["grace"]:.0f} s the `enforce_cancel` task
releases the lease itself and ends the job, and billing stops at the request either way.
"""
    return record("Cancel to a free block", section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="Cancels on each machine state.")
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    loadavg = "/".join(f"{v:.2f}" for v in os.getloadavg())
    database = bench_jobs.setup_django()
    from django.conf import settings

    from workers.control import CANCEL_GRACE_SECONDS

    busy = os.cpu_count() or 2
    log_path = Path(settings.OPENTINKER_DATA_DIR) / "bench-cancel-worker.log"
    worker = start_worker(log_path)
    quiet: list[float] = []
    loaded: list[float] = []
    try:
        client = bench_jobs.api_client()
        cancel_round(client, log_path)  # warm-up: the worker loads the engine
        for n in range(1, args.rounds + 1):
            quiet.append(cancel_round(client, log_path))
            with load(busy):
                loaded.append(cancel_round(client, log_path))
            print(f"round {n}: quiet {quiet[-1]:.2f} s, loaded {loaded[-1]:.2f} s", flush=True)
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
    result = {
        "quiet": quiet,
        "loaded": loaded,
        "busy": busy,
        "loadavg": loadavg,
        "grace": CANCEL_GRACE_SECONDS,
        "ratio": statistics.median(loaded) / statistics.median(quiet),
    }
    print(
        f"cancel -> free block: loaded median {statistics.median(loaded):.2f} s, "
        f"max {max(loaded):.2f} s (goal <= {GOAL_S:.0f} s); quiet median "
        f"{statistics.median(quiet):.2f} s; loaded / quiet {result['ratio']:.2f}"
    )
    if args.write:
        command = ".venv/bin/python bench/cancel.py --write"
        print(f"wrote {write_section(result, command, database)}")


if __name__ == "__main__":
    main()
