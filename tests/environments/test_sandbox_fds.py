"""The sandbox closes each descriptor it opens exactly once.

A second close of a number closes whatever another thread opened under that number in the
meantime: the trainer samples `math_code` episodes on one thread while another writes a
checkpoint or reads a pipe.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest

from environments.sandbox import SandboxLimits, run_code


@pytest.mark.parametrize("code", ["print(6 * 7)", "raise SystemExit(3)", "while True: pass"])
def test_it_closes_each_descriptor_it_opened_once(monkeypatch: Any, code: str) -> None:
    """A close of a number that is no longer open fails with EBADF here, where no other
    thread reopens it (the sandbox itself swallows the error)."""
    stale: list[int] = []
    close = os.close

    def recording(fd: int) -> None:
        try:
            close(fd)
        except OSError as exc:
            if exc.errno == errno.EBADF:
                stale.append(fd)
            raise

    monkeypatch.setattr(os, "close", recording)
    result = run_code(code, SandboxLimits(wall_seconds=1.0, cpu_seconds=1))
    assert "could not start" not in result.reason, result.reason
    assert stale == [], f"closed after they were closed: {stale}"
