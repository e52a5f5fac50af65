"""Downloads through the live API: checkpoints byte for byte, the adapter unpacked, other
artifacts as files. The job's files are laid out as the runner writes them (see
``jobs.artifacts``), so this runs without the tiny model; ``test_training_live.py`` downloads
from a real RL run."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opentinker import Client
from opentinker.errors import NotFound

pytestmark = [pytest.mark.timeout(60), pytest.mark.django_db(transaction=True)]


def write_run_files(data_dir: Path, job_id: str) -> dict[str, bytes]:
    root = data_dir / "jobs" / job_id
    blobs = {name: os.urandom(50_000 + i) for i, name in enumerate(("step-000001", "step-000002"))}
    index = []
    for step, (name, blob) in enumerate(blobs.items(), start=1):
        (root / "checkpoints" / name).mkdir(parents=True)
        (root / "checkpoints" / name / "state.pt").write_bytes(blob)
        index.append(json.dumps({"name": name, "created": 1.0 + step, "extra": {"step": step}}))
    (root / "checkpoints" / "checkpoints.jsonl").write_text("\n".join(index) + "\n")
    (root / "adapter").mkdir()
    blobs["adapter_config.json"] = b'{"r": 4}'
    blobs["adapter_model.safetensors"] = os.urandom(4096)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "adapter" / name).write_bytes(blobs[name])
    blobs["summary.json"] = b'{"steps": 2}'
    (root / "summary.json").write_bytes(blobs["summary.json"])
    return blobs


def test_it_downloads_checkpoints_and_artifacts(
    api: Any, data_dir: Path, cli: Callable[..., Any], tmp_path: Path
) -> None:
    with Client(api.url, api.key) as client:
        job = client.jobs.submit({"method": "smoke", "smoke_steps": 1})
        blobs = write_run_files(data_dir, job.id)

        assert [(c.name, c.step) for c in job.checkpoints()] == [
            ("step-000001", 1),
            ("step-000002", 2),
        ]
        first = job.download("step-000001", tmp_path)
        assert first.name == f"{job.id}-step-000001-state.pt"
        assert first.read_bytes() == blobs["step-000001"]
        latest = job.download(path=tmp_path / "latest.pt")
        assert latest.read_bytes() == blobs["step-000002"]
        with pytest.raises(NotFound):
            job.download("step-000009", tmp_path)

        adapter = job.download_artifact("adapter", tmp_path / "out")
        assert adapter == tmp_path / "out" / "adapter"
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert (adapter / name).read_bytes() == blobs[name]
        assert not (tmp_path / "out" / "adapter.zip").exists()
        summary = job.download_artifact("summary.json", tmp_path / "out")
        assert summary.read_bytes() == blobs["summary.json"]
        # No half-written or temporary files are left beside the downloads.
        assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
            f"{job.id}-step-000001-state.pt",
            "latest.pt",
        ]

    default = cli("download", job.id, "-o", str(tmp_path / "cli"), "--json", env=api.env)
    assert default.exit_code == 0, default.stderr
    assert Path(default.json()["path"]) == tmp_path / "cli" / "adapter"
    ckpt = cli("download", job.id, "--checkpoint", "latest", "-o", str(tmp_path / "c"), env=api.env)
    assert ckpt.exit_code == 0, ckpt.stderr
    assert Path(ckpt.stdout.strip()).read_bytes() == blobs["step-000002"]
    both = cli("download", job.id, "--checkpoint", "x", "--artifact", "y", env=api.env)
    assert both.exit_code == 2


class CuttingProxy:
    """A TCP proxy in front of the live server that drops the connection of a response after
    its first ``cut`` bytes, ``breaks`` times (responses shorter than that pass whole), as a
    flaky network or a proxy's timeout does mid-download. One request per connection (it
    asks the server to close after each); the requests it saw are kept."""

    def __init__(self, upstream: str, cut: int, breaks: int = 1) -> None:
        import socket
        import threading
        from urllib.parse import urlparse

        target = urlparse(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.cut, self.breaks = cut, breaks
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: Any) -> None:
        try:
            self._relay(client)
        except OSError:
            # The live server may hold a finished connection open until the timeout: the
            # client has its whole answer by then.
            return

    def _relay(self, client: Any) -> None:
        import socket

        with client, socket.create_connection(self.upstream) as server:
            client.settimeout(10)
            server.settimeout(10)
            request = b""
            while b"\r\n\r\n" not in request:
                data = client.recv(65536)
                if not data:
                    return
                request += data
            self.requests.append(request)
            head, _, rest = request.partition(b"\r\n\r\n")
            server.sendall(head + b"\r\nConnection: close\r\n\r\n" + rest)
            sent = 0
            while True:
                data = server.recv(65536)
                if not data:
                    return
                if sent == 0:
                    # The client must not send another request on this connection either.
                    status, _, more = data.partition(b"\r\n")
                    data = status + b"\r\nConnection: close\r\n" + more
                if self.breaks > 0 and sent + len(data) >= self.cut:
                    self.breaks -= 1
                    client.sendall(data[: self.cut - sent])
                    client.shutdown(socket.SHUT_WR)
                    return
                client.sendall(data)
                sent += len(data)

    def close(self) -> None:
        self.listener.close()


def test_a_download_cut_off_midway_continues_where_it_stopped(
    api: Any, data_dir: Path, tmp_path: Path
) -> None:
    with Client(api.url, api.key) as client:
        job = client.jobs.submit({"method": "smoke", "smoke_steps": 1})
    blobs = write_run_files(data_dir, job.id)
    big = os.urandom(3 * (1 << 20) + 11)
    (data_dir / "jobs" / job.id / "checkpoints" / "step-000002" / "state.pt").write_bytes(big)
    (data_dir / "jobs" / job.id / "adapter" / "adapter_model.safetensors").write_bytes(big)
    for what in ("checkpoint", "adapter"):
        proxy = CuttingProxy(api.url, cut=(1 << 20) + 3)
        try:
            with Client(proxy.url, api.key, retries=2) as flaky:
                remote = flaky.jobs.get(job.id)
                proxy.requests.clear()
                if what == "checkpoint":
                    got = remote.download("step-000002", tmp_path / "out" / "c.pt")
                    assert got.read_bytes() == big
                else:
                    out = remote.download_artifact("adapter", tmp_path / "out" / "a")
                    assert (out / "adapter_model.safetensors").read_bytes() == big
                    assert (out / "adapter_config.json").read_bytes() == blobs[
                        "adapter_config.json"
                    ]
        finally:
            proxy.close()
        # The second request asked for the rest of the same file, not the whole of it again.
        first, second = proxy.requests
        assert b"range:" not in first.lower()
        assert b"range: bytes=" in second.lower() and b"if-range:" in second.lower()
    # Nothing temporary is left beside them.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a", "c.pt"]
