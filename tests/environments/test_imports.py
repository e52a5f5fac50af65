from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_imports_the_protocol_envs_renderer_and_sandbox_without_django_or_torch() -> None:
    code = (
        "import sys\n"
        "import environments.types, environments.registry, environments.renderer\n"
        "import environments.sandbox, environments.rollouts, environments.datasets\n"
        "import environments.envs.math_env, environments.envs.math_code\n"
        "import environments.envs.bandit, environments.envs.gomoku\n"
        "print(sorted(m for m in ('django', 'torch', 'celery') if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
