"""Data-parallel ranks of a native job: the process group and what the loop asks of its peers.

A job whose lease spans several members (a gang of nodes) trains as one rank per member on
``torch.distributed`` (gloo on CPU, NCCL on CUDA). Rank 0 runs in the leader's ``run_job``
task; it hosts the rendezvous store on a free port and says where it is through a callback
(the service writes it to Redis, ``workers.gang``); every other rank connects to it.

The loop keeps every rank's weights identical: rank 0's state is broadcast once at the start
(a fresh or a resumed policy alike), the gradients of each step are summed across ranks before
the optimizer step (the losses are sums over tokens, so the sum over ranks is the gradient of
the whole batch), and rank 0 alone decides when to stop. No Django in here: a rank is a
process with a model, rows and a peer group.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Collective", "PeerLost", "backend_for"]

# How long a rank waits for its peers: at the rendezvous, and in any one collective. A peer
# that died closes its sockets and fails the others at once; this bounds a peer that hangs.
DEFAULT_TIMEOUT_S = 300.0


class PeerLost(RuntimeError):
    """A collective failed: another rank of the job stopped or cannot be reached."""


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class Collective:
    """This process's place in the job's process group (the default group of the process)."""

    def __init__(self, rank: int, world: int, device: str) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.comm_seconds = 0.0
        """Seconds spent in collectives since the last `take_comm_seconds` (a metric)."""

    # -- forming and leaving the group -------------------------------------------------------

    @classmethod
    def host(
        cls,
        *,
        world: int,
        device: str,
        address: str,
        publish: Callable[[str], None],
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Collective:
        """Rank 0: open the rendezvous store on a free port of ``address``, ``publish``
        "host:port", and wait (up to ``timeout_s``) for the other ranks to join."""
        store = dist.TCPStore(
            address,
            0,
            world,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        publish(f"{address}:{store.port}")
        return cls._init(store, rank=0, world=world, device=device, timeout_s=timeout_s)

    @classmethod
    def join(
        cls,
        *,
        rendezvous: str,
        rank: int,
        world: int,
        device: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Collective:
        """Rank ``rank`` > 0: connect to the store rank 0 published and join the group."""
        host, _, port = rendezvous.rpartition(":")
        try:
            store = dist.TCPStore(
                host, int(port), world, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
        except (RuntimeError, ValueError) as exc:
            raise PeerLost(f"rank {rank} could not reach rank 0 at {rendezvous}: {exc}") from exc
        return cls._init(store, rank=rank, world=world, device=device, timeout_s=timeout_s)

    @classmethod
    def _init(
        cls, store: Any, *, rank: int, world: int, device: str, timeout_s: float
    ) -> Collective:
        if dist.is_initialized():
            # A worker process runs one job at a time; a group left by a crashed run goes.
            dist.destroy_process_group()
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        try:
            dist.init_process_group(
                backend_for(device),
                store=store,
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
        except RuntimeError as exc:
            raise PeerLost(f"rank {rank}: the job's {world} ranks did not all join: {exc}") from exc
        return cls(rank, world, device)

    def close(self) -> None:
        if dist.is_initialized():
            # A peer already gone leaves nothing to tear down cleanly.
            with contextlib.suppress(RuntimeError):
                dist.destroy_process_group()

    # -- what the loop asks -------------------------------------------------------------------

    def _timed(self, what: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return fn()
        except RuntimeError as exc:
            raise PeerLost(f"rank {self.rank}: {what} failed, a peer stopped ({exc})") from exc
        finally:
            self.comm_seconds += time.perf_counter() - started

    def take_comm_seconds(self) -> float:
        spent, self.comm_seconds = self.comm_seconds, 0.0
        return spent

    def all_reduce_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient across ranks, in one collective per dtype.

        A rank whose share of the batch was empty has no gradient: it adds zeros.
        """
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])  # type: ignore[union-attr]
            self._timed("all_reduce of the gradients", lambda t=flat: dist.all_reduce(t))
            offset = 0
            for p in group:
                grad = p.grad
                assert grad is not None
                n = grad.numel()
                grad.copy_(flat[offset : offset + n].view_as(grad))
                offset += n

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        out: list[Any] = [None] * self.world
        self._timed("gathering the step's results", lambda: dist.all_gather_object(out, value))
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (the others pass anything)."""
        box = [value if self.rank == 0 else None]
        self._timed("a broadcast from rank 0", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def broadcast_state(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """A policy's ``state_dict`` from rank 0, as CPU tensors on every rank (torch's own
        serialisation: tensors do not go through pickle's per-object path)."""
        payload = b""
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            payload = buffer.getvalue()
        payload = self.broadcast(payload)
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)  # type: ignore[no-any-return]

    def agree(self, stop: bool) -> bool:
        """Rank 0's decision (cancel, lost lease) on every rank."""
        return bool(self.broadcast(bool(stop)))
