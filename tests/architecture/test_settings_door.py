"""One settings door: every OPENTINKER_* name the server reads is declared in settings/, and a
bad value stops `manage.py check` with the variable's name instead of failing in a request."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests.architecture import PACKAGES, ROOT

NAME = re.compile(r"\bOPENTINKER_[A-Z0-9_]*[A-Z0-9]\b")
# Not settings: a marker string inside rendered prompts.
NOT_SETTINGS = {"OPENTINKER_ACTION"}
# A read: os.environ.get("X"), os.getenv("X"), os.environ["X"] not followed by "=".
ENV_READ = re.compile(
    r"(environ\.get\(|getenv\(|environ\[)\s*[\"'](OPENTINKER_[A-Z0-9_]+)[\"']\]?+(?!\s*=[^=])"
)


def _server_sources() -> list[Path]:
    return [
        path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts
    ]


def test_it_declares_every_opentinker_name_the_server_mentions() -> None:
    undeclared = sorted(
        {
            f"{name} ({path.relative_to(ROOT)})"
            for path in _server_sources()
            for name in NAME.findall(path.read_text())
            if name not in NOT_SETTINGS and not hasattr(settings, name)
        }
    )
    assert not undeclared, "not declared in opentinker_site/settings: " + ", ".join(undeclared)


def test_it_reads_opentinker_variables_from_the_environment_only_in_settings() -> None:
    readers = sorted(
        f"{path.relative_to(ROOT)}: {match.group(2)}"
        for path in _server_sources()
        if "settings" not in path.parts
        for match in ENV_READ.finditer(path.read_text())
        # The training library has no Django: its one switch is read by it and checked here.
        if not (path.parts[-2] == "training" and match.group(2) == "OPENTINKER_ONEDNN_LINEAR")
    )
    assert not readers, "environment read outside settings: " + ", ".join(readers)


def _manage_py_check(extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **extra_env, "DJANGO_SETTINGS_MODULE": "opentinker_site.settings.test"}
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "variable, value, reason",
    [
        ("OPENTINKER_JOB_LEASE_SECONDS", "30s", "must be an integer"),
        ("OPENTINKER_AGING_SECONDS", "0", "must be >= 1"),
        ("OPENTINKER_CPU_SLOTS", "-2", "must be in [1, 1024]"),
        ("OPENTINKER_TINKER_LONG_POLL_SECONDS", "ten", "must be an integer"),
        ("OPENTINKER_TINKER_GATHER_MS", "5000", "must be in [0, 1000]"),
        ("OPENTINKER_ALLOW_SIGNUP", "maybe", "must be a boolean"),
        ("OPENTINKER_ONEDNN_LINEAR", "perhaps", "must be a boolean"),
        ("OPENTINKER_NODE_NAME", "gpu:0", "without ':'"),
        ("OPENTINKER_GPUS", "0,x", "distinct GPU indices"),
        ("OPENTINKER_GPU_GROUPS", "0,1;1,1", "distinct GPU indices"),
        ("OPENTINKER_VERL_COMMAND", "python -c 'unclosed", "not a valid command line"),
    ],
)
def test_it_fails_manage_py_check_naming_the_bad_variable(
    variable: str, value: str, reason: str
) -> None:
    result = _manage_py_check({variable: value})
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert "ImproperlyConfigured" in last_line and variable in last_line and reason in last_line


def test_it_passes_manage_py_check_with_the_defaults() -> None:
    result = _manage_py_check({})
    assert result.returncode == 0, result.stderr
