"""The flag by which a Celery worker's shutdown handler tells its long-running tasks to end.

The end-to-end case (SIGTERM to a real worker ends its model worker at once) is in
tests/tinker_api/test_sdk_live.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from workers import control

CHILD = (
    "import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', "
    "'opentinker_site.settings.test'); django.setup(); "
    "from workers import control; print(control.is_stopping())"
)


def _child_sees_stopping(redis_url: str) -> bool:
    """A child of this process (as a prefork pool process is of its worker) asks."""
    env = dict(os.environ, REDIS_URL=redis_url)
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1] == "True"


def test_the_worker_and_its_children_see_the_flag_until_a_new_worker_clears_it(
    clean_control_plane: Any, redis_url: str
) -> None:
    control.clear_stopping()
    assert not control.is_stopping()
    assert not _child_sees_stopping(redis_url)

    control.mark_stopping()
    assert control.is_stopping()  # solo pool: the task runs in the worker process
    assert _child_sees_stopping(redis_url)  # prefork: the task runs in a child

    # A restarted worker with the same host name and pid must not inherit the flag.
    control.clear_stopping()
    assert not control.is_stopping()
    assert not _child_sees_stopping(redis_url)
