"""The CLI against a live server and a real Celery worker: submit with overrides, follow to
SUCCEEDED, logs, metrics, cancel, refusals with their exit codes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jobs.models import Job
from tests.fixtures.workers import wait_for

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db(transaction=True)]


@pytest.fixture
def smoke_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "smoke.yaml"
    path.write_text("method: smoke\nsmoke_steps: 50\nsmoke_step_seconds: 1.0\npriority: 40\n")
    return path


def test_it_submits_with_overrides_and_follows_to_succeeded(
    server: Any, cli: Callable[..., Any], smoke_yaml: Path
) -> None:
    result = cli(
        "submit",
        str(smoke_yaml),
        "smoke_steps=3",
        "smoke_step_seconds=0.2",
        "--name",
        "cli-smoke",
        "--follow",
        "--json",
        env=server.env,
    )
    assert result.exit_code == 0, (result.stdout, result.stderr, server.worker.log()[-2000:])
    job = result.json()
    assert job["state"] == "SUCCEEDED"
    assert job["name"] == "cli-smoke"
    # The overrides won over the file; the rest of the file went through unchanged.
    assert (job["spec"]["smoke_steps"], job["spec"]["smoke_step_seconds"]) == (3, 0.2)
    assert job["spec"]["priority"] == 40

    metrics = cli("metrics", job["id"], "--json", env=server.env).json()["series"]
    assert [int(step) for step, _ in metrics["eigenvalue_error"]] == [1, 2, 3]

    logs = cli("logs", job["id"], env=server.env)
    assert logs.exit_code == 0
    assert "QUEUED->STARTING" in logs.stdout and "RUNNING->SUCCEEDED" in logs.stdout
    assert "smoke job: 3 steps" in logs.stdout

    status = cli("status", job["id"], env=server.env)
    assert status.exit_code == 0 and "SUCCEEDED" in status.stdout and "/3" in status.stdout
    listed = cli("jobs", "--state", "succeeded", "--json", env=server.env).json()
    assert [j["id"] for j in listed] == [job["id"]]


def test_it_cancels_a_running_job_and_reports_it_with_exit_code_1(
    server: Any, cli: Callable[..., Any], smoke_yaml: Path
) -> None:
    job_id = cli("submit", str(smoke_yaml), env=server.env).stdout.strip()
    wait_for(
        lambda: Job.objects.filter(pk=job_id, state="RUNNING", current_step__gte=1).exists(),
        60,
        "the job to run a step",
    )
    cancelled = cli("cancel", job_id, "--json", env=server.env)
    assert cancelled.exit_code == 0, cancelled.stderr
    assert cancelled.json()["cancel_requested"] is True

    # Following a job that ends CANCELLED exits 1, for scripts.
    follow = cli("logs", job_id, "--follow", env=server.env)
    assert follow.exit_code == 0
    assert "->CANCELLED" in follow.stdout
    status = cli("status", job_id, "--json", env=server.env).json()
    assert status["state"] == "CANCELLED" and status["current_step"] < 50

    # Cancelling again is harmless: the job is already where the user wants it.
    again = cli("cancel", job_id, env=server.env)
    assert again.exit_code == 0, again.stderr
    assert "already cancelled" in again.stderr and "CANCELLED" in again.stdout


def test_it_exits_1_when_a_followed_job_is_cancelled(
    server: Any, cli: Callable[..., Any], smoke_yaml: Path
) -> None:
    import threading

    from jobs import services

    def cancel_when_running() -> None:
        job = wait_for(
            lambda: Job.objects.filter(state="RUNNING", current_step__gte=1).first(), 60, "a run"
        )
        services.cancel_job(job)

    thread = threading.Thread(target=cancel_when_running)
    thread.start()
    result = cli("submit", str(smoke_yaml), "--follow", "--json", env=server.env)
    thread.join(timeout=70)
    assert result.exit_code == 1, result.stderr
    assert result.json()["state"] == "CANCELLED"


def test_it_rejects_a_mistyped_override_before_sending_anything(
    api: Any, cli: Callable[..., Any], smoke_yaml: Path
) -> None:
    result = cli("submit", str(smoke_yaml), "smoke_step=3", env=api.env)
    assert result.exit_code == 2
    assert "unknown key 'smoke_step'; did you mean 'smoke_steps'?" in result.stderr

    result = cli("submit", str(smoke_yaml), "rollout.group_sise=8", env=api.env)
    assert result.exit_code == 2
    assert "did you mean 'rollout.group_size'?" in result.stderr

    result = cli("submit", str(smoke_yaml), "smoke_steps=many", env=api.env)
    assert result.exit_code == 2
    assert 'bad value for smoke_steps: expected an integer, got "many"' in result.stderr
    assert not Job.objects.exists()


def test_it_shows_the_servers_field_and_reason_for_a_spec_it_refuses(
    api: Any, cli: Callable[..., Any], smoke_yaml: Path
) -> None:
    # Well typed, so the client sends it; the server knows steps is for training methods only.
    result = cli("submit", str(smoke_yaml), "steps=4", env=api.env)
    assert result.exit_code == 2
    assert "invalid job spec (HTTP 400)" in result.stderr
    assert "steps: only valid with method 'rl' or 'sft'" in result.stderr
    assert not Job.objects.exists()


def test_it_maps_refusals_to_documented_exit_codes(
    api: Any,
    cli: Callable[..., Any],
    outsider_key: tuple[Any, str],
    smoke_yaml: Path,
    clean_control_plane: Any,
) -> None:
    missing = cli("status", str(uuid.uuid4()), env=api.env)
    assert missing.exit_code == 4 and "HTTP 404" in missing.stderr

    bad_key = cli("whoami", env={**api.env, "OPENTINKER_API_KEY": "otk_nope_nope"})
    assert bad_key.exit_code == 3 and "HTTP 401" in bad_key.stderr

    job_id = cli("submit", str(smoke_yaml), "smoke_steps=1", env=api.env).stdout.strip()
    foreign = cli("status", job_id, env={**api.env, "OPENTINKER_API_KEY": outsider_key[1]})
    assert foreign.exit_code == 4
    # No worker runs here: the job's line says why it waits.
    assert "(no GPU worker is running" in cli("status", job_id, env=api.env).stdout

    unreachable = cli(
        "jobs", env={**api.env, "OPENTINKER_URL": "http://127.0.0.1:9", "OPENTINKER_RETRIES": "1"}
    )
    assert unreachable.exit_code == 5 and "error:" in unreachable.stderr

    no_config = cli("jobs")
    assert no_config.exit_code == 2 and "opentinker login" in no_config.stderr
