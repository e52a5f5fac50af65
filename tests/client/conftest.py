"""Client fixtures: the client package on the path, a live server with a real worker, and a
CLI runner whose environment points at that server.

The client is a separate distribution (``client/``); here it is imported from the source tree
so the server's virtualenv needs no install step. ``test_isolated_install.py`` checks the real
install into a virtualenv that has neither Django nor torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT_SRC = ROOT / "client"
if str(CLIENT_SRC) not in sys.path:
    sys.path.insert(0, str(CLIENT_SRC))


@dataclass
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        import json

        return json.loads(self.stdout)


@pytest.fixture
def client_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No stray login file or environment from the machine running the tests."""
    path = tmp_path / "opentinker" / "config.toml"
    monkeypatch.setenv("OPENTINKER_CONFIG", str(path))
    monkeypatch.delenv("OPENTINKER_URL", raising=False)
    monkeypatch.delenv("OPENTINKER_API_KEY", raising=False)
    monkeypatch.delenv("OPENTINKER_RETRIES", raising=False)
    return path


@pytest.fixture
def cli(client_config: Path) -> Callable[..., CliResult]:
    """Run ``opentinker ARGS`` in process; ``env`` adds environment variables."""
    from typer.testing import CliRunner

    from opentinker.cli import app

    def run(*args: str, env: dict[str, str] | None = None, input: str | None = None) -> CliResult:
        runner = CliRunner()
        result = runner.invoke(app, list(args), env=env, input=input, catch_exceptions=False)
        return CliResult(result.exit_code, result.stdout, result.stderr)

    return run


@dataclass
class Server:
    url: str
    key: str
    worker: Any

    @property
    def env(self) -> dict[str, str]:
        return {"OPENTINKER_URL": self.url, "OPENTINKER_API_KEY": self.key}


@pytest.fixture
def server(
    live_server: Any,
    start_worker: Callable[..., Any],
    owner_key: tuple[Any, str],
    data_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Server:
    """A live API server (this process), a real Celery worker and the owner's API key.

    The worker starts after OPENTINKER_DATA_DIR points at the test's data directory, so the
    checkpoints it writes are the ones the API serves.
    """
    monkeypatch.setenv("OPENTINKER_DATA_DIR", str(data_dir))
    # Two cores serve the test process, the live server and the worker.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    worker = start_worker(slots=1)
    return Server(url=live_server.url, key=owner_key[1], worker=worker)


@pytest.fixture
def api(live_server: Any, owner_key: tuple[Any, str], data_dir: Path) -> Server:
    """The live API server only (no worker): for calls that run no job."""
    return Server(url=live_server.url, key=owner_key[1], worker=None)


@pytest.fixture
def fake_api(client_config: Path) -> Iterator[Any]:
    """A scripted stand-in for the API (tests/client/fakes.py), for the fast CLI tests."""
    from tests.client.fakes import FakeApi

    api = FakeApi()
    stop = api.serve()
    yield api
    stop()
