"""What verl's trainer processes import from the project loads without Django or DRF: they run
in verl's own venv (docs/verl.md), which has neither. A module of theirs that reaches the web
framework (a job spec check that imported the API's parser did) fails every verl job that
plays an environment through the agent loop, and only the slow real verl tests would say so."""

from __future__ import annotations

import subprocess
import sys

from tests.architecture import ROOT

# verl imports the agent loop by class path and the reward function by file path; each
# environment registers the episodes it steps on import.
PROBE = """
import importlib.abc, sys

class NoWebFramework(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("django", "rest_framework", "celery"):
            raise ImportError(f"{name}: not in verl's venv")
        return None

sys.meta_path.insert(0, NoWebFramework())
import workers.runners.verl_agent_loop
import importlib.util
spec = importlib.util.spec_from_file_location("verl_reward", "workers/runners/verl_reward.py")
spec.loader.exec_module(importlib.util.module_from_spec(spec))
import jobs.spec
from environments.registry import env_names, get_env
for name in env_names():
    get_env(name)
print("ok")
"""


def test_verls_processes_import_the_agent_loop_and_reward_without_the_web_framework() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "ok"
