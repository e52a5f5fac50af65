"""The serve loop of one base model: read the stream, schedule, run, until idle or stopped."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from django.db import close_old_connections

from tinker_api import futures
from tinker_api.services import sessions
from tinker_api.worker.chat import ChatHandler
from tinker_api.worker.full_models import FullModels, is_full
from tinker_api.worker.handlers import TrainingHandlers
from tinker_api.worker.meter import Meter, Shares, by_size, each
from tinker_api.worker.ordering import SeqOrder
from tinker_api.worker.policies import Policies
from tinker_api.worker.requests import Op
from tinker_api.worker.sampler_cache import SamplerCache
from tinker_api.worker.sampling import SamplingHandler
from training.engine import Engine
from workers import conf, control
from workers.dispatcher import JOBS_WAITING_KEY

log = logging.getLogger(__name__)

# How often a worker looks for sessions that stopped heartbeating.
REAP_SECONDS = 30.0
# How often the serve loop asks whether its Celery worker is shutting down, and how long it
# then keeps running the requests it has already read before it ends.
STOP_CHECK_SECONDS = 1.0
STOP_DRAIN_SECONDS = 10.0
# Entries are acknowledged as they are read, so one pending longer than this belongs to a
# worker that read it and then lost the reply or died: any worker of the base may take it.
ORPHAN_IDLE_MS = 60_000


def idle_seconds() -> int:
    """A worker with nothing to do for this long gives its GPU block back."""
    return conf.int_setting("OPENTINKER_TINKER_WORKER_IDLE_SECONDS", minimum=1)


def yield_seconds() -> int:
    """A worker with nothing to do for this long gives its block back early while a queued
    job waits for GPUs (its models' state goes to disk first, so a client loses nothing)."""
    return conf.int_setting("OPENTINKER_TINKER_WORKER_YIELD_SECONDS", minimum=1)


def torch_threads() -> int:
    return conf.int_setting("OPENTINKER_TINKER_TORCH_THREADS", minimum=1)


def gather_seconds(device: str) -> float:
    """How long a ready forward/backward waits for the next request of other active models
    that have nothing queued, so that it joins the same batched call (0: never wait). By
    default only on an accelerator: on a CPU a forward/backward costs its arithmetic, so
    four adapters batched cost what four calls cost, and the wait would be pure delay."""
    if conf.setting("OPENTINKER_TINKER_GATHER_MS") is None:
        return 0.0 if device == "cpu" else 0.003
    return conf.int_setting("OPENTINKER_TINKER_GATHER_MS", minimum=0) / 1000.0


# Requests that can run twice without harm; every other one runs once (its future's claim).
RERUNNABLE = frozenset({"skip", "close"})


def jobs_waiting(node: str) -> bool:
    """Whether a queued job waits for GPUs that this node's model workers hold."""
    raw = conf.get_redis().get(JOBS_WAITING_KEY)
    if raw is None:
        return False
    try:
        nodes = json.loads(raw)
    except ValueError:
        nodes = None
    # A dispatcher of an earlier release sets "1" for the whole pool.
    return node in nodes if isinstance(nodes, list) else True


class ModelWorker:
    """Serves every model of one base model from one ``Engine``."""

    def __init__(
        self,
        base: str,
        base_path: str,
        device: str,
        worker_id: str,
        node: str = "",
        gpus: int = 1,
    ) -> None:
        if device == "cpu":
            torch.set_num_threads(torch_threads())
        self.base = base
        self.worker_id = worker_id
        self.node = node
        self.engine = Engine(base_path, device=device)
        self.policies = Policies(self.engine)
        self.samplers = SamplerCache(self.engine)
        self.order = SeqOrder(worker_id)
        self.training = TrainingHandlers(self.policies, self.samplers)
        self.sampling = SamplingHandler(base, self.engine, self.policies, self.samplers)
        self.meter = Meter(base, gpus)
        # One continuous batch decodes the OpenAI-style requests and the Tinker samples.
        self.chat = ChatHandler(
            base,
            self.engine,
            self.policies,
            self.samplers,
            charge=self.meter.charge,
            sampling=self.sampling,
        )
        # Fully fine-tuned policies: whole models of their own, each with its own batch.
        self.full = FullModels(base, self.engine, self.chat, self.meter.charge)
        # Models whose sessions ended while sample rows decode with their snapshots close
        # once those rows are done: (models, why, the close request to answer).
        self.closes: list[tuple[list[str], str, str | None]] = []
        # Chat and sample requests read since the last turn (they join the batch in order).
        self.chats: list[Op] = []
        self.gather = gather_seconds(device)
        self.last_activity = time.monotonic()
        self.stopping = threading.Event()
        # Called when Redis turns out to have lost its data: the lease and the registration
        # are gone too, and must be taken back before anyone else takes them.
        self.on_data_lost: Callable[[], None] = lambda: None
        futures.ensure_group(base)
        futures.mark_epoch(worker_id)

    # ---------------------------------------------------------------- reading

    def read(self, block_ms: int) -> int:
        try:
            got = conf.get_redis().xreadgroup(
                futures.GROUP,
                self.worker_id,
                {futures.stream_key(self.base): ">"},
                count=512,
                block=block_ms or None,
            )
        except Exception as exc:
            if not futures.is_nogroup(exc):
                raise
            self.data_lost()
            return 0
        return self._take([e for _stream, entries in got or [] for e in entries], again=False)

    def _take(self, entries: list[Any], *, again: bool) -> int:
        """Claim and queue stream entries. ``again``: entries delivered before, whose delivery
        this worker may or may not have seen; a request whose future is no longer queued
        then ran already."""
        ops: list[Op] = []
        claims: list[tuple[Any, str]] = []
        for entry_id, raw in entries:
            fields = {k.decode(): v for k, v in raw.items()}
            op = Op(fields=json.loads(fields["op"]), body=fields.get("body"))
            ops.append(op)
            claims.append((entry_id, op.rid))
        claimed = futures.claim_entries(self.base, self.worker_id, claims)
        # Queued by a web process of an earlier release, which named no team in the request:
        # its future's team is charged for it. A close is the service's own.
        untagged = [op for op in ops if "team" not in op.fields and op.kind != "close"]
        if untagged:
            for op, team in zip(
                untagged, futures.teams_of([op.rid for op in untagged]), strict=True
            ):
                op.fields["team"] = team
        if again:
            # A skip's or a close's future is not a queued one; running either twice is harmless.
            ops = [op for op, ok in zip(ops, claimed, strict=True) if ok or op.kind in RERUNNABLE]
        for op in ops:
            self._accept(op)
        if ops:
            self.last_activity = time.monotonic()
        return len(ops)

    def reclaim(self) -> int:
        """Take up entries delivered but never acknowledged: this worker's own (a connection
        that dropped after Redis sent a read's reply lost them on the way) and those of a
        worker that died between reading and acknowledging."""
        r = conf.get_redis()
        key = futures.stream_key(self.base)
        try:
            own = r.xreadgroup(futures.GROUP, self.worker_id, {key: "0"}, count=512)
            orphans = r.xautoclaim(
                key, futures.GROUP, self.worker_id, ORPHAN_IDLE_MS, "0-0", count=512
            )
        except Exception as exc:
            if not futures.is_nogroup(exc):
                raise
            self.data_lost()
            return 0
        entries = [e for _stream, batch in own or [] for e in batch]
        seen = {entry_id for entry_id, _raw in entries}
        entries += [e for e in orphans[1] if e[0] not in seen]
        if entries:
            log.warning(
                "worker %s takes up %d unacknowledged requests", self.worker_id, len(entries)
            )
        return self._take(entries, again=True)

    def data_lost(self) -> None:
        """Redis restarted without its data: the stream, its group, the futures, every
        model's next seq_id, the lease and this worker's registration are gone. The models'
        state and their next seq_ids live on here; requests that were queued are lost with
        their futures (a poll of one answers that it is unknown)."""
        log.warning("Redis lost its data: worker %s recreates its stream group", self.worker_id)
        futures.ensure_group(self.base)
        futures.mark_epoch(self.worker_id)
        self.order.data_lost()
        self.on_data_lost()

    def check_epoch(self) -> None:
        # The stream and group come back with the next submission, so reads alone do not
        # always see the loss.
        if not futures.epoch_kept(self.worker_id):
            self.data_lost()

    def _accept(self, op: Op) -> None:
        if op.kind in ("sample", "chat"):
            self.chats.append(op)
            return
        if op.kind == "close":
            self.close_models(op.fields["models"], "has finished", answer=op.rid)
            return
        self.order.accept(op)

    def close_models(self, models: list[str], why: str, answer: str | None = None) -> None:
        """The session of these models ended: drop their queued work (a seq_id gap left by
        a failed client-side custom loss ends here too) and free their weights; then answer
        the close request ``answer``. While Tinker sample rows decode with a snapshot of
        one of them, after they are done (a client may end its session with samples out)."""
        if self._sampling_from(models):
            self.closes.append((models, why, answer))
            return
        for model in models:
            for queued in self.order.drop(model):
                futures.fail(queued.rid, f"the session of {model} {why}", "user")
            policy = self.policies.get(model)
            self.policies.close(model)
            if policy is not None:
                self.samplers.forget(policy)
        if answer is not None:
            futures.complete(answer, json_body=b"{}")

    def _sampling_from(self, models: list[str]) -> bool:
        in_use = self.sampling.keys_in_use()
        if not in_use:
            return False
        for model in models:
            policy = self.policies.get(model)
            if policy is not None and any(policy.version_key(v) in in_use for v in policy.versions):
                return True
        return False

    def reap_sessions(self) -> list[str]:
        """End the sessions of this worker's models that stopped heartbeating (their client
        is gone) and close those models; returns the closed model ids."""
        held = set(self.policies) | set(self.order.pending)
        if not held:
            return []
        close_old_connections()
        gone = sessions.end_silent_sessions(held, sessions.session_timeout())
        self.close_models(gone, "stopped heartbeating")
        return gone

    def has_runnable(self) -> bool:
        busy = self.chat.busy or self.full.busy
        return bool(self.chats) or busy or self.order.has_runnable()

    # ---------------------------------------------------------------- scheduling

    def gather_batch(self) -> None:
        """Hold a ready forward/backward for up to ``gather_seconds()`` while other active
        models have nothing queued: their next request (a client a few milliseconds behind)
        then runs in the same batched call instead of waiting for this one to finish."""
        if self.gather <= 0:
            return
        deadline = time.monotonic() + self.gather
        while (
            not self.chats
            and not self.chat.busy
            and not self.full.busy
            and self.order.awaiting_others()
        ):
            left = deadline - time.monotonic()
            if left <= 0 or not self.read(max(1, round(left * 1000))):
                return

    def step(self) -> bool:
        """Run what is ready; True if anything ran."""
        progressed = False
        # Between steps no batch is mid-call: what the cache may drop is what no row decodes.
        self.samplers.trim(self.chat.adapters_in_use())
        if self.closes:
            self._close_deferred()
        # One decode step of the batch per turn: what was read since joins it first, Tinker
        # samples and OpenAI-style requests alike, so that neither waits for the other. The
        # chat handler charges its prefills and decode steps itself (``self.meter``).
        if self.chats:
            chats, self.chats = self.chats, []
            self.meter.count(chats)
            full = [op for op in chats if is_full(op)]
            if full:
                self.full.admit(full)
            if len(full) < len(chats):
                self.chat.admit([op for op in chats if not is_full(op)])
            progressed = True
        if self.chat.busy:
            self.chat.step()
            progressed = True
        if self.full.busy:
            self.full.step()
            progressed = True
        elif self.full.handlers:
            self.full.step()  # drops the models idle too long
        ready = self.order.take_ready()
        for op in ready.singles:
            self._metered([op], each([op]), self.training.run_single, op)
            self.order.advance(op.model, op.seq + 1)
            progressed = True
        if ready.optims:
            self._metered(ready.optims, each(ready.optims), self.training.run_optims, ready.optims)
            progressed = True
        for forward_only, ops in ready.fwdbwd.items():
            if ops:
                self._metered(ops, by_size(ops), self.training.run_fwdbwd, ops, forward_only)
                progressed = True
        if progressed:
            self.last_activity = time.monotonic()
        self.meter.flush()
        return progressed

    def _close_deferred(self) -> None:
        closes, self.closes = self.closes, []
        for models, why, answer in closes:
            self.close_models(models, why, answer)

    def _metered(self, ops: list[Op], shares: Any, run: Callable[..., None], *args: Any) -> None:
        """``run(*args)``, counted for ``ops``, its time charged to the teams of ``shares``."""
        self.meter.count(ops)
        self._charged(shares, run, *args)

    def _charged(self, shares: Shares, run: Callable[..., Any], *args: Any) -> Any:
        """``run(*args)``, its time charged to the teams of ``shares``."""
        started = time.perf_counter()
        try:
            return run(*args)
        finally:
            self.meter.charge(shares, time.perf_counter() - started)

    # ---------------------------------------------------------------- shutdown

    def fail_everything(self, reason: str) -> None:
        for op in self.order.queued():
            futures.fail(op.rid, reason)
        for op in self.chats:
            futures.fail(op.rid, reason)
        futures.samples_answered(self.base, len(self.chats))
        self.chat.fail_all(reason)
        # No sample row decodes any more: the closes it held back run.
        self._close_deferred()
        self.full.fail_all(reason)
        self.order.pending.clear()
        self.chats = []

    def drain(self, seconds: float) -> None:
        """Run what has been read and is runnable, for at most ``seconds``; requests still in
        the stream stay there for the next worker of this base model."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.has_runnable() and self.step():
            pass

    def serve(self) -> str:
        """Run until idle for ``idle_seconds()`` (or ``yield_seconds()`` while a queued job
        waits for GPUs) or stopped; returns why it ended."""
        idle, early = idle_seconds(), min(yield_seconds(), idle_seconds())
        next_reap = time.monotonic() + REAP_SECONDS
        next_check = time.monotonic() + STOP_CHECK_SECONDS
        while not self.stopping.is_set():
            if time.monotonic() > next_reap:
                next_reap = time.monotonic() + REAP_SECONDS
                self.reap_sessions()
            checking = time.monotonic() > next_check
            if checking:
                next_check = time.monotonic() + STOP_CHECK_SECONDS
                if control.is_stopping():
                    self.drain(STOP_DRAIN_SECONDS)
                    return "shutdown"
                self.check_epoch()
                self.reclaim()
            self.read(0 if self.has_runnable() else 200)
            self.gather_batch()
            if self.step():
                continue
            quiet = not self.order.pending and not self.chats
            quiet = quiet and not self.chat.busy and not self.full.busy
            quiet_for = time.monotonic() - self.last_activity if quiet else 0.0
            if quiet_for > idle:
                return "idle"
            if checking and quiet_for > early and jobs_waiting(self.node):
                return "yielded"
        return "stopped"
