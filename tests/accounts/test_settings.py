"""Settings read from the environment: secrets, *_FILE variants, bounds, production rules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from opentinker_site.settings.base import read_int, read_secret

ROOT = Path(__file__).resolve().parents[2]


def test_it_reads_a_secret_from_a_file(tmp_path, monkeypatch):
    path = tmp_path / "hmac"
    path.write_text("s" * 40 + "\n")
    monkeypatch.delenv("OT_SECRET", raising=False)
    monkeypatch.setenv("OT_SECRET_FILE", str(path))
    assert read_secret("OT_SECRET", min_length=32) == "s" * 40


def test_it_refuses_missing_short_or_doubly_set_secrets(tmp_path, monkeypatch):
    monkeypatch.delenv("OT_SECRET", raising=False)
    monkeypatch.delenv("OT_SECRET_FILE", raising=False)
    with pytest.raises(ImproperlyConfigured, match="OT_SECRET"):
        read_secret("OT_SECRET")
    assert read_secret("OT_SECRET", "fallback") == "fallback"
    monkeypatch.setenv("OT_SECRET", "short")
    with pytest.raises(ImproperlyConfigured, match="at least 32"):
        read_secret("OT_SECRET", min_length=32)
    monkeypatch.setenv("OT_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match="only one"):
        read_secret("OT_SECRET")
    monkeypatch.delenv("OT_SECRET")
    with pytest.raises(ImproperlyConfigured, match="cannot read"):
        read_secret("OT_SECRET")


def test_it_validates_integers(monkeypatch):
    monkeypatch.delenv("OT_INT", raising=False)
    assert read_int("OT_INT", 30, minimum=3) == 30
    monkeypatch.setenv("OT_INT", "45")
    assert read_int("OT_INT", 30, minimum=3) == 45
    monkeypatch.setenv("OT_INT", "30s")
    with pytest.raises(ImproperlyConfigured, match="integer"):
        read_int("OT_INT", 30, minimum=3)
    monkeypatch.setenv("OT_INT", "1")
    with pytest.raises(ImproperlyConfigured, match=">= 3"):
        read_int("OT_INT", 30, minimum=3)


def test_it_has_the_documented_defaults(settings):
    assert settings.OPENTINKER_KEY_ROTATION_GRACE_HOURS == 24
    assert settings.OPENTINKER_JOB_LEASE_SECONDS >= 3
    assert settings.OPENTINKER_MAX_ATTEMPTS >= 1
    assert settings.OPENTINKER_MAX_DATASET_BYTES >= 1
    assert settings.REDIS_URL
    assert not any(name.startswith("CELERY_") for name in dir(settings))
    for app in (
        "rest_framework",
        "django_filters",
        "drf_spectacular",
        "accounts",
        "jobs",
        "workers",
    ):
        assert app in settings.INSTALLED_APPS


def _production(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OPENTINKER_", "SECRET_KEY", "DATABASE_URL", "DJANGO_", "DEBUG"))
    }
    base.update(env, DJANGO_SETTINGS_MODULE="opentinker_site.settings.production")
    code = (
        "import django; from django.conf import settings; django.setup();"
        "print(settings.OPENTINKER_KEY_HMAC_SECRET[:4], settings.DEBUG, settings.REDIS_URL)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=base, capture_output=True, text=True, timeout=60
    )


def test_it_refuses_to_start_production_without_secrets(tmp_path):
    result = _production(
        {
            "SECRET_KEY": "k" * 50,
            "REDIS_URL": "redis://127.0.0.1:6379/0",
            "ALLOWED_HOSTS": "example.org",
            "OPENTINKER_DATA_DIR": str(tmp_path),
        }
    )
    assert result.returncode != 0
    assert "OPENTINKER_KEY_HMAC_SECRET" in result.stderr
    assert "ImproperlyConfigured" in result.stderr


def test_it_starts_production_with_file_secrets(tmp_path):
    (tmp_path / "hmac").write_text("h" * 48)
    (tmp_path / "secret").write_text("k" * 50)
    result = _production(
        {
            "SECRET_KEY_FILE": str(tmp_path / "secret"),
            "OPENTINKER_KEY_HMAC_SECRET_FILE": str(tmp_path / "hmac"),
            "REDIS_URL": "redis://127.0.0.1:6379/0",
            "ALLOWED_HOSTS": "example.org",
            "OPENTINKER_DATA_DIR": str(tmp_path),
        }
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["hhhh", "False", "redis://127.0.0.1:6379/0"]


@pytest.mark.parametrize(
    "name, value",
    [
        ("DATABASE_URL", "mysql://a@b/c"),
        ("DATABASE_URL", "not-a-url"),
        ("REDIS_URL", "http://127.0.0.1:6379"),
        ("OPENTINKER_JOB_LEASE_SECONDS", "30s"),
        ("OPENTINKER_KEY_ROTATION_GRACE_HOURS", "-1"),
        ("OPENTINKER_MAX_DATASET_BYTES", "50MB"),
        ("OPENTINKER_MAX_DATASET_BYTES", "0"),
        ("OPENTINKER_DEBUG", "maybe"),
        ("OPENTINKER_DEBUG", "1"),
    ],
)
def test_it_refuses_bad_values_at_start(tmp_path, name, value):
    result = _production(
        {
            "SECRET_KEY": "k" * 50,
            "OPENTINKER_KEY_HMAC_SECRET": "h" * 48,
            "REDIS_URL": "redis://127.0.0.1:6379/0",
            "ALLOWED_HOSTS": "example.org",
            "OPENTINKER_DATA_DIR": str(tmp_path),
            name: value,
        }
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and name in result.stderr
