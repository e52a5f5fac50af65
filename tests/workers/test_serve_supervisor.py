"""``manage.py serve`` supervises its parts: a worker killed with SIGKILL is restarted with
nothing of it left behind (no orphaned beat), the web server keeps answering meanwhile, and
SIGTERM stops every part and the embedded Valkey."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from tests.fixtures.served import embedded_env, free_port, port_open, start_manage
from tests.fixtures.workers import wait_for
from workers.processes import group_alive

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.live, pytest.mark.timeout(240)]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_it_restarts_a_killed_worker_and_stops_everything_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    serve = start_manage(
        ["serve", "--port", str(port)], embedded_env(tmp_path, "supervised"), log_path
    )
    health = f"http://127.0.0.1:{port}/healthz"

    def log() -> str:
        return log_path.read_text(errors="replace")

    def pid_of(word: str) -> int | None:
        found = re.findall(rf"{word} worker \(pid (\d+)\)", log())
        return int(found[-1]) if found else None

    try:
        wait_for(lambda: _healthy(health), 120, f"the web server; log:\n{log()}")
        first = wait_for(lambda: pid_of("started"), 30, "the worker's start")
        redis_port = int(re.search(r"Redis [\w.]+:(\d+)", log()).group(1))  # type: ignore[union-attr]
        # The worker runs beat and a pool: let them come up before the kill.
        wait_for(lambda: "beat: Starting" in log() or "ready" in log(), 60, "the worker")
        os.kill(first, signal.SIGKILL)
        second = wait_for(lambda: pid_of("restarted"), 30, f"a restart; log:\n{log()}")
        assert second != first
        assert "worker exited with status -9" in log()
        # Everything the killed worker had started (beat, pool processes) went with it.
        assert not group_alive(first)
        assert _healthy(health)
        web = int(re.search(r"started web \(pid (\d+)\)", log()).group(1))  # type: ignore[union-attr]
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=90)
    assert code == 0, log()
    assert not group_alive(second) and not group_alive(web)
    assert not port_open(redis_port), "the embedded Valkey outlived serve"


def test_it_stops_the_service_it_started_when_demo_gets_sigterm(tmp_path: Path) -> None:
    out_path = tmp_path / "demo.out"
    demo = start_manage(
        ["demo", "--smoke", "--steps", "1000", "--step-seconds", "0.2", "--port", str(free_port())],
        embedded_env(tmp_path, "demoterm"),
        out_path,
    )
    serve_log = tmp_path / "serve.log"

    def seen(pattern: str) -> re.Match[str] | None:
        text = serve_log.read_text(errors="replace") if serve_log.exists() else ""
        return re.search(pattern, text)

    try:
        worker = wait_for(lambda: seen(r"started worker \(pid (\d+)\)"), 120, "serve's worker")
        web = wait_for(lambda: seen(r"started web \(pid (\d+)\)"), 30, "serve's web server")
        redis_at = wait_for(lambda: seen(r"Redis [\w.]+:(\d+)"), 30, "serve's Redis")
        wait_for(lambda: b"step" in out_path.read_bytes(), 120, "the demo job's progress")
    finally:
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(timeout=90)
    assert code != 0 and b"stopped by SIGTERM" in out_path.read_bytes()
    for match in (worker, web):
        assert not group_alive(int(match.group(1)))
    assert not port_open(int(redis_at.group(1))), "the embedded Valkey outlived demo"
