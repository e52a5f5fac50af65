"""What this node offers to the lock table, and the announcer that keeps it alive.

Sources, first match wins: ``OPENTINKER_GPUS`` ("0,1,2,3"), ``CUDA_VISIBLE_DEVICES``, the GPUs
``nvidia-smi`` lists; without any GPU the node offers ``OPENTINKER_CPU_SLOTS`` CPU slots so jobs
still run. Topology groups come from ``OPENTINKER_GPU_GROUPS`` ("0,1,2,3;4,5,6,7") or, when
``nvidia-smi`` is there, from each GPU's NUMA node in sysfs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from workers import conf
from workers.dispatcher import request_dispatch
from workers.locktable import GpuLockTable

log = logging.getLogger(__name__)

__all__ = [
    "Inventory",
    "detect_inventory",
    "max_block_size",
    "node_sizes",
    "start_announcer",
    "stop_announcer",
]


@dataclass(frozen=True)
class Inventory:
    node: str
    gpus: list[int]
    groups: list[list[int]]
    kind: str  # "gpu" or "cpu"
    max_jobs: int | None = None  # jobs the node's worker pool can run at once


def _as_text(value: object, sep: str) -> str:
    """Settings may hold a list (``env.list``) or a string; both mean the same."""
    if isinstance(value, (list, tuple)):
        parts = [",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for v in value]
        return sep.join(parts)
    return str(value or "")


def _parse_indices(raw: str, source: str) -> list[int]:
    try:
        values = [int(part) for part in raw.replace(" ", "").split(",") if part != ""]
    except ValueError as exc:
        raise ImproperlyConfigured(
            f"{source} must list GPU indices like '0,1,2', got {raw!r}"
        ) from exc
    if any(v < 0 for v in values) or len(set(values)) != len(values):
        raise ImproperlyConfigured(f"{source} must list distinct non-negative indices, got {raw!r}")
    return values


def _parse_groups(raw: str) -> list[list[int]]:
    return [
        _parse_indices(part, "OPENTINKER_GPU_GROUPS") for part in raw.split(";") if part.strip()
    ]


def _nvidia_smi_gpus() -> list[tuple[int, str]]:
    """(index, PCI bus id) of each GPU, or [] when there is no driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            gpus.append((int(parts[0]), parts[1]))
    return gpus


def _numa_groups(gpus: list[tuple[int, str]], offered: list[int]) -> list[list[int]]:
    """Group GPUs by NUMA node; [] when unknown or when they all share one."""
    by_node: dict[int, list[int]] = {}
    for index, bus_id in gpus:
        if index not in offered:
            continue
        # sysfs spells the domain with 4 hex digits, nvidia-smi with 8.
        domain, _, rest = bus_id.lower().partition(":")
        path = Path("/sys/bus/pci/devices") / f"{domain[-4:]}:{rest}" / "numa_node"
        try:
            numa = int(path.read_text().strip())
        except (OSError, ValueError):
            return []
        if numa < 0:
            return []
        by_node.setdefault(numa, []).append(index)
    if len(by_node) < 2:
        return []
    return [sorted(v) for _, v in sorted(by_node.items())]


def detect_inventory() -> Inventory:
    node = conf.node_name()
    configured = _as_text(conf.setting("OPENTINKER_GPUS"), ",")
    groups_raw = _as_text(conf.setting("OPENTINKER_GPU_GROUPS"), ";")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus: list[int] = []
    smi: list[tuple[int, str]] = []
    if configured.strip():
        gpus = _parse_indices(configured, "OPENTINKER_GPUS")
    elif visible is not None:
        if visible.strip() and visible.strip() != "-1":
            entries = [e for e in visible.replace(" ", "").split(",") if e]
            # UUID entries ("GPU-...") have no index: offer their positions.
            gpus = (
                _parse_indices(visible, "CUDA_VISIBLE_DEVICES")
                if all(e.isdigit() for e in entries)
                else list(range(len(entries)))
            )
    else:
        smi = _nvidia_smi_gpus()
        gpus = [index for index, _ in smi]
    if not gpus:
        return Inventory(node=node, gpus=list(range(conf.cpu_slots())), groups=[], kind="cpu")
    if groups_raw.strip():
        groups = _parse_groups(groups_raw)
    else:
        groups = _numa_groups(smi or _nvidia_smi_gpus(), gpus)
    return Inventory(node=node, gpus=sorted(gpus), groups=groups, kind="gpu")


def lock_table() -> GpuLockTable:
    return GpuLockTable(conf.get_redis())


def max_block_size() -> int:
    """The most GPUs one job may ask for: the largest node ever announced.

    Dead nodes count (they may come back). 0 while no worker has announced: unknown, so
    submissions queue until one does rather than being refused.
    """
    nodes = lock_table().nodes()
    return max((len(info["gpus"]) for info in nodes.values()), default=0)


def node_sizes() -> list[int]:
    """GPUs of every node ever announced (dead ones too: they may come back)."""
    return [len(info["gpus"]) for info in lock_table().nodes().values()]


def announce(inventory: Inventory | None = None) -> Inventory:
    inv = inventory or detect_inventory()
    lock_table().announce(
        inv.node,
        inv.gpus,
        inv.groups,
        kind=inv.kind,
        ttl=conf.inventory_ttl(),
        max_jobs=inv.max_jobs,
    )
    return inv


class _Announcer(threading.Thread):
    """Refreshes this node's liveness every heartbeat interval until stopped."""

    def __init__(self, inventory: Inventory) -> None:
        super().__init__(name="opentinker-inventory", daemon=True)
        self.inventory = inventory
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(conf.heartbeat_interval()):
            try:
                table = lock_table()
                was_alive = table.nodes().get(self.inventory.node, {}).get("alive", False)
                # A restarted Redis forgot the node: announce it again rather than just refresh.
                if not table.refresh(self.inventory.node, conf.inventory_ttl()):
                    announce(self.inventory)
                if not was_alive:
                    # Back in placement (after a reaper withdrew it): queued jobs may fit now.
                    _request_dispatch()
            except Exception:
                log.exception("could not refresh the inventory of node %s", self.inventory.node)


_announcer: _Announcer | None = None


def _request_dispatch() -> None:
    try:
        request_dispatch()
    except Exception:
        log.exception("dispatch after announcing node capacity failed")


def start_announcer(pool_size: int | None = None, *, serves_control: bool = False) -> Inventory:
    """Announce this node now, keep it alive from a background thread, and dispatch: the
    new capacity may admit queued jobs.

    ``pool_size`` (the worker's concurrency) caps the jobs placed on the node at once; one
    process stays free for control tasks when the worker also consumes ``control``.
    """
    global _announcer
    inv = detect_inventory()
    if pool_size:
        max_jobs = max(1, pool_size - 1) if serves_control and pool_size > 1 else pool_size
        if max_jobs < len(inv.gpus):
            log.warning(
                "node %s: a pool of %d runs at most %d jobs at once for %d slots; "
                "start the worker with --concurrency %d to use them all",
                inv.node,
                pool_size,
                max_jobs,
                len(inv.gpus),
                len(inv.gpus) + 1,
            )
        inv = dataclasses.replace(inv, max_jobs=max_jobs)
    inv = announce(inv)
    log.info(
        "node %s offers %s %s (groups %s, at most %s jobs)",
        inv.node,
        inv.kind,
        inv.gpus,
        inv.groups,
        inv.max_jobs or "unlimited",
    )
    if _announcer is None or not _announcer.is_alive():
        _announcer = _Announcer(inv)
        _announcer.start()
    _request_dispatch()
    return inv


def stop_announcer() -> None:
    """Stop refreshing and withdraw the node so no new job lands on it."""
    global _announcer
    if _announcer is None:
        return
    _announcer.stopping.set()
    try:
        lock_table().withdraw(_announcer.inventory.node)
    except Exception as exc:  # Redis already gone at shutdown: its TTL withdraws the node
        log.warning("could not withdraw node %s: %s", _announcer.inventory.node, exc)
    _announcer = None
