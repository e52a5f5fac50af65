"""The control plane, as ``jobs`` sees it: callables that the ``workers`` app provides.

``jobs`` sits below ``workers`` in the layers (workers call ``jobs.services``), so it never
imports it; ``workers.apps`` hands its functions in here when Django starts. Without the
workers app (a process that does not install it), nothing is registered: submissions wait in
the queue for the next dispatch, a cancel ends at the runner's next check, and the largest
node is unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ControlPlane", "control_plane", "set_control_plane"]


@dataclass(frozen=True)
class ControlPlane:
    dispatch: Callable[[], object]
    """Admit queued jobs onto free GPUs (after a submission or a release commits)."""
    cancel_running: Callable[[str], None]
    """Stop a STARTING or RUNNING job: cancel flag, task revocation, lease release."""
    max_block_size: Callable[[], int]
    """GPUs on the largest node ever announced; 0 while no worker has announced."""
    node_sizes: Callable[[], list[int]] | None = None
    """GPUs of each node ever announced (empty while none has): for gangs."""


_control_plane: ControlPlane | None = None


def set_control_plane(
    *,
    dispatch: Callable[[], object],
    cancel_running: Callable[[str], None],
    max_block_size: Callable[[], int],
    node_sizes: Callable[[], list[int]] | None = None,
) -> None:
    global _control_plane
    _control_plane = ControlPlane(
        dispatch=dispatch,
        cancel_running=cancel_running,
        max_block_size=max_block_size,
        node_sizes=node_sizes,
    )


def control_plane() -> ControlPlane | None:
    """The registered control plane, or None where the workers app is not installed."""
    return _control_plane
