"""What the CLI says when things go wrong, against a scripted server: one line each, the
documented exit code, no traceback; and the small commands around jobs and datasets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opentinker import Client, UsageError, __version__
from opentinker.errors import UnexpectedResponse, WaitTimeout
from tests.client.conftest import CLIENT_SRC
from tests.client.fakes import JOB_ID, FakeApi, Reply, dataset, job

BASE = f"/api/v1/jobs/{JOB_ID}"
Cli = Callable[..., Any]


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "smoke.yaml"
    path.write_text("method: smoke\nsmoke_steps: 5\n")
    return path


@pytest.fixture
def running(fake_api: FakeApi) -> FakeApi:
    """A job that runs for ever."""
    fake_api.reply("POST /api/v1/jobs", 201, job("QUEUED"))
    fake_api.reply(f"GET {BASE}", 200, job("RUNNING", current_step=1))
    fake_api.reply(f"GET {BASE}/metrics", 200, {"series": {}})
    fake_api.reply(f"GET {BASE}/events", 200, {"results": [], "next": None})
    return fake_api


def test_follow_gives_up_after_its_timeout_with_exit_6(
    running: FakeApi, cli: Cli, spec_file: Path
) -> None:
    result = cli(
        "submit", str(spec_file), "--follow", "--timeout", "0.3", "--json", env=running.env
    )
    assert result.exit_code == 6
    assert result.stderr.splitlines()[-1] == (
        f"error: job {JOB_ID} still RUNNING after 0.3 s; it keeps running"
    )
    for bad in ("0", "-1", "nan"):
        refused = cli("submit", str(spec_file), "--follow", "--timeout", bad, env=running.env)
        assert refused.exit_code == 2 and "--timeout must be a positive number" in refused.stderr
    assert running.count("POST /api/v1/jobs") == 1

    with Client(running.url, "otk_k") as client, pytest.raises(WaitTimeout) as info:
        client.jobs.get(JOB_ID).wait(timeout=0.2, poll=0.05)
    # Code that caught the TimeoutError wait() used to raise still catches it.
    assert isinstance(info.value, TimeoutError) and info.value.exit_code == 6


@pytest.mark.parametrize("command", ["submit", "logs"])
def test_ctrl_c_while_following_says_the_job_keeps_running(
    running: FakeApi, spec_file: Path, command: str
) -> None:
    args = ["submit", str(spec_file), "--follow"] if command == "submit" else ["logs", JOB_ID, "-f"]
    process = subprocess.Popen(
        [sys.executable, "-m", "opentinker", *args],
        env={**os.environ, **running.env, "PYTHONPATH": str(CLIENT_SRC)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell may start background jobs with SIGINT ignored; the CLI needs it delivered.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 30
    while running.count(f"GET {BASE}") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert stderr.splitlines()[-1] == (
        f"interrupted; job {JOB_ID} keeps running (opentinker cancel {JOB_ID} to stop it)"
    )
    assert "Traceback" not in stderr


def test_a_spec_that_is_not_utf8_is_named(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("method: smoke\nname: caf\xe9\n".encode("latin-1"))
    result = cli("submit", str(path), "--dry-run")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {path} is not UTF-8 text (byte 0xe9 at offset 23)"


def test_a_body_that_is_not_the_apis_is_one_line_exit_5(fake_api: FakeApi, cli: Cli) -> None:
    fake_api.reply("GET /api/v1/me", 200, "<html><body><h1>Sign in</h1> to the proxy</body></html>")
    html = cli("whoami", env=fake_api.env)
    assert html.exit_code == 5
    assert html.stderr.strip() == (
        "error: unexpected response from the server (GET /api/v1/me: HTTP 200, not JSON "
        "(text/html): is --url the service's root? 'Sign in to the proxy')"
    )
    fake_api.reply("GET /api/v1/me", 200, {"user": "olivia"})
    shape = cli("whoami", env=fake_api.env)
    assert shape.exit_code == 5
    assert shape.stderr.strip() == (
        "error: unexpected response from the server (a Me with username: Field required)"
    )
    fake_api.reply("GET /api/v1/jobs", 200, "[1, 2]")
    fake_api.reply(f"GET {BASE}/artifacts", 200, {"adapter": {}})
    with Client(fake_api.url, "otk_k") as client, pytest.raises(UnexpectedResponse):
        client.jobs.list()


def test_non_json_error_pages_redirects_and_lists_are_one_line(fake_api: FakeApi, cli: Cli) -> None:
    missing = cli("status", JOB_ID, env=fake_api.env)
    assert missing.exit_code == 4
    assert missing.stderr.strip() == (
        "error: not JSON (text/html): is --url the service's root? 'Not Found The requested "
        "resource was not found on this server.' (HTTP 404)"
    )
    fake_api.reply(f"GET {BASE}", 302, "", location="https://sso.example.org/login")
    moved = cli("status", JOB_ID, env=fake_api.env)
    assert moved.stderr.strip() == "error: redirected to https://sso.example.org/login (HTTP 302)"
    fake_api.reply(f"POST {BASE}/cancel", 400, ["not now", "try [later]"])
    fake_api.reply(f"GET {BASE}", 200, job("RUNNING"))
    listed = cli("cancel", JOB_ID, env=fake_api.env)
    assert listed.exit_code == 2
    assert listed.stderr.strip() == "error: not now; try [later] (HTTP 400)"


def test_dataset_errors_are_not_said_twice(fake_api: FakeApi, cli: Cli, tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"q": 1}\n')
    detail = (
        "the file does not fit env 'math': 2 of 3 rows are bad; first problem at row 2, "
        "prompt: missing"
    )
    errors = [
        {"row": 2, "field": "prompt", "reason": "missing"},
        {"row": 3, "field": "prompt", "reason": "missing"},
    ]
    fake_api.reply("POST /api/v1/datasets", 400, {"detail": detail, "errors": errors})
    result = cli("datasets", "upload", str(rows), "--env", "math", env=fake_api.env)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"error: {detail} (HTTP 400)", "  row 3: prompt: missing"]

    reason = "could not read the file: bad magic"
    body = {"detail": reason, "errors": [{"row": 0, "field": "file", "reason": reason}]}
    fake_api.reply("POST /api/v1/datasets", 400, body)
    result = cli("datasets", "upload", str(rows), "--env", "math", env=fake_api.env)
    assert result.stderr.splitlines() == [f"error: {reason} (HTTP 400)"]


@pytest.mark.parametrize("hours", ["nan", "inf", "-1"])
def test_grace_hours_must_be_finite_and_not_negative(
    fake_api: FakeApi, cli: Cli, hours: str
) -> None:
    result = cli("keys", "rotate", "7", "--grace-hours", hours, env=fake_api.env)
    assert result.exit_code == 2
    assert "grace hours must be a finite number >= 0" in result.stderr
    assert fake_api.hits == []


def test_tables_never_cut_ids_when_piped(fake_api: FakeApi, cli: Cli) -> None:
    # Brackets as well: a name is text, never rich markup.
    long_name = "a-job-with-a-rather-long-descriptive-name-[/x]-" * 2
    fake_api.reply(
        "GET /api/v1/jobs",
        200,
        {"results": [job("SUCCEEDED", name=long_name)], "next": None},
    )
    listed = cli("jobs", env=fake_api.env)
    assert listed.exit_code == 0 and JOB_ID in listed.stdout and long_name in listed.stdout
    fake_api.reply(f"GET {BASE}", 200, job("SUCCEEDED", name=long_name))
    assert long_name in cli("status", JOB_ID, env=fake_api.env).stdout
    found = dataset("arithmetic-problems-with-a-long-name" * 2)
    fake_api.reply("GET /api/v1/datasets", 200, {"results": [found], "next": None})
    datasets = cli("datasets", "list", env=fake_api.env)
    assert found["ref"] in datasets.stdout


def test_jobs_limit_must_be_at_least_one(fake_api: FakeApi, cli: Cli) -> None:
    fake_api.reply("GET /api/v1/jobs", 200, {"results": [job(), job()], "next": None})
    for limit in ("0", "-3"):
        result = cli("jobs", "--limit", limit, env=fake_api.env)
        assert result.exit_code == 2 and "limit must be at least 1" in result.stderr
    assert len(cli("jobs", "--limit", "1", "--json", env=fake_api.env).json()) == 1
    with Client(fake_api.url, "otk_k") as client, pytest.raises(UsageError):
        client.jobs.list(limit=0)


def test_cancelling_twice_succeeds_and_a_finished_job_is_explained(
    fake_api: FakeApi, cli: Cli
) -> None:
    fake_api.reply(f"POST {BASE}/cancel", 409, {"detail": "job is already CANCELLED"})
    fake_api.reply(f"GET {BASE}", 200, job("CANCELLED"))
    again = cli("cancel", JOB_ID, env=fake_api.env)
    assert again.exit_code == 0, again.stderr
    assert f"job {JOB_ID} was already cancelled" in again.stderr and "CANCELLED" in again.stdout

    fake_api.reply(f"POST {BASE}/cancel", 409, {"detail": "job is already SUCCEEDED"})
    fake_api.reply(f"GET {BASE}", 200, job("SUCCEEDED"))
    done = cli("cancel", JOB_ID, env=fake_api.env)
    assert done.exit_code == 2
    assert done.stderr.strip() == (
        f"error: job {JOB_ID} already ended SUCCEEDED; nothing to cancel (HTTP 409)"
    )


def test_datasets_delete_by_name_ref_or_id(fake_api: FakeApi, cli: Cli) -> None:
    wanted, similar = dataset("add"), dataset("add-more")
    fake_api.reply("GET /api/v1/datasets", 200, {"results": [similar, wanted], "next": None})
    fake_api.reply(f"DELETE /api/v1/datasets/{wanted['id']}", 204)
    fake_api.reply(f"GET /api/v1/datasets/{wanted['id']}", 200, wanted)

    by_name = cli("datasets", "delete", "add", env=fake_api.env)
    assert by_name.exit_code == 0, by_name.stderr
    assert by_name.stdout.strip() == f"deleted dataset add ({wanted['ref']})"
    assert cli("datasets", "delete", wanted["ref"], env=fake_api.env).exit_code == 0
    assert fake_api.count(f"DELETE /api/v1/datasets/{wanted['id']}") == 2
    assert not [hit for hit in fake_api.hits if similar["id"] in hit]

    missing = cli("datasets", "delete", "nope", env=fake_api.env)
    assert missing.exit_code == 4 and "no dataset named 'nope'" in missing.stderr
    twin = {**dataset("add", team="other")}
    fake_api.reply("GET /api/v1/datasets", 200, {"results": [wanted, twin], "next": None})
    ambiguous = cli("datasets", "delete", "add", env=fake_api.env)
    assert ambiguous.exit_code == 2 and "several datasets are named 'add'" in ambiguous.stderr


def test_it_prints_its_version(cli: Cli) -> None:
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"opentinker {__version__}"


def test_metrics_shows_a_metric_with_no_points_yet(fake_api: FakeApi, cli: Cli) -> None:
    series = {"series": {"loss": [], "reward/mean": [[1, 0.5], [2, 0.75]]}}
    fake_api.reply(f"GET {BASE}", 200, job("RUNNING"))
    fake_api.reply(f"GET {BASE}/metrics", 200, series)
    result = cli("metrics", JOB_ID, "--name", "loss", "--name", "reward/mean", env=fake_api.env)
    assert result.exit_code == 0, result.stderr
    cells = {
        row[0]: row[1:]
        for line in result.stdout.splitlines()
        if (row := [cell.strip() for cell in line.split("\u2502")[1:-1]])
    }
    assert cells["loss"] == ["0", "", ""]
    assert cells["reward/mean"] == ["2", "2", "0.75"]


def test_login_with_nothing_to_read_names_the_missing_option(fake_api: FakeApi, cli: Cli) -> None:
    no_url = cli("login", input="")
    assert no_url.exit_code == 2
    assert no_url.stderr.strip() == "error: no server URL given: pass --url"
    no_key = cli("login", "--url", fake_api.url, input="")
    assert no_key.exit_code == 2
    assert no_key.stderr.strip().endswith("error: no API key given: pass --api-key")
    assert fake_api.hits == []


@pytest.mark.parametrize(
    "document",
    [{"components": ["schemas"]}, {"components": {"schemas": {"JobSpec": {"$defs": []}}}}, [1]],
)
def test_a_schema_document_of_another_shape_falls_back_to_the_shipped_one(
    running: FakeApi, cli: Cli, spec_file: Path, document: Any
) -> None:
    running.reply("GET /api/schema/", 200, document)
    result = cli("submit", str(spec_file), env=running.env)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == JOB_ID


def test_ctrl_c_during_any_command_says_so_with_exit_130(fake_api: FakeApi) -> None:
    def slow() -> Reply:
        time.sleep(5)
        return Reply(200, {"username": "olivia", "teams": []})

    fake_api.replies["GET /api/v1/me"] = slow
    process = subprocess.Popen(
        [sys.executable, "-m", "opentinker", "whoami"],
        env={**os.environ, **fake_api.env, "PYTHONPATH": str(CLIENT_SRC)},
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 30
    while fake_api.count("GET /api/v1/me") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130
    assert stderr.strip() == "interrupted"
