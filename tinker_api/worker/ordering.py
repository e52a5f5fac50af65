"""Per-model ``seq_id`` order: a request runs only after every earlier one of its model.

The SDK numbers each model's requests; chunks of one call get consecutive seq_ids. A request
that arrives early waits for the gap to fill; a gap left by a request lost with a dead worker
is skipped once that is certain. A request refused at submission arrives as a ``skip`` (its
future already failed), so the next one runs. A gap that stays open for
``OPENTINKER_TINKER_SEQ_GAP_SECONDS`` (a client that numbered a request and never sent it)
fails the requests waiting behind it, which lets the model's later requests run.

A Redis that restarts without its data loses the requests queued in the stream and each
model's stored next seq_id. The worker's own next seq_ids stay the truth (written back); a
model that waits on a seq_id nobody submitted since (no dedupe key), below a request that did
arrive, skips it after ``GAP_CHECK_SECONDS``: it was lost with the data, and its client has
been told so (a poll of its future answers that the request is unknown).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tinker_api import futures
from tinker_api.worker.requests import Op
from workers import conf

log = logging.getLogger(__name__)

# How long a model may wait on a missing seq_id before the worker checks whether that
# request was lost with a dead worker.
GAP_CHECK_SECONDS = 1.0


def seq_gap_seconds() -> int:
    return conf.int_setting("OPENTINKER_TINKER_SEQ_GAP_SECONDS", minimum=1)


# How far below its first request after a data loss a model looks for requests on their way.
LOST_WINDOW = 1024

# A model that sent a request this recently is "active": a client in a training loop sends
# its next request a few milliseconds after its previous one is answered.
ACTIVE_SECONDS = 0.25


@dataclass
class Ready:
    """What one scheduling pass found runnable, each list in seq_id order per model."""

    # Each runs before its model advances (``SeqOrder.advance`` once it ran).
    singles: list[Op] = field(default_factory=list)
    optims: list[Op] = field(default_factory=list)
    # forward_only -> consecutive forward/backward chunks of the models ready for them
    fwdbwd: dict[bool, list[Op]] = field(default_factory=lambda: {False: [], True: []})


class SeqOrder:
    """The ordered requests of the models one worker serves."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.next: dict[str, int] = {}
        self.pending: dict[str, dict[int, Op]] = {}
        self.waiting_since: dict[str, float] = {}
        # When each model began waiting on its current gap (not reset by the gap checks).
        self.gap_since: dict[str, float] = {}
        self.gap_limit = float(seq_gap_seconds())
        # When each model last sent a request (monotonic), for the gather window.
        self.seen: dict[str, float] = {}
        # Models whose queued requests Redis may have lost with its data -> the lowest
        # seq_id accepted since (None: none yet); cleared once the model runs past it.
        self.unsure: dict[str, int | None] = {}

    def accept(self, op: Op) -> None:
        model = op.model
        self.seen[model] = time.monotonic()
        if model not in self.next:
            stored = futures.next_seq(model)
            # Every model starts at seq_id 0 (its creation), which records its next seq_id:
            # a later request of a model Redis knows nothing of means Redis lost the record.
            if stored is None and op.seq > 0:
                self.unsure[model] = None
            self.next[model] = stored or 0
        if op.seq < self.next[model] or op.seq in self.pending.get(model, {}):
            futures.fail(op.rid, f"request seq_id {op.seq} of {model} was already executed")
            return
        if model in self.unsure:
            first = self.unsure[model]
            self.unsure[model] = op.seq if first is None else min(first, op.seq)
        self.pending.setdefault(model, {})[op.seq] = op

    def data_lost(self) -> None:
        """Redis lost its data: write back every model's next seq_id, and let a model skip
        seq_ids lost with the stream."""
        for model, seq in self.next.items():
            futures.set_next_seq(model, seq)
            self.unsure[model] = None

    def drop(self, model: str) -> list[Op]:
        """Forget ``model``; returns its queued requests, for the caller to fail."""
        queued = list(self.pending.pop(model, {}).values())
        self.waiting_since.pop(model, None)
        self.gap_since.pop(model, None)
        self.next.pop(model, None)
        self.seen.pop(model, None)
        self.unsure.pop(model, None)
        return queued

    def queued(self) -> list[Op]:
        return [op for ops in self.pending.values() for op in ops.values()]

    def has_runnable(self) -> bool:
        return any(self.next.get(m, 0) in ops for m, ops in self.pending.items() if ops)

    def awaiting_others(self) -> bool:
        """Only forward/backwards are ready, and another active model has nothing queued:
        its next request is probably a few milliseconds away."""
        now = time.monotonic()
        ready = set()
        for model, ops in self.pending.items():
            first = ops.get(self.next.get(model, 0))
            if first is not None:
                if first.kind != "fwdbwd":
                    return False  # other work is ready: run it now
                ready.add(model)
        if not ready:
            return False
        for model, at in list(self.seen.items()):
            if now - at > ACTIVE_SECONDS:
                del self.seen[model]
            elif model not in ready and not self.pending.get(model):
                return True
        return False

    def take_ready(self) -> Ready:
        """Take every request that may run now out of the queue, advancing each model past
        them (past a single request once it ran)."""
        ready = Ready()
        for model in list(self.pending):
            ops = self.pending[model]
            seq = self.next.get(model, 0)
            # Requests refused at submission: their futures failed already.
            skipped = seq
            while seq in ops and ops[seq].kind == "skip":
                del ops[seq]
                seq += 1
            if seq != skipped:
                self.advance(model, seq)
            if seq not in ops:
                if ops:
                    self._check_gap(model)
                continue
            self.waiting_since.pop(model, None)
            self.gap_since.pop(model, None)
            first = ops[seq]
            if first.kind == "optim":
                # Optimizer steps of all models that are ready run as one update.
                ready.optims.append(ops.pop(seq))
                self.advance(model, seq + 1)
                continue
            if first.kind != "fwdbwd":
                del ops[seq]
                ready.singles.append(first)
                continue
            forward_only = bool(first.fields.get("forward_only"))
            # Consecutive chunks of one call (or calls) batch together.
            while (
                seq in ops
                and ops[seq].kind == "fwdbwd"
                and bool(ops[seq].fields.get("forward_only")) == forward_only
            ):
                ready.fwdbwd[forward_only].append(ops.pop(seq))
                seq += 1
            self.advance(model, seq)
        for model in [m for m, ops in self.pending.items() if not ops]:
            del self.pending[model]
        return ready

    def advance(self, model: str, seq: int) -> None:
        self.next[model] = seq
        futures.set_next_seq(model, seq)
        first = self.unsure.get(model)
        if first is not None and seq > first:
            del self.unsure[model]

    def _check_gap(self, model: str) -> None:
        """A seq_id that never arrives: skip it if its request was lost with a dead worker."""
        now = time.monotonic()
        since = self.waiting_since.setdefault(model, now)
        if now - self.gap_since.setdefault(model, now) >= self.gap_limit:
            self._give_up_gap(model)
            return
        if now - since < GAP_CHECK_SECONDS:
            return
        self.waiting_since[model] = now
        if model in self.unsure:
            self._skip_lost(model)
        seq = self.next[model]
        if seq in self.pending[model]:
            return
        rid = conf.get_redis().get(f"{futures.PREFIX}dedupe:seq:{model}:{seq}")
        if rid is None:
            return
        fut = futures.get(rid.decode())
        if fut is None or fut.get("status") in futures.FINAL:
            lost = True
        else:
            owner = fut.get("worker")
            lost = (
                fut.get("status") == futures.CLAIMED
                and owner != self.worker_id
                and not (owner and futures.worker_alive(owner))
            )
        if lost:
            futures.fail(rid.decode(), "the model worker executing this request stopped")
            self.advance(model, seq + 1)

    def _skip_lost(self, model: str) -> None:
        """Move past the seq_ids below the model's lowest queued request that nobody
        submitted since Redis lost its data: they were lost with it."""
        seq, first = self.next[model], min(self.pending[model])
        submitted = futures.submitted_seqs(model, range(max(seq, first - LOST_WINDOW), first))
        target = min(submitted, default=first)
        if target > seq:
            log.warning(
                "%s: seq_ids %d to %d were lost with Redis's data; running from %d",
                model,
                seq,
                target - 1,
                target,
            )
            self.advance(model, target)

    def _give_up_gap(self, model: str) -> None:
        """Fail what waits behind a seq_id that did not arrive in time, and move past it."""
        seq = self.next[model]
        waiting = self.pending.pop(model, {})
        for op in waiting.values():
            futures.fail(
                op.rid,
                f"request seq_id {op.seq} of {model} waited {self.gap_limit:.0f} s for seq_id "
                f"{seq}, which never arrived (the client numbered a request it did not send, "
                "e.g. a custom loss that raised); later requests of this model run again",
                "user",
            )
        self.waiting_since.pop(model, None)
        self.gap_since.pop(model, None)
        self.advance(model, max(waiting) + 1 if waiting else seq + 1)
