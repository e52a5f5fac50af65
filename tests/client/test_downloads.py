"""Downloads against a scripted server and real files: nothing that exists is replaced or
deleted without --force, paths ending in / are directories, and a path that cannot be written
is one line naming it (exit 2), with no temporary file left behind."""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from opentinker import Client, UsageError
from opentinker.errors import UnexpectedResponse
from tests.client.conftest import CLIENT_SRC
from tests.client.fakes import JOB_ID, FakeApi, Reply, job, zipped

BASE = f"/api/v1/jobs/{JOB_ID}"
ADAPTER = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"W" * 4096}


@pytest.fixture
def api(fake_api: FakeApi) -> FakeApi:
    fake_api.reply(f"GET {BASE}", 200, job("SUCCEEDED"))
    fake_api.reply(f"GET {BASE}/artifacts", 200, [{"name": "adapter", "kind": "directory"}])
    fake_api.reply(
        f"GET {BASE}/checkpoints", 200, [{"name": "step-000002", "step": 2, "created": 2.0}]
    )
    fake_api.reply(f"GET {BASE}/checkpoints/step-000002", 200, b"STATE-2")
    fake_api.reply(f"GET {BASE}/artifacts/adapter", 200, zipped(ADAPTER))
    fake_api.reply(f"GET {BASE}/artifacts/summary.json", 200, b'{"steps": 2}')
    return fake_api


def leftovers(directory: Path) -> list[str]:
    """Temporary files or directories a download could leave (they all start with a dot)."""
    return sorted(p.name for p in directory.rglob(".*"))


def test_it_never_deletes_an_existing_directory_and_merges_only_with_force(
    api: FakeApi, cli: Callable[..., Any], tmp_path: Path
) -> None:
    mine = tmp_path / "out" / "adapter"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "adapter_config.json").write_text("old")

    refused = cli("download", JOB_ID, "-o", str(tmp_path / "out"), env=api.env)
    assert refused.exit_code == 2
    assert f"{mine} already exists; --force" in refused.stderr
    assert (mine / "adapter_config.json").read_text() == "old"

    forced = cli("download", JOB_ID, "-o", str(tmp_path / "out"), "--force", env=api.env)
    assert forced.exit_code == 0, forced.stderr
    assert forced.stdout.strip() == str(mine)
    # The user's own file survives; the adapter's files are the new ones.
    assert (mine / "notes.txt").read_text() == "my notes"
    assert (mine / "adapter_config.json").read_bytes() == ADAPTER["adapter_config.json"]
    assert leftovers(tmp_path) == []


def test_a_zip_name_does_not_wipe_the_directory_beside_it(
    api: FakeApi, cli: Callable[..., Any], tmp_path: Path
) -> None:
    (tmp_path / "foo").mkdir()
    (tmp_path / "foo" / "x").write_text("keep")
    result = cli("download", JOB_ID, "-o", str(tmp_path / "foo.zip"), env=api.env)
    assert result.exit_code == 2 and "already exists" in result.stderr
    assert [p.name for p in (tmp_path / "foo").iterdir()] == ["x"]

    fresh = cli("download", JOB_ID, "-o", str(tmp_path / "bar.zip"), env=api.env)
    assert fresh.exit_code == 0, fresh.stderr
    assert sorted(p.name for p in (tmp_path / "bar").iterdir()) == sorted(ADAPTER)
    assert not (tmp_path / "bar.zip").exists() and leftovers(tmp_path) == []


def test_it_replaces_a_file_only_with_force_or_overwrite(
    api: FakeApi, cli: Callable[..., Any], tmp_path: Path
) -> None:
    target = tmp_path / "state.pt"
    target.write_bytes(b"precious")
    args = ("download", JOB_ID, "--checkpoint", "latest", "-o", str(target))
    refused = cli(*args, env=api.env)
    assert refused.exit_code == 2 and f"{target} already exists" in refused.stderr
    assert target.read_bytes() == b"precious"
    assert cli(*args, "--force", env=api.env).exit_code == 0
    assert target.read_bytes() == b"STATE-2"

    with Client(api.url, "otk_k") as client:
        handle = client.jobs.get(JOB_ID)
        handle.download_artifact("summary.json", tmp_path)
        with pytest.raises(UsageError, match=r"summary\.json already exists"):
            handle.download_artifact("summary.json", tmp_path)
        handle.download_artifact("summary.json", tmp_path, overwrite=True)
        with pytest.raises(UsageError, match="already exists"):
            handle.download("step-000002", target)
    assert leftovers(tmp_path) == []


def test_a_path_ending_in_a_separator_is_a_directory(api: FakeApi, tmp_path: Path) -> None:
    # The README's example: job.download("step-000002", "ckpt/").
    with Client(api.url, "otk_k") as client:
        saved = client.jobs.get(JOB_ID).download("step-000002", f"{tmp_path / 'ckpt'}/")
    assert saved == tmp_path / "ckpt" / f"{JOB_ID}-step-000002-state.pt"
    assert saved.read_bytes() == b"STATE-2"


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("/proc/nope/x", "cannot create the directory /proc/nope/x: No such file or directory"),
        ("{tmp}/notes.txt/x", "cannot create the directory {tmp}/notes.txt/x: Not a directory"),
        ("{tmp}/notes.txt/", "cannot write into {tmp}/notes.txt: it exists and is not a directory"),
        ("{tmp}/fifo.pt", "{tmp}/fifo.pt exists and is not a regular file; refusing to replace it"),
        (
            "{tmp}",
            "{tmp}/" + JOB_ID + "-step-000002-state.pt is a directory; refusing to replace it",
        ),
    ],
)
def test_a_path_it_cannot_write_is_one_line_naming_it(
    api: FakeApi, cli: Callable[..., Any], tmp_path: Path, output: str, message: str
) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    os.mkfifo(tmp_path / "fifo.pt")
    (tmp_path / f"{JOB_ID}-step-000002-state.pt").mkdir()
    args = ["download", JOB_ID, "--checkpoint", "latest", "--force"]
    result = cli(*args, "-o", output.format(tmp=tmp_path), env=api.env)
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: " + message.format(tmp=tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert leftovers(tmp_path) == []


def test_a_failed_write_is_one_line_and_leaves_nothing(api: FakeApi, tmp_path: Path) -> None:
    # A file size limit makes the write fail as a full disk would (EFBIG instead of ENOSPC).
    api.reply(f"GET {BASE}/checkpoints/step-000002", 200, b"S" * 200_000)

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))

    result = subprocess.run(
        [sys.executable, "-m", "opentinker", "download", JOB_ID, "--checkpoint", "latest"],
        cwd=tmp_path,
        env={**os.environ, **api.env, "PYTHONPATH": str(CLIENT_SRC)},
        preexec_fn=small_files,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    target = f"{JOB_ID}-step-000002-state.pt"  # the default -o is the working directory
    assert result.stderr.strip() == f"error: cannot write {target}: File too large"
    assert list(tmp_path.iterdir()) == []


def test_downloads_get_the_mode_the_umask_gives_new_files(api: FakeApi, tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        with Client(api.url, "otk_k") as client:
            handle = client.jobs.get(JOB_ID)
            state = handle.download("step-000002", tmp_path)
            adapter = handle.download_artifact("adapter", tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(state.stat().st_mode) == 0o640
    assert stat.S_IMODE(adapter.stat().st_mode) == 0o750
    assert stat.S_IMODE((adapter / "adapter_config.json").stat().st_mode) == 0o640


def test_names_cannot_walk_out_of_the_job(api: FakeApi, cli: Callable[..., Any]) -> None:
    bad_id = cli("status", "../me", env=api.env)
    assert bad_id.exit_code == 2 and "not a job id: '../me'" in bad_id.stderr
    bad_artifact = cli("download", JOB_ID, "--artifact", "../../me", env=api.env)
    assert bad_artifact.exit_code == 2 and "not a valid artifact name" in bad_artifact.stderr
    assert not any("/me" in hit and "jobs" not in hit for hit in api.hits)
    with Client(api.url, "otk_k") as client:
        with pytest.raises(UsageError):
            client.jobs.get(JOB_ID).download("..", ".")
        api.reply("GET /api/v1/datasets/a%2Fb", 404, {"detail": "Not found."})
        with pytest.raises(Exception, match="Not found"):
            client.datasets.get("a/b")
    assert api.hits[-1] == "GET /api/v1/datasets/a%2Fb"


def test_a_page_in_place_of_the_file_is_refused_and_leaves_nothing(
    api: FakeApi, cli: Callable[..., Any], tmp_path: Path
) -> None:
    # A login page of a proxy in front of the server, with a success status.
    api.reply(f"GET {BASE}/artifacts/summary.json", 200, "<html><h1>Sign in</h1></html>")
    out = tmp_path / "new" / "dir"
    result = cli("download", JOB_ID, "--artifact", "summary.json", "-o", f"{out}/", env=api.env)
    assert result.exit_code == 5
    assert result.stderr.strip() == (
        f"error: unexpected response from the server (GET {BASE}/artifacts/summary.json: "
        "HTTP 200, an HTML page instead of the file: is --url the service's root? 'Sign in')"
    )
    # Not even the directories made for it are left.
    assert list(tmp_path.iterdir()) == []

    api.reply(f"GET {BASE}/artifacts/adapter", 200, b"x" * 100, content_encoding="gzip")
    broken = cli("download", JOB_ID, "-o", f"{out}/", env=api.env)
    assert broken.exit_code == 5 and "Content-Encoding" in broken.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_slow_or_restarting_server_is_asked_again(api: FakeApi, tmp_path: Path) -> None:
    def slow() -> Reply:
        time.sleep(1)  # e.g. making the zip of a big model before the first byte
        return Reply(200, b"STATE-2")

    answers = iter(
        [slow, lambda: Reply(503, {"detail": "restarting"}), lambda: Reply(200, b"STATE-2")]
    )
    api.replies[f"GET {BASE}/checkpoints/step-000002"] = lambda: next(answers)()
    with Client(api.url, "otk_k", retries=2, timeout=0.3) as client:
        client._http.backoff = 0.01
        saved = client.jobs.get(JOB_ID).download("step-000002", tmp_path / "s.pt")
    assert saved.read_bytes() == b"STATE-2"
    assert api.count(f"GET {BASE}/checkpoints/step-000002") == 3


BLOB = bytes(range(256)) * 800  # 204800 bytes


class Ranges(BaseHTTPRequestHandler):
    """The job, then a checkpoint cut off after 100000 bytes, then ``second`` (a Content-Range
    and the bytes it says) for the request that asks for the rest."""

    protocol_version = "HTTP/1.1"
    second: tuple[str, bytes] = ("", b"")
    requests: list[str] = []

    def do_GET(self) -> None:
        Ranges.requests.append(self.headers.get("Range") or "")
        if self.path == BASE:
            data = json.dumps(job("SUCCEEDED")).encode()
            self._head(200, len(data), {"Content-Type": "application/json"})
            self.wfile.write(data)
        elif len(Ranges.requests) == 2:
            self._head(200, len(BLOB), {"ETag": '"v1"'})
            self.wfile.write(BLOB[:100_000])
        else:
            content_range, data = Ranges.second
            self._head(206, len(data), {"ETag": '"v1"', "Content-Range": content_range})
            self.wfile.write(data)
        self.close_connection = True

    def _head(self, status: int, length: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        # Said, not only done: a client that pooled the connection would find it closed
        # under its next request, a failure before the answer that it retries.
        for name, value in {**headers, "Accept-Ranges": "bytes", "Connection": "close"}.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        return None


@pytest.mark.parametrize(
    ("content_range", "data", "message"),
    [
        # The whole file labelled as a range: appended, it would make a corrupt file.
        (
            f"bytes 0-{len(BLOB) - 1}/{len(BLOB)}",
            BLOB,
            f"asked for the bytes from 65536, got 'bytes 0-{len(BLOB) - 1}/{len(BLOB)}'",
        ),
        # Less than the rest: a short file reported as a success.
        (
            f"bytes 65536-99999/{len(BLOB)}",
            BLOB[65536:100_000],
            f"the range sent ends at byte 100000 of {len(BLOB)}",
        ),
    ],
)
def test_a_resumed_download_takes_only_the_rest_of_the_file(
    client_config: Path, tmp_path: Path, content_range: str, data: bytes, message: str
) -> None:
    Ranges.second, Ranges.requests = (content_range, data), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Ranges)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Client(f"http://127.0.0.1:{server.server_address[1]}", "otk_k", retries=1) as client:
            client._http.backoff = 0.01
            with pytest.raises(UnexpectedResponse) as info:
                client.jobs.get(JOB_ID).download("step-000002", tmp_path / "s.pt")
    finally:
        server.shutdown()
        server.server_close()
    # Resumed where the first answer broke off (at a whole 64 KiB read).
    assert Ranges.requests == ["", "", "bytes=65536-"]
    assert message in str(info.value)
    assert list(tmp_path.iterdir()) == []
