"""Job runners, picked by ``spec["method"]``.

A runner is a callable ``run(ctx: JobContext) -> None``. It does the job's work step by step,
calls ``ctx.heartbeat(step)`` and ``ctx.log_metrics(step, {...})`` each step (the context
buffers metrics for up to a second; ``ctx.flush_metrics()`` before a checkpoint) and returns
early as soon as ``ctx.cancelled()`` is True. Returning normally means success; raising means
failure (the exception becomes the job's error message). The task around it owns every state
transition and the GPU lease.

Built in: ``smoke``. The training engine registers ``rl`` and ``sft`` by adding its import
path to ``BUILTIN`` (or calling ``register`` at import time of a module listed there).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from workers.runners.base import JobCancelled, JobContext, LeaseLost

__all__ = [
    "JobCancelled",
    "JobContext",
    "LeaseLost",
    "Runner",
    "UnknownMethod",
    "available",
    "get_runner",
    "register",
]

Runner = Callable[[JobContext], None]

# method -> "module:function", imported on first use so a worker that never runs RL jobs
# never imports the training engine.
BUILTIN: dict[str, str] = {
    "smoke": "workers.runners.smoke:run",
    "rl": "workers.runners.native:run",
    "sft": "workers.runners.native:run",
}

_registry: dict[str, Runner | str] = dict(BUILTIN)


class UnknownMethod(LookupError):
    def __init__(self, method: str) -> None:
        self.method = method
        known = ", ".join(sorted(_registry)) or "none"
        super().__init__(f"no runner for method {method!r} (available: {known})")


def register(method: str, runner: Runner | str) -> None:
    """Make ``runner`` (a callable or a "module:function" path) run jobs of ``method``."""
    if not method or not isinstance(method, str):
        raise ValueError("a runner needs a method name")
    if isinstance(runner, str) and ":" not in runner:
        raise ValueError(f"runner path must look like 'package.module:function', got {runner!r}")
    _registry[method] = runner


def available() -> list[str]:
    return sorted(_registry)


def get_runner(method: str) -> Runner:
    target = _registry.get(method)
    if target is None:
        raise UnknownMethod(method)
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module_name), attr)
        _registry[method] = target
    return target
