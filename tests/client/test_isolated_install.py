"""The client installs and runs in a virtualenv that has neither Django nor torch.

The virtualenv (``var/client-venv``) is made with ``--without-pip`` and filled by this
project's pip through ``pip --python``: the client and its few dependencies from PyPI (or
pip's cache), nothing else. It is kept between runs while client/pyproject.toml is
unchanged; the client itself is reinstalled from the working tree when its files change.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT = ROOT / "client"
VENV = ROOT / "var" / "client-venv"
BIN = VENV / "bin"

pytestmark = pytest.mark.timeout(300)


def _stamp() -> str:
    digest = hashlib.sha256((CLIENT / "pyproject.toml").read_bytes())
    digest.update(sys.version.encode())
    return digest.hexdigest()


def _pip(*args: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(BIN / "python"),
        "--disable-pip-version-check",
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"


def _source_stamp() -> str:
    digest = hashlib.sha256()
    for path in sorted((CLIENT / "opentinker").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(CLIENT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    stamp_file = VENV / ".client-deps"
    source_file = VENV / ".client-source"
    fresh = not (stamp_file.is_file() and stamp_file.read_text() == _stamp())
    if not fresh and source_file.is_file() and source_file.read_text() == _source_stamp():
        return VENV
    if fresh:
        shutil.rmtree(VENV, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", "--clear", str(VENV)],
            check=True,
            timeout=120,
        )
    # Build from a copy: a build in client/ would leave build/ and egg-info in the tree.
    source = tmp_path_factory.mktemp("client-src") / "client"
    shutil.copytree(
        CLIENT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    if fresh:
        _pip("install", "--quiet", str(source))
        stamp_file.write_text(_stamp())
    else:
        _pip("install", "--quiet", "--no-deps", "--force-reinstall", str(source))
    source_file.write_text(_source_stamp())
    return VENV


def run(
    venv: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    # A clean environment: nothing from this process's virtualenv leaks in via PYTHONPATH.
    base = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(venv), "LANG": "C.UTF-8"}
    return subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=venv,
        timeout=60,
        check=False,
    )


def test_it_installs_without_django_or_torch(client_venv: Path) -> None:
    py = str(client_venv / "bin" / "python")
    where = run(
        client_venv, py, "-c", "import opentinker, opentinker.cli; print(opentinker.__file__)"
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(client_venv)

    for heavy in ("django", "torch", "rest_framework", "jobs", "training"):
        probe = run(client_venv, py, "-c", f"import {heavy}")
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, heavy

    installed = run(
        client_venv,
        py,
        "-c",
        "import importlib.metadata as m; "
        "print(sorted(d.metadata['Name'].lower() for d in m.distributions()))",
    )
    names = set(json.loads(installed.stdout.replace("'", '"')))
    assert "opentinker-client" in names
    assert not names & {"django", "torch", "opentinker", "celery", "numpy"}

    help_text = run(client_venv, str(client_venv / "bin" / "opentinker"), "--help")
    assert help_text.returncode == 0, help_text.stderr
    assert "submit" in help_text.stdout and "Exit codes" in help_text.stdout


@pytest.mark.django_db(transaction=True)
def test_it_runs_the_cli_against_a_live_server_from_the_bare_venv(
    client_venv: Path, api: Any, tmp_path: Path
) -> None:
    env = {
        "OPENTINKER_URL": api.url,
        "OPENTINKER_API_KEY": api.key,
        "OPENTINKER_CONFIG": str(tmp_path / "config.toml"),
    }
    who = run(client_venv, str(client_venv / "bin" / "opentinker"), "whoami", "--json", env=env)
    assert who.returncode == 0, who.stderr
    assert json.loads(who.stdout)["username"] == "olivia"

    spec = tmp_path / "spec.yaml"
    spec.write_text("method: smoke\n")
    dry = run(
        client_venv,
        str(client_venv / "bin" / "opentinker"),
        "submit",
        str(spec),
        "smoke_steps=2",
        "--dry-run",
        env=env,
    )
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout) == {"method": "smoke", "smoke_steps": 2}
    bad = run(
        client_venv,
        str(client_venv / "bin" / "opentinker"),
        "submit",
        str(spec),
        "smoke_stepz=2",
        env=env,
    )
    assert bad.returncode == 2 and "did you mean 'smoke_steps'" in bad.stderr
