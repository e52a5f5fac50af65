"""Stopping a child process together with everything it started (its process group).

Children are started with ``start_new_session=True`` (the web server of `manage.py demo`,
verl's trainer, test workers), so their process id is also their group id and one signal
reaches the whole tree: Celery pool processes, Ray workers, vLLM engines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from typing import Any


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process_group(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM the process group of `proc`, wait up to `grace_s` for the leader and the rest
    of the group to exit, then SIGKILL whatever is left and reap the leader.

    The group can outlive its leader, so the SIGKILL goes to the group even when the leader
    already exited.
    """
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait()
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not group_alive(pgid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
