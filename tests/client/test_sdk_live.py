"""The Python SDK against a live server: jobs with a real worker, typed errors carrying the
field and reason, datasets, keys, whoami, and a login file readable by its owner only."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import opentinker
from opentinker import Client
from opentinker.errors import AuthError, Conflict, NotFound, ValidationError

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db(transaction=True)]


def test_it_submits_waits_and_reads_metrics_and_events(server: Any) -> None:
    with Client(server.url, server.key) as client:
        job = client.jobs.submit(
            {"method": "smoke", "smoke_steps": 3, "smoke_step_seconds": 0.2}, name="sdk"
        )
        assert job.state == "QUEUED"
        job.wait(timeout=60, poll=0.2)
        assert job.state == "SUCCEEDED", server.worker.log()[-2000:]
        metrics = job.metrics()
        assert metrics.steps("residual") == [1, 2, 3]
        assert metrics.final()["iterations"] >= 1
        only = job.metrics(names=["residual"], since_step=2)
        assert set(only.series) == {"residual"} and only.steps("residual") == [2, 3]
        transitions = [(e.from_state, e.to_state) for e in job.events() if e.to_state]
        assert transitions == [
            ("", "QUEUED"),
            ("QUEUED", "STARTING"),
            ("STARTING", "RUNNING"),
            ("RUNNING", "SUCCEEDED"),
        ]
        assert [j.id for j in client.jobs.list(state="SUCCEEDED")] == [job.id]


def test_it_follows_events_live_and_cancels(server: Any) -> None:
    with Client(server.url, server.key) as client:
        job = client.jobs.submit({"method": "smoke", "smoke_steps": 100, "smoke_step_seconds": 0.5})
        seen = []
        for event in job.events(follow=True, poll=0.2):
            seen.append(event.to_state or event.kind)
            if event.to_state == "RUNNING":
                assert job.cancel().cancel_requested
        assert seen[-1] == "CANCELLED"
        assert job.refresh().state == "CANCELLED"
        # Safe to repeat: a job already CANCELLED is simply returned.
        assert job.cancel().state == "CANCELLED"


def test_it_raises_errors_that_name_the_field_and_reason(api: Any) -> None:
    with Client(api.url, api.key) as client:
        with pytest.raises(ValidationError) as info:
            client.jobs.submit({"method": "smoke", "smoke_steps": 0})
        assert info.value.status == 400
        assert info.value.field == "smoke_steps"
        assert "greater than or equal to 1" in info.value.reason
        with pytest.raises(ValidationError) as info:
            client.jobs.submit({"method": "rl"})
        assert info.value.field == "env" and "required" in info.value.reason
        with pytest.raises(NotFound):
            client.jobs.get("00000000-0000-0000-0000-000000000000")
    with Client(api.url, "otk_bad_key") as client, pytest.raises(AuthError) as auth:
        client.me()
    assert auth.value.status == 401


def test_it_uploads_datasets_and_reports_bad_rows(api: Any, tmp_path: Path) -> None:
    good = tmp_path / "sums.jsonl"
    good.write_text(
        "".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5))
    )
    with Client(api.url, api.key) as client:
        dataset = client.datasets.upload(good, env="math")
        assert (dataset.name, dataset.rows, dataset.env) == ("sums", 5, "math")
        assert dataset.ref == f"dataset:{dataset.id}"
        assert [d.id for d in client.datasets.list(env="math")] == [dataset.id]
        with pytest.raises(Conflict):
            client.datasets.upload(good, env="math")

        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"question": "1+1="}) + "\n")
        with pytest.raises(ValidationError) as info:
            client.datasets.upload(bad, env="math")
        assert any("answer" in f"{e['field']} {e['reason']}" for e in info.value.errors)

        # By name or by ref, the way `opentinker datasets delete` finds it.
        assert client.datasets.find("sums").id == dataset.id
        client.datasets.delete(dataset.ref)
        assert client.datasets.list(env="math") == []


def test_it_creates_rotates_and_revokes_keys(api: Any) -> None:
    with Client(api.url, api.key) as client:
        issued = client.keys.create("laptop")
        assert issued.key.startswith("otk_") and issued.team == "acme"
        with Client(api.url, issued.key) as laptop:
            assert laptop.me().key is not None and laptop.me().key.name == "laptop"
            successor = laptop.keys.rotate(issued.id, grace_hours=0)
        assert successor.name == "laptop" and successor.key != issued.key
        # No grace: the old key stops at once, the successor works.
        with Client(api.url, issued.key) as old, pytest.raises(AuthError):
            old.me()
        revoked = client.keys.revoke(successor.id)
        assert revoked.active is False
        with Client(api.url, successor.key) as gone, pytest.raises(AuthError):
            gone.me()
        names = {k.name for k in client.keys.list() if k.active}
        assert names == {"owner-key"}


def test_it_logs_in_and_saves_a_private_config(
    api: Any, cli: Callable[..., Any], client_config: Path
) -> None:
    wrong = cli("login", "--url", api.url, "--api-key", "otk_x_y")
    assert wrong.exit_code == 3 and not client_config.exists()

    result = cli("login", "--url", api.url, "--api-key", api.key)
    assert result.exit_code == 0, result.stderr
    assert stat.S_IMODE(client_config.stat().st_mode) == 0o600
    assert "olivia" in result.stderr

    # Later commands and the SDK find the server and key in the file.
    who = cli("whoami", "--json")
    assert who.exit_code == 0, who.stderr
    me = who.json()
    assert me["username"] == "olivia" and [t["slug"] for t in me["teams"]] == ["acme"]
    assert me["key"]["name"] == "owner-key"
    with Client() as client:
        assert client.me().username == "olivia"


def test_it_manages_keys_and_datasets_from_the_cli(
    api: Any, cli: Callable[..., Any], tmp_path: Path
) -> None:
    created = cli("keys", "create", "ci", "--json", env=api.env)
    assert created.exit_code == 0, created.stderr
    key = created.json()
    rotated = cli("keys", "rotate", str(key["id"]), "--grace-hours", "1", env=api.env)
    assert rotated.exit_code == 0 and rotated.stdout.strip().startswith("otk_")
    revoked = cli("keys", "revoke", str(key["id"]), env=api.env)
    assert revoked.exit_code == 0 and "revoked key" in revoked.stdout
    listing = cli("keys", "list", "--json", env=api.env).json()
    assert {(k["name"], k["active"]) for k in listing} == {
        ("owner-key", True),
        ("ci", False),
        ("ci", True),
    }

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "2+2=", "answer": "4"}) + "\n")
    up = cli("datasets", "upload", str(rows), "--env", "math", "--name", "tiny", env=api.env)
    assert up.exit_code == 0, up.stderr
    assert "tiny  1 rows  env math" in up.stdout
    bad = cli("datasets", "upload", str(tmp_path / "missing.jsonl"), "--env", "math", env=api.env)
    assert bad.exit_code == 2
    assert "cannot read" in bad.stderr


def test_it_has_a_version_and_public_names() -> None:
    assert opentinker.__version__
    assert {"Client", "fit", "ApiError", "QuotaError", "NotFound", "AuthError"} <= set(
        opentinker.__all__
    )


def test_it_waits_with_a_progress_bar(server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with Client(server.url, server.key) as client:
        job = client.jobs.submit({"method": "smoke", "smoke_steps": 3, "smoke_step_seconds": 0.3})
        job.wait(progress=True, timeout=60, poll=0.2)
    err = capsys.readouterr().err
    assert job.state == "SUCCEEDED"
    assert "3/3" in err and "SUCCEEDED" in err
