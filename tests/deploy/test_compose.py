"""docker-compose.yml names only commands, modules, queues and settings that exist in the code."""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
APP_SERVICES = ["web", "worker-gpu", "worker-env", "beat"]
# Variables read by the images of postgres and redis, not by our code.
THIRD_PARTY_VARS = {"POSTGRES_DB", "POSTGRES_USER", "POSTGRES_PASSWORD", "REDISCLI_AUTH"}


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
    # The image installs the project's dependencies: the program must be a console script of
    # one of them, wherever this test's environment happens to keep its scripts.
    assert entry_points(group="console_scripts", name=program), f"{program} is not installed"
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


GUNICORN_CONF = "python:opentinker_site.gunicorn_conf"


def test_every_gunicorn_command_uses_the_threaded_config():
    """Long polls (the Tinker API's retrieve_future) would each hold a sync worker."""
    commands = {
        "compose web": COMPOSE["services"]["web"]["command"],
        "Dockerfile": re.search(r"^CMD (\[.*\])$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)[
            1
        ],
        "manage.py serve": (ROOT / "workers/management/commands/serve.py").read_text(),
    }
    for where, command in commands.items():
        assert f'"{GUNICORN_CONF}"' in str(command).replace("'", '"'), where


def test_the_gunicorn_config_is_threaded_and_names_real_settings():
    from gunicorn.config import Config

    module = importlib.import_module(GUNICORN_CONF.removeprefix("python:"))
    config = Config()
    names = [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        assert name in config.settings, f"gunicorn has no setting {name!r}"
        config.set(name, getattr(module, name))
    assert config.worker_class_str == "gthread"
    assert config.threads >= 8


@pytest.mark.parametrize("service", ["postgres", "redis", *APP_SERVICES])
def test_it_restarts_every_part_that_dies(service):
    assert COMPOSE["services"][service]["restart"] in {"unless-stopped", "always"}


def test_it_starts_the_app_once_its_backing_services_are_healthy():
    for backing in ("postgres", "redis"):
        assert COMPOSE["services"][backing]["healthcheck"]["test"]
    assert "/healthz" in " ".join(COMPOSE["services"]["web"]["healthcheck"]["test"])
    for service in APP_SERVICES:
        depends = COMPOSE["services"][service]["depends_on"]
        assert all(depends[b]["condition"] == "service_healthy" for b in ("postgres", "redis"))


def test_it_protects_redis_with_a_password_the_app_uses():
    redis_command = " ".join(COMPOSE["services"]["redis"]["command"])
    assert "--requirepass ${REDIS_PASSWORD" in redis_command
    for service in APP_SERVICES:
        url = COMPOSE["services"][service]["environment"]["REDIS_URL"]
        assert url.startswith("redis://:${REDIS_PASSWORD")
