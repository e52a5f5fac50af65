"""docker-compose.yml names only commands, modules, queues and settings that exist in the code."""

from __future__ import annotations

import importlib
import re
import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
APP_SERVICES = ["web", "worker-gpu", "worker-env", "beat"]
# Variables read by the images of postgres and redis, not by our code.
THIRD_PARTY_VARS = {"POSTGRES_DB", "POSTGRES_USER", "POSTGRES_PASSWORD"}


def _code_text() -> str:
    parts = []
    for package in ("opentinker_site", "accounts", "jobs", "workers", "environments", "training"):
        for path in (ROOT / package).rglob("*.py"):
            parts.append(path.read_text())
    return "\n".join(parts)


def _option(command: list[str], *names: str) -> str:
    for i, word in enumerate(command):
        if word in names:
            return command[i + 1]
    raise AssertionError(f"none of {names} in {command}")


def test_it_declares_the_production_services():
    assert set(COMPOSE["services"]) >= {"postgres", "redis", *APP_SERVICES}
    reservations = COMPOSE["services"]["worker-gpu"]["deploy"]["resources"]["reservations"]
    assert reservations["devices"][0]["capabilities"] == ["gpu"]


@pytest.mark.parametrize("service", APP_SERVICES)
def test_it_runs_a_command_that_exists(service):
    command = COMPOSE["services"][service]["command"]
    program = command[0]
    assert shutil.which(program) or (ROOT / ".venv" / "bin" / program).exists(), program
    if program == "gunicorn":
        module, _, attribute = command[1].partition(":")
        assert callable(getattr(importlib.import_module(module), attribute))
    elif program == "celery":
        app_module = importlib.import_module(_option(command, "-A", "--app") + ".celery")
        assert command[3] in {"worker", "beat"}
        if command[3] == "worker":
            declared = {queue.name for queue in app_module.app.conf.task_queues}
            for queue in _option(command, "--queues", "-Q").split(","):
                assert queue in declared, f"{service} consumes undeclared queue {queue}"
    else:
        pytest.fail(f"{service}: unexpected program {program}")


@pytest.mark.parametrize("service", APP_SERVICES)
def test_it_only_sets_variables_the_code_reads(service):
    code = _code_text()
    environment = COMPOSE["services"][service]["environment"]
    for name in environment:
        if name in THIRD_PARTY_VARS or name == "DJANGO_SETTINGS_MODULE":
            continue
        assert re.search(rf"[\"']{name}[\"']", code), f"{service}: {name} is read nowhere"
    settings_module = environment["DJANGO_SETTINGS_MODULE"]
    assert (ROOT / (settings_module.replace(".", "/") + ".py")).is_file()
