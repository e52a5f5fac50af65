"""The built-in smoke job: a few seconds of real numerical work that exercises the whole path.

Each step runs power iterations on a random symmetric matrix for about ``smoke_step_seconds``
and logs how close the estimate of its largest eigenvalue is to the exact value. The two top
eigenvalues are 0.01% apart, so the error of the estimate shrinks visibly from step to step.
It heartbeats, logs metrics and checks for a cancel every step, like a real runner.
"""

from __future__ import annotations

import time
import zlib

import numpy as np

from workers.runners.base import JobContext

SIZE = 256
EIGEN_GAP = 1e-4


def run(ctx: JobContext) -> None:
    steps = int(ctx.spec.get("smoke_steps", 5))
    step_seconds = float(ctx.spec.get("smoke_step_seconds", 0.5))
    rng = np.random.default_rng(zlib.crc32(ctx.job_id.encode()))
    # A Householder reflection is orthogonal and cheap to build: H diag(eigenvalues) H is a
    # symmetric matrix whose spectrum is known, so no eigensolver is needed for the answer.
    u = rng.standard_normal(SIZE)
    householder = np.eye(SIZE) - 2.0 * np.outer(u, u) / (u @ u)
    eigenvalues = np.concatenate([[1.0, 1.0 - EIGEN_GAP], rng.uniform(0.0, 0.9, SIZE - 2)])
    matrix = (householder * eigenvalues) @ householder
    exact = float(eigenvalues.max())
    vector = rng.standard_normal(SIZE)
    vector /= np.linalg.norm(vector)
    ctx.event(f"smoke job: {steps} steps of {step_seconds:g} s on {', '.join(ctx.devices)}")
    for step in range(1, steps + 1):
        if ctx.cancelled():
            return
        started = time.monotonic()
        iterations = 0
        # At least one iteration per step, then as many as fit in the step's time budget.
        while iterations == 0 or time.monotonic() - started < step_seconds:
            vector = matrix @ vector
            vector /= np.linalg.norm(vector)
            iterations += 1
            if iterations % 64 == 0 and ctx.cancelled():
                return
        estimate = float(vector @ matrix @ vector)
        residual = float(np.linalg.norm(matrix @ vector - estimate * vector))
        ctx.log_metrics(
            step,
            {
                "eigenvalue": estimate,
                "eigenvalue_error": abs(estimate - exact),
                "residual": residual,
                "iterations": float(iterations),
                "step_seconds": time.monotonic() - started,
            },
        )
        ctx.heartbeat(step)
