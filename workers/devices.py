"""Which torch devices a lease's GPUs are, as the process that runs the work sees them."""

from __future__ import annotations

import os

from workers.locktable import GpuLockTable

__all__ = ["device_names", "lease_devices"]


def device_names(kind: str, gpus: list[int] | tuple[int, ...]) -> list[str]:
    """Torch device strings for leased GPUs, as this process sees them.

    With ``CUDA_VISIBLE_DEVICES=2,3`` the leased physical GPU 3 is ``cuda:1`` in-process.
    """
    if kind != "gpu":
        return ["cpu"] * len(gpus)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    entries = [e for e in visible.replace(" ", "").split(",") if e]
    if entries and all(e.isdigit() for e in entries):
        order = [int(e) for e in entries]
        return [f"cuda:{order.index(g)}" if g in order else f"cuda:{g}" for g in gpus]
    return [f"cuda:{g}" for g in gpus]


def lease_devices(table: GpuLockTable, node: str, gpus: list[int] | tuple[int, ...]) -> list[str]:
    """The devices of ``gpus`` on ``node``: CPU slots on a node that announced no GPU."""
    info = table.nodes().get(node)
    kind = str(info["kind"]) if info else "gpu"
    return device_names(kind, gpus)
