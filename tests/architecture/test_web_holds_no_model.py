"""The web process holds no model: what gunicorn loads imports neither torch nor the training
core, and the job sample endpoint is handed to the model workers.

import-linter checks that ``jobs`` imports no ``training`` (pyproject.toml); this checks the
process as it starts, every app's ``ready()`` included, in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.architecture import ROOT

PROBE = """
import json, sys
import django
django.setup()
from django.urls import resolve
import opentinker_site.urls
from jobs import sampling
view = resolve("/api/v1/jobs/00000000-0000-0000-0000-000000000000/sample")
# The one module of the training core the web process reads: the losses' configs, a table
# with no torch (the web refuses a config a loss does not take when the request arrives).
SHARED = {"training", "training.loss_config"}
heavy = sorted(
    m for m in sys.modules
    if m.split(".")[0] in ("torch", "transformers", "peft", "tokenizers", "training")
    and m not in SHARED
)
sampler = sampling._sampler
print(json.dumps({
    "heavy": heavy,
    "view": view.url_name,
    "sampler": None if sampler is None else f"{sampler.__module__}.{sampler.__qualname__}",
}))
"""


def test_it_loads_the_web_process_without_torch_and_samples_on_the_model_workers() -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "opentinker_site.settings.test"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["heavy"] == [], found["heavy"]
    assert found["view"] == "job-sample"
    assert found["sampler"] == "tinker_api.services.job_samples.sample_job"


def test_it_finds_adapters_by_the_file_name_the_training_core_writes() -> None:
    from jobs import artifacts
    from training import peft_io

    assert artifacts.ADAPTER_WEIGHTS == peft_io.WEIGHTS_FILE
