"""The model worker: one long-running task per base model that executes Tinker requests.

The task ``tinker_api.serve_base_model`` runs on a GPU worker inside a block leased from the
lock table. It loads the base model once (``training.Engine``) and serves every LoRA created on
it, reading requests from the Redis stream of its base model. Requests of one model run in
``seq_id`` order (a later one waits until the gap fills); forward/backward requests that are
ready at the same time, across models and chunks, run as ONE engine call through the
multi-LoRA path, each request keeping its own loss and metrics; every pending sample request
runs in one multi-adapter generation batch.

Results go to the request's future (``tinker_api.futures``). A worker heartbeats its lease
and its ``alive`` key; when it dies, polls of the futures it had claimed fail with a clear
error, and the next worker rebuilds each model from its last saved state.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
from celery import shared_task
from django.db import close_old_connections

from tinker_api import futures, wire
from workers import conf, control
from workers.locktable import GpuLockTable, Lease
from workers.tasks import LeaseKeeper

log = logging.getLogger(__name__)

# Tinker's LoRA scaling is alpha / rank with a fixed alpha.
LORA_ALPHA = 32.0
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# How long a model may wait on a missing seq_id before the worker checks whether that
# request was lost with a dead worker.
GAP_CHECK_SECONDS = 1.0
# Snapshots kept in memory per model, and sampler checkpoints loaded from disk per worker.
LIVE_SNAPSHOTS = 4
# How often a worker looks for sessions that stopped heartbeating.
REAP_SECONDS = 30.0
# How often the serve loop asks whether its Celery worker is shutting down, and how long it
# then keeps running the requests it has already read before it ends.
STOP_CHECK_SECONDS = 1.0
STOP_DRAIN_SECONDS = 10.0
LOADED_SAMPLERS = 16


def idle_seconds() -> int:
    """A worker with nothing to do for this long gives its GPU block back."""
    return conf._int_setting("OPENTINKER_TINKER_WORKER_IDLE_SECONDS", 600, minimum=1)


def session_timeout() -> int:
    """A session silent this long (the SDK heartbeats every 10 s) is over: its models go."""
    return conf._int_setting("OPENTINKER_TINKER_SESSION_TIMEOUT_SECONDS", 300, minimum=10)


def torch_threads() -> int:
    return conf._int_setting("OPENTINKER_TINKER_TORCH_THREADS", 2, minimum=1)


# A model that sent a request this recently is "active": a client in a training loop sends
# its next request a few milliseconds after its previous one is answered.
ACTIVE_SECONDS = 0.25


def gather_seconds(device: str) -> float:
    """How long a ready forward/backward waits for the next request of other active models
    that have nothing queued, so that it joins the same batched call (0: never wait). By
    default only on an accelerator: on a CPU a forward/backward costs its arithmetic, so
    four adapters batched cost what four calls cost, and the wait would be pure delay."""
    default = 0 if device == "cpu" else 3
    return conf._int_setting("OPENTINKER_TINKER_GATHER_MS", default, minimum=0) / 1000.0


class RequestError(Exception):
    """A request that cannot run: its future fails with ``category`` (``user`` by default)."""

    def __init__(self, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.category = category


@dataclass
class Op:
    """One request read from the stream."""

    fields: dict[str, Any]
    body: bytes | None = None

    @property
    def kind(self) -> str:
        return str(self.fields["op"])

    @property
    def rid(self) -> str:
        return str(self.fields["rid"])

    @property
    def model(self) -> str:
        return str(self.fields.get("model", ""))

    @property
    def seq(self) -> int:
        return int(self.fields.get("seq", 0))


def _fail_request(op: Op, exc: Exception, what: str) -> None:
    """End `op`'s future with `exc`: a `RequestError` as the caller's error (its category),
    anything else as a server error, logged with its traceback (call from the handler)."""
    if isinstance(exc, RequestError):
        futures.fail(op.rid, str(exc), exc.category)
        return
    log.exception("request %s (%s) failed", op.rid, what)
    futures.fail(op.rid, f"{type(exc).__name__}: {exc}", "server")


def target_modules(config: Mapping[str, Any], unembed: str | None = "lm_head") -> tuple[str, ...]:
    """LoRA targets of a model's ``lora_config``; ``unembed`` names the base model's output
    head (``train_unembed``: LoRA on the unembedding, as the SDK documents it)."""
    modules: tuple[str, ...] = ()
    if config.get("train_attn", True):
        modules += ATTN_MODULES
    if config.get("train_mlp", True):
        modules += MLP_MODULES
    if config.get("train_unembed", True):
        if unembed is None:
            raise RequestError("lora_config.train_unembed: this base model has no output head")
        modules += (unembed,)
    if not modules:
        raise RequestError("lora_config must train the attention, the MLP or the unembedding")
    return modules


def _stable_inputs(d: wire.WireDatum, i: int, team: str) -> dict[str, np.ndarray]:
    """StableReinforce's view of a datum: ``logprobs`` replaced on sampled positions by what
    the server recorded when it sampled them, and ``mask`` = the sampled positions (times a
    client mask), from the datum's ``loss_fn_input_spans``."""
    n = len(d.tokens)
    spans = d.loss_fn_input_spans or []
    if sum(sp.length for sp in spans) != n:
        raise RequestError(f"data[{i}].loss_fn_input_spans: lengths must add up to {n}")
    targets = d.loss_fn_inputs["target_tokens"]
    advantages = d.loss_fn_inputs["advantages"]
    logprobs = d.loss_fn_inputs["logprobs"].astype(np.float32).copy()
    mask = np.zeros(n, dtype=np.float32)
    pos = 0
    for sp in spans:
        if sp.kind == "sampled" and sp.length:
            rec = futures.stability(team, sp.sequence_id)
            if rec is None:
                raise RequestError(
                    f"data[{i}]: no stability info for sequence {sp.sequence_id!r} (unknown, "
                    "expired or sampled without record_stability_info=True)"
                )
            end = sp.offset + sp.length
            if end > len(rec["tokens"]):
                raise RequestError(
                    f"data[{i}]: span [{sp.offset}, {end}) of sequence {sp.sequence_id!r} "
                    f"exceeds its {len(rec['tokens'])} sampled tokens"
                )
            if list(targets[pos : pos + sp.length]) != rec["tokens"][sp.offset : end]:
                raise RequestError(
                    f"data[{i}]: targets at positions {pos}..{pos + sp.length - 1} are not the "
                    f"tokens sequence {sp.sequence_id!r} sampled there"
                )
            logprobs[pos : pos + sp.length] = rec["logprobs"][sp.offset : end]
            mask[pos : pos + sp.length] = 1.0
        pos += sp.length
    if np.any((advantages != 0) & (mask == 0)):
        raise RequestError(
            f"data[{i}]: stable_reinforce accepts nonzero advantages only on sampled tokens "
            "(positions its loss_fn_input_spans name as SampledProvenanceSpan)"
        )
    if "mask" in d.loss_fn_inputs:
        mask = mask * d.loss_fn_inputs["mask"].astype(np.float32)
    return {**d.loss_fn_inputs, "logprobs": logprobs, "mask": mask}


def _datums(batch: wire.ForwardBackwardBatch, team: str = "") -> list[Any]:
    import torch

    from training.types import Datum

    out = []
    for i, d in enumerate(batch.data):
        inputs = {}
        raw = d.loss_fn_inputs
        if batch.loss_fn == "stable_reinforce":
            raw = _stable_inputs(d, i, team)
        for name, arr in raw.items():
            if arr.ndim != 1:
                raise RequestError(
                    f"data[{i}].loss_fn_inputs[{name!r}]: only one value per position is "
                    f"supported, got shape {list(arr.shape)}"
                )
            inputs[name] = torch.from_numpy(np.ascontiguousarray(arr))
        try:
            out.append(
                Datum(model_input=torch.tensor(d.tokens, dtype=torch.long), loss_fn_inputs=inputs)
            )
        except ValueError as exc:
            raise RequestError(f"data[{i}]: {exc}") from exc
    return out


def _pad_inputs(datums: list[Any]) -> None:
    """Give every datum the same loss input names (zeros where absent): one engine call
    collates them together, and each request's loss reads only its own names."""
    import torch

    names = set().union(*(d.loss_fn_inputs for d in datums))
    for d in datums:
        for name in names - set(d.loss_fn_inputs):
            dtype = torch.long if name == "target_tokens" else torch.float32
            # An absent mask means "every token counts": a batch mate's mask must not
            # zero this datum's loss.
            fill = torch.ones if name == "mask" else torch.zeros
            d.loss_fn_inputs[name] = fill(d.length, dtype=dtype)


class ModelWorker:
    """Serves every model of one base model from one ``Engine``."""

    def __init__(self, base: str, base_path: str, device: str, worker_id: str) -> None:
        import torch

        from training.engine import Engine

        if device == "cpu":
            torch.set_num_threads(torch_threads())
        self.base = base
        self.worker_id = worker_id
        self.engine = Engine(base_path, device=device)
        self.policies: dict[str, Any] = {}
        self.next: dict[str, int] = {}
        self.pending: dict[str, dict[int, Op]] = {}
        self.waiting_since: dict[str, float] = {}
        self.samples: list[Op] = []
        # When each model last sent a request (monotonic), for the gather window.
        self.seen: dict[str, float] = {}
        self.gather = gather_seconds(device)
        # Sampler checkpoints: snapshots this worker made (checkpoint pk -> policy, version),
        # and those loaded from disk (file -> host key), oldest first.
        self.snapshots: dict[int, tuple[Any, int]] = {}
        self.loaded_samplers: dict[str, str] = {}
        self.last_activity = time.monotonic()
        self.stopping = threading.Event()

    # ---------------------------------------------------------------- reading

    def read(self, block_ms: int) -> int:
        r = conf.get_redis()
        got = r.xreadgroup(
            futures.GROUP,
            self.worker_id,
            {futures.stream_key(self.base): ">"},
            count=512,
            block=block_ms or None,
        )
        ops: list[Op] = []
        claims: list[tuple[Any, str]] = []
        for _stream, entries in got or []:
            for entry_id, raw in entries:
                fields = {k.decode(): v for k, v in raw.items()}
                op = Op(
                    fields=json.loads(fields["op"]),
                    body=fields.get("body"),
                )
                ops.append(op)
                claims.append((entry_id, op.rid))
        futures.claim_entries(self.base, self.worker_id, claims)
        for op in ops:
            self._accept(op)
        if ops:
            self.last_activity = time.monotonic()
        return len(ops)

    def _accept(self, op: Op) -> None:
        if op.kind == "sample":
            self.samples.append(op)
            return
        if op.kind == "close":
            self._close(op)
            return
        model = op.model
        self.seen[model] = time.monotonic()
        if model not in self.next:
            self.next[model] = futures.next_seq(model)
        if op.seq < self.next[model] or op.seq in self.pending.get(model, {}):
            futures.fail(op.rid, f"request seq_id {op.seq} of {model} was already executed")
            return
        self.pending.setdefault(model, {})[op.seq] = op

    def _close(self, op: Op) -> None:
        self.close_models(op.fields["models"], "has finished")
        futures.complete(op.rid, json_body=b"{}")

    def close_models(self, models: list[str], why: str) -> None:
        """The session of these models ended: drop their queued work (a seq_id gap left by
        a failed client-side custom loss ends here too) and free their weights."""
        for model in models:
            for queued in self.pending.pop(model, {}).values():
                futures.fail(queued.rid, f"the session of {model} {why}", "user")
            self.waiting_since.pop(model, None)
            self.next.pop(model, None)
            self.seen.pop(model, None)
            policy = self.policies.pop(model, None)
            if policy is not None:
                self.engine.remove_policy(model)
                self.snapshots = {k: v for k, v in self.snapshots.items() if v[0] is not policy}

    def reap_sessions(self) -> list[str]:
        """End the sessions of this worker's models that stopped heartbeating (their client
        is gone) and close those models; returns the closed model ids."""
        from django.utils import timezone

        from tinker_api.models import TinkerSession, TrainingModel

        held = set(self.policies) | set(self.pending)
        if not held:
            return []
        close_old_connections()
        cutoff = timezone.now() - timedelta(seconds=session_timeout())
        rows = TrainingModel.objects.filter(pk__in=held).values_list(
            "id", "session_id", "session__last_heartbeat", "session__finished_at"
        )
        silent = {sid for _m, sid, beat, done in rows if done is None and beat < cutoff}
        TinkerSession.objects.filter(pk__in=silent, finished_at__isnull=True).update(
            finished_at=timezone.now(),
            finish_reason="interrupted",
            finish_detail="no heartbeat",
        )
        gone = [m for m, sid, _beat, done in rows if done is not None or sid in silent]
        self.close_models(gone, "stopped heartbeating")
        return gone

    def has_runnable(self) -> bool:
        if self.samples:
            return True
        return any(self.next.get(m, 0) in ops for m, ops in self.pending.items() if ops)

    # ---------------------------------------------------------------- scheduling

    def gather_batch(self) -> None:
        """Hold a ready forward/backward for up to ``gather_seconds()`` while other active
        models have nothing queued: their next request (a client a few milliseconds behind)
        then runs in the same batched call instead of waiting for this one to finish."""
        if self.gather <= 0:
            return
        deadline = time.monotonic() + self.gather
        while self._awaiting_others():
            left = deadline - time.monotonic()
            if left <= 0 or not self.read(max(1, round(left * 1000))):
                return

    def _awaiting_others(self) -> bool:
        if self.samples:
            return False
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

    def step(self) -> bool:
        """Run what is ready; True if anything ran."""
        progressed = False
        if self.samples:
            batch, self.samples = self.samples, []
            self._run_samples(batch)
            progressed = True
        fwdbwd: dict[bool, list[Op]] = {False: [], True: []}
        optims: list[Op] = []
        for model in list(self.pending):
            ops = self.pending[model]
            seq = self.next.get(model, 0)
            if seq not in ops:
                if ops:
                    self._check_gap(model)
                continue
            self.waiting_since.pop(model, None)
            first = ops[seq]
            if first.kind == "optim":
                # Optimizer steps of all models that are ready run as one update.
                optims.append(ops.pop(seq))
                self._advance(model, seq + 1)
                continue
            if first.kind != "fwdbwd":
                del ops[seq]
                self._run_single(first)
                self._advance(model, seq + 1)
                progressed = True
                continue
            forward_only = bool(first.fields.get("forward_only"))
            # Consecutive chunks of one call (or calls) batch together.
            while (
                seq in ops
                and ops[seq].kind == "fwdbwd"
                and bool(ops[seq].fields.get("forward_only")) == forward_only
            ):
                fwdbwd[forward_only].append(ops.pop(seq))
                seq += 1
            self._advance(model, seq)
        if optims:
            self._run_optims(optims)
            progressed = True
        for forward_only, ops_list in fwdbwd.items():
            if ops_list:
                self._run_fwdbwd(ops_list, forward_only)
                progressed = True
        for model in [m for m, ops in self.pending.items() if not ops]:
            del self.pending[model]
        if progressed:
            self.last_activity = time.monotonic()
        return progressed

    def _advance(self, model: str, seq: int) -> None:
        self.next[model] = seq
        futures.set_next_seq(model, seq)

    def _check_gap(self, model: str) -> None:
        """A seq_id that never arrives: skip it if its request was lost with a dead worker."""
        now = time.monotonic()
        since = self.waiting_since.setdefault(model, now)
        if now - since < GAP_CHECK_SECONDS:
            return
        self.waiting_since[model] = now
        seq = self.next[model]
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
            self._advance(model, seq + 1)

    # ---------------------------------------------------------------- models

    def _policy(self, model_id: str) -> Any:
        policy = self.policies.get(model_id)
        if policy is None:
            # This worker has not seen the model: it was served by a worker that stopped.
            # Rebuild it from its last saved state (what a dead worker loses is documented).
            policy = self._rebuild(model_id)
        return policy

    def _row(self, model_id: str) -> Any:
        from tinker_api.models import TrainingModel

        row = TrainingModel.objects.filter(pk=model_id).first()
        if row is None:
            raise RequestError(f"unknown model {model_id}")
        return row

    def _new_policy(self, model_id: str, config: Mapping[str, Any]) -> Any:
        from training.lora import output_layer_name

        if model_id in self.policies:
            self.engine.remove_policy(model_id)
            del self.policies[model_id]
        try:
            policy = self.engine.create_policy(
                rank=int(config["rank"]),
                alpha=LORA_ALPHA,
                target_modules=target_modules(config, output_layer_name(self.engine.model)),
                seed=int(config.get("seed") or 0),
                policy_id=model_id,
            )
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        self.policies[model_id] = policy
        return policy

    def _rebuild(self, model_id: str) -> Any:
        from tinker_api.models import Checkpoint

        row = self._row(model_id)
        policy = self._new_policy(model_id, row.worker_config())
        last = (
            # Only states whose file was written (a save the dead worker never ran has none).
            Checkpoint.objects.filter(
                model_id=model_id, kind=Checkpoint.Kind.TRAINING, size_bytes__isnull=False
            )
            .order_by("-created")
            .first()
        )
        source = str(last.file_path()) if last is not None else row.init_checkpoint
        if source:
            policy.load_state(source)
        log.warning("model %s rebuilt from %s", model_id, source or "its initial weights")
        return policy

    # ---------------------------------------------------------------- single requests

    def _run_single(self, op: Op) -> None:
        # A worker lives for hours: never run a query on a connection the server dropped.
        close_old_connections()
        try:
            handler: Callable[[Op], dict[str, Any]] = getattr(self, f"_op_{op.kind}")
            body = handler(op)
        except Exception as exc:  # noqa: BLE001 - reported by _fail_request
            _fail_request(op, exc, op.kind)
            return
        futures.complete(op.rid, json_body=json.dumps(body).encode())

    def _op_create(self, op: Op) -> dict[str, Any]:
        f = op.fields
        policy = self._new_policy(op.model, f["config"])
        if f.get("init"):
            self._load(policy, f["init"], optimizer=bool(f.get("optimizer")))
        return (
            {"type": "create_model", "model_id": op.model}
            if not f.get("init")
            else {
                "type": "load_weights",
                "model_id": op.model,
                "path": f.get("path"),
            }
        )

    def _load(self, policy: Any, file: str, *, optimizer: bool) -> None:
        if not Path(file).is_file():
            raise RequestError("the checkpoint's file is gone (deleted or expired)")
        try:
            policy.load_state(file)
        except ValueError as exc:
            raise RequestError(f"cannot load this checkpoint into the model: {exc}") from exc
        if not optimizer:
            # Weights only: the optimizer starts afresh, as a new model's would.
            policy.optimizer.state.clear()

    def _op_load(self, op: Op) -> dict[str, Any]:
        self._load(
            self._policy(op.model), op.fields["file"], optimizer=bool(op.fields["optimizer"])
        )
        return {"type": "load_weights", "path": op.fields.get("path")}

    def _run_optims(self, ops: list[Op]) -> None:
        """Optimizer steps of several models in one batched update (``optim_steps``); each
        request keeps its own hyperparameters, outcome and metrics."""
        from training.ops import optim_steps
        from training.types import AdamParams

        close_old_connections()
        ready: list[tuple[Op, Any, Any]] = []
        for op in ops:
            try:
                try:
                    adam = AdamParams(**op.fields["adam"])
                except (TypeError, ValueError) as exc:
                    raise RequestError(f"adam_params: {exc}") from exc
                ready.append((op, self._policy(op.model), adam))
            except Exception as exc:  # noqa: BLE001 - reported by _fail_request
                _fail_request(op, exc, "optim")
        if not ready:
            return
        try:
            results = optim_steps([p for _op, p, _a in ready], [a for _op, _p, a in ready])
        except Exception as exc:
            log.exception("optimizer step of %d models failed", len(ready))
            for op, _policy, _adam in ready:
                futures.fail(op.rid, f"{type(exc).__name__}: {exc}", "server")
            return
        for (op, _policy, _adam), metrics in zip(ready, results, strict=True):
            body = {"metrics": {f"optim/{k}:mean": float(v) for k, v in metrics.items()}}
            futures.complete(op.rid, json_body=json.dumps(body).encode())

    def _op_save_state(self, op: Op) -> dict[str, Any]:
        from tinker_api.models import Checkpoint

        policy = self._policy(op.model)
        ckpt = Checkpoint.objects.get(pk=op.fields["checkpoint"])
        path = ckpt.file_path()
        policy.save_state(path)
        Checkpoint.objects.filter(pk=ckpt.pk).update(
            size_bytes=path.stat().st_size, step=policy.step
        )
        return {"type": "save_weights", "path": ckpt.tinker_path}

    def _op_save_sampler(self, op: Op) -> dict[str, Any]:
        from tinker_api.models import Checkpoint, SamplingSession
        from tinker_api.services import INFLIGHT_PREFIX

        policy = self._policy(op.model)
        ckpt = Checkpoint.objects.get(pk=op.fields["checkpoint"])
        version = policy.snapshot()
        self._keep_snapshot(ckpt.pk, policy, version)
        out = policy.export_peft(version, ckpt.file_path())
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        Checkpoint.objects.filter(pk=ckpt.pk).update(
            size_bytes=size, step=policy.step, version=version
        )
        session_id = op.fields.get("sampling_session_id")
        if session_id:
            SamplingSession.objects.filter(pk=session_id).update(checkpoint=ckpt)
            if ckpt.name.startswith(INFLIGHT_PREFIX):
                # The inflight contract: a later inflight save reaches the clients of the
                # earlier ones too (their next samples run on these weights).
                SamplingSession.objects.filter(
                    checkpoint__model_id=op.model, checkpoint__name__startswith=INFLIGHT_PREFIX
                ).update(checkpoint=ckpt, model_path=ckpt.tinker_path)
            return {"type": "save_weights_for_sampler", "sampling_session_id": session_id}
        return {"type": "save_weights_for_sampler", "path": ckpt.tinker_path}

    # ---------------------------------------------------------------- forward/backward

    def _run_fwdbwd(self, ops: list[Op], forward_only: bool) -> None:
        prepared = []
        for op in ops:
            try:
                batch = wire.decode_forward_backward(
                    op.body or b"",
                    content_type=op.fields.get("ctype"),
                    forward_only=forward_only,
                )
                team = ""
                if batch.loss_fn == "stable_reinforce":
                    team = str((futures.get(op.rid) or {}).get("team", ""))
                datums = _datums(batch, team)
                policy = self._policy(op.model)
                prepared.append((op, batch, datums, policy))
            except Exception as exc:  # noqa: BLE001 - reported by _fail_request
                _fail_request(op, exc, "forward/backward")
        if not prepared:
            return
        try:
            results = self._fwdbwd_call(prepared, forward_only)
        except Exception:  # noqa: BLE001 - attributed per request below
            # One request's bad input must not fail its batch mates: run each alone to find
            # which one it was. Nothing was accumulated: the loss failed before backward.
            log.info(
                "a batched forward/backward failed; running its %d requests alone", len(prepared)
            )
            for item in prepared:
                self._fwdbwd_alone(item, forward_only)
            return
        for item, (outputs, metrics) in zip(prepared, results, strict=True):
            self._complete_fwdbwd(item[0], outputs, metrics)

    def _fwdbwd_alone(
        self, item: tuple[Op, wire.ForwardBackwardBatch, list[Any], Any], forward_only: bool
    ) -> None:
        try:
            ((outputs, metrics),) = self._fwdbwd_call([item], forward_only)
        except (ValueError, RequestError) as exc:
            futures.fail(item[0].rid, f"{type(exc).__name__}: {exc}", "user")
            return
        except Exception as exc:
            log.exception("request %s failed", item[0].rid)
            futures.fail(item[0].rid, f"{type(exc).__name__}: {exc}", "server")
            return
        self._complete_fwdbwd(item[0], outputs, metrics)

    def _fwdbwd_call(
        self,
        prepared: list[tuple[Op, wire.ForwardBackwardBatch, list[Any], Any]],
        forward_only: bool,
    ) -> list[tuple[list[dict[str, Any]], dict[str, float]]]:
        from training import ops as engine_ops
        from training.losses import LossBatch, get_loss

        all_datums: list[Any] = []
        policies: list[Any] = []
        groups: list[tuple[list[int], Any, dict[str, Any]]] = []
        for _op, batch, datums, policy in prepared:
            if batch.loss_fn == "custom":
                raise RequestError("loss_fn 'custom' runs on the client (forward_backward_custom)")
            rows = list(range(len(all_datums), len(all_datums) + len(datums)))
            groups.append((rows, get_loss(batch.loss_fn), dict(batch.loss_fn_config or {})))
            all_datums.extend(datums)
            policies.extend([policy] * len(datums))
        _pad_inputs(all_datums)
        per_request: list[dict[str, float]] = []

        def grouped_loss(lb: LossBatch, _config: Mapping[str, float]) -> tuple[Any, dict[str, Any]]:
            total = None
            for rows, fn, config in groups:
                # A request's rows are contiguous: its loss sees a view of the batch.
                part = slice(rows[0], rows[-1] + 1)
                sub = LossBatch(
                    lb.logprobs[part], {k: v[part] for k, v in lb.inputs.items()}, lb.mask[part]
                )
                loss, metrics = fn(sub, config)
                values = {k: float(v.detach()) for k, v in metrics.items()}
                values.setdefault("loss:sum", float(loss.detach()))
                per_request.append(values)
                total = loss if total is None else total + loss
            assert total is not None
            return total, {}

        run = engine_ops.forward if forward_only else engine_ops.forward_backward
        result = run(policies, all_datums, grouped_loss)
        out = []
        for (rows, _fn, _config), metrics in zip(groups, per_request, strict=True):
            outputs = [{"logprobs": result.logprobs[i].float()} for i in rows]
            out.append((outputs, metrics))
        return out

    def _complete_fwdbwd(
        self, op: Op, outputs: list[dict[str, Any]], metrics: dict[str, float]
    ) -> None:
        proto = wire.encode_forward_backward_output(outputs, metrics, protobuf=True)
        plain = wire.encode_forward_backward_output(outputs, metrics, protobuf=False)
        futures.complete(op.rid, json_body=plain.content, proto_body=proto.content)

    def _keep_snapshot(self, checkpoint_pk: int, policy: Any, version: int) -> None:
        """Serve a sampler checkpoint from its in-memory snapshot; the oldest snapshots of a
        policy beyond ``LIVE_SNAPSHOTS`` are dropped (their files still serve them)."""
        self.snapshots[checkpoint_pk] = (policy, version)
        mine = sorted(pk for pk, (p, _v) in self.snapshots.items() if p is policy)
        for pk in mine[:-LIVE_SNAPSHOTS]:
            old_policy, old_version = self.snapshots.pop(pk)
            if old_version in old_policy.versions:
                old_policy.release(old_version)

    # ---------------------------------------------------------------- sampling

    def _sampler_key(self, target: Mapping[str, Any]) -> str | None:
        """The host adapter key that samples ``target``: None for the base model, a live
        snapshot this worker made, else the sampler checkpoint loaded from disk."""
        if not target.get("model"):
            return None
        live = self.snapshots.get(int(target["checkpoint"]))
        if live is not None:
            policy, version = live
            # A rebuilt model is a new policy object: its old snapshots are gone.
            if self.policies.get(target["model"]) is policy and version in policy.versions:
                return str(policy.version_key(version))
        file = target.get("file")
        if not file:
            raise RequestError("the sampler weights are not ready yet")
        key = self.loaded_samplers.get(file)
        if key is None:
            key = self._load_sampler(file, target)
        return key

    def _load_sampler(self, file: str, target: Mapping[str, Any]) -> str:
        from safetensors.torch import load_file

        directory = Path(file)
        weights_file = directory / "adapter_model.safetensors"
        if not weights_file.is_file():
            raise RequestError("the sampler checkpoint's files are gone (deleted or expired)")
        tensors = load_file(str(weights_file), device=str(self.engine.device))
        weights: dict[str, tuple[Any, Any]] = {}
        for name, tensor in tensors.items():
            if not name.endswith(".lora_A.weight"):
                continue
            module = name[len("base_model.model.") : -len(".lora_A.weight")]
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            weights[module] = (tensor, b)
        key = f"sampler:{uuid.uuid4().hex[:12]}"
        self.engine.host.register(key, weights, LORA_ALPHA / int(target["rank"]), frozen=True)
        self.loaded_samplers[file] = key
        while len(self.loaded_samplers) > LOADED_SAMPLERS:
            oldest = next(iter(self.loaded_samplers))
            self.engine.host.unregister(self.loaded_samplers.pop(oldest))
        return key

    def _run_samples(self, ops: list[Op]) -> None:
        from training.sampler import generate
        from training.types import SamplingParams

        rows_prompts: list[list[int]] = []
        rows_params: list[Any] = []
        rows_keys: list[str | None] = []
        rows_index: list[int] = []
        rows_eos: list[bool] = []
        rows_topk: list[int] = []
        owners: list[tuple[Op, list[int], str | None, list[int]]] = []
        try:
            for op in ops:
                f = op.fields
                try:
                    key = self._sampler_key(f["target"])
                    sp = f["params"]
                    params = SamplingParams(
                        max_tokens=int(sp["max_tokens"]),
                        temperature=float(sp["temperature"]),
                        top_p=float(sp["top_p"]),
                        top_k=max(0, int(sp["top_k"])),
                        seed=sp.get("seed"),
                        stop=tuple(sp.get("stop_strings") or ()),
                        stop_token_ids=tuple(sp.get("stop_ids") or ()),
                    )
                    prompt = [int(t) for t in f["prompt"]]
                    self._check_vocabulary(prompt, f.get("targets"))
                except (RequestError, ValueError, KeyError) as exc:
                    futures.fail(op.rid, str(exc), "user")
                    continue
                rows = []
                for j in range(int(f["n"])):
                    rows.append(len(rows_prompts))
                    rows_prompts.append(prompt)
                    rows_params.append(params)
                    rows_keys.append(key)
                    rows_index.append(j)
                    rows_eos.append(bool(sp.get("stop_on_eos", True)))
                    rows_topk.append(int(sp.get("topk") or 0))
                owners.append((op, rows, key, prompt))
            if not owners:
                return
            try:
                seqs = generate(
                    self.engine.model,
                    self.engine.tokenizer,
                    rows_prompts,
                    rows_params,
                    adapters=rows_keys,
                    host=self.engine.host,
                    sample_indices=rows_index,
                    stop_on_eos=rows_eos,
                    topk_logprobs=rows_topk,
                )
                scored = self._score_prompts(owners)
            except Exception as exc:
                log.exception("sampling batch failed")
                for op, *_ in owners:
                    futures.fail(op.rid, f"{type(exc).__name__}: {exc}", "server")
                return
            for op, rows, _key, _prompt in owners:
                if op.fields.get("record"):
                    team = str((futures.get(op.rid) or {}).get("team", ""))
                    for j, i in enumerate(rows):
                        futures.record_stability(
                            team, f"{op.rid}:{j}", list(seqs[i].tokens), list(seqs[i].logprobs)
                        )
                out = [
                    wire.SampledSequenceOut(
                        tokens=seqs[i].tokens,
                        stop_reason=seqs[i].stop_reason,
                        logprobs=seqs[i].logprobs,
                        topk_logprobs=seqs[i].topk_logprobs,
                    )
                    for i in rows
                ]
                extra = scored.get(id(op), {})
                proto = wire.encode_sample_response(out, protobuf=True, **extra)
                plain = wire.encode_sample_response(out, protobuf=False, **extra)
                futures.complete(op.rid, json_body=plain.content, proto_body=proto.content)
        finally:
            futures.samples_answered(self.base, len(ops))

    def _check_vocabulary(self, prompt: list[int], targets: list[list[int]] | None) -> None:
        """Token ids beyond the vocabulary fail their own request, not the whole batch."""
        vocab = int(self.engine.model.config.vocab_size)
        for where, ids in (("prompt", prompt), ("target_prompt_logprobs", targets or [])):
            flat = np.asarray(ids, dtype=np.int64).reshape(-1)
            if flat.size and int(flat.max()) >= vocab:
                raise RequestError(
                    f"{where}: token id {int(flat.max())} is outside the vocabulary [0, {vocab})"
                )

    def _score_prompts(
        self, owners: list[tuple[Op, list[int], str | None, list[int]]]
    ) -> dict[int, dict[str, Any]]:
        """One forward over the prompts of the requests that ask for prompt logprobs, top-k
        prompt logprobs, target logprobs or alternative draws; per request (by ``id(op)``),
        the keyword arguments of ``wire.encode_sample_response``."""
        import torch

        from training.sampler import PromptScoring, score_prompts

        wants: list[tuple[Op, wire.PromptTargets | None]] = []
        scorings: list[PromptScoring] = []
        for op, _rows, key, prompt in owners:
            f = op.fields
            targets = None
            if f.get("targets") is not None:
                csr = f.get("targets_csr")
                targets = wire.PromptTargets(
                    ids=np.asarray(f["targets"], dtype=np.int64).reshape(len(prompt) - 1, -1),
                    csr=None if csr is None else (list(csr[0]), list(csr[1])),
                )
            scoring = PromptScoring(
                tokens=prompt,
                adapter=key,
                logprobs=bool(f.get("prompt_logprobs")),
                topk=int(f.get("topk_prompt") or 0),
                last_n=f.get("last_n"),
                targets=None if targets is None else torch.from_numpy(targets.ids),
                alt_k=int(f.get("alt_k") or 0),
                temperature=float(f["params"]["temperature"]),
                seed=f["params"].get("seed"),
            )
            if scoring.logprobs or scoring.topk or scoring.alt_k or targets is not None:
                wants.append((op, targets))
                scorings.append(scoring)
        if not scorings:
            return {}
        results = score_prompts(self.engine.model, scorings, host=self.engine.host)
        out: dict[int, dict[str, Any]] = {}
        for (op, targets), scoring, res in zip(wants, scorings, results, strict=True):
            extra: dict[str, Any] = {}
            if scoring.logprobs:
                extra["prompt_logprobs"] = res.logprobs
            if scoring.topk:
                extra["topk_prompt_logprobs"] = res.topk
            if targets is not None and res.target_logprobs is not None:
                data, csr = targets.answer(res.target_logprobs.numpy())
                extra["target_prompt_logprobs"] = wire.TensorOut(
                    data=data, shape=list(targets.ids.shape), csr=csr
                )
            if res.alt_tokens is not None and res.alt_logprobs is not None:
                shape = list(res.alt_tokens.shape)
                extra["prompt_alt_tokens"] = (
                    wire.TensorOut(data=res.alt_tokens.numpy().astype(np.int64), shape=shape),
                    wire.TensorOut(data=res.alt_logprobs.numpy().astype(np.float32), shape=shape),
                )
            out[id(op)] = extra
        return out

    # ---------------------------------------------------------------- shutdown

    def fail_everything(self, reason: str) -> None:
        for ops in self.pending.values():
            for op in ops.values():
                futures.fail(op.rid, reason)
        for op in self.samples:
            futures.fail(op.rid, reason)
        futures.samples_answered(self.base, len(self.samples))
        self.pending.clear()
        self.samples = []

    def drain(self, seconds: float) -> None:
        """Run what has been read and is runnable, for at most ``seconds``; requests still in
        the stream stay there for the next worker of this base model."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.has_runnable() and self.step():
            pass

    def serve(self) -> str:
        """Run until idle for ``idle_seconds()`` or stopped; returns why it ended."""
        idle = idle_seconds()
        next_reap = time.monotonic() + REAP_SECONDS
        next_stop_check = time.monotonic() + STOP_CHECK_SECONDS
        while not self.stopping.is_set():
            if time.monotonic() > next_reap:
                next_reap = time.monotonic() + REAP_SECONDS
                self.reap_sessions()
            if time.monotonic() > next_stop_check:
                next_stop_check = time.monotonic() + STOP_CHECK_SECONDS
                if control.is_stopping():
                    self.drain(STOP_DRAIN_SECONDS)
                    return "shutdown"
            self.read(0 if self.has_runnable() else 200)
            self.gather_batch()
            if self.step():
                continue
            quiet = not self.pending and not self.samples
            if quiet and time.monotonic() - self.last_activity > idle:
                return "idle"
        return "stopped"


class Heartbeat(LeaseKeeper):
    """Renews the lease and the worker's registration every heartbeat interval."""

    def __init__(
        self,
        table: GpuLockTable,
        lease: Lease,
        base: str,
        worker_id: str,
        on_lost: Callable[[], None],
    ) -> None:
        super().__init__(table, lease, on_lost)
        self.name = f"tinker-worker-{base}"
        self.base, self.worker_id = base, worker_id

    def still_held(self) -> bool:
        return super().still_held() and futures.register_worker(
            self.base, self.worker_id, conf.lease_seconds()
        )


@shared_task(name="tinker_api.serve_base_model", ignore_result=True)
def serve_base_model(
    base: str, *, base_path: str, node: str, gpus: list[int], lease_job_id: str, lease_token: str
) -> str:
    """Serve the Tinker requests of one base model on the leased block until idle."""
    from workers.tasks import _devices

    table = GpuLockTable(conf.get_redis())
    lease = Lease(job_id=lease_job_id, node=node, gpus=tuple(gpus), token=lease_token)
    worker_id = f"{node}:{uuid.uuid4().hex[:12]}"
    try:
        if table.renew(lease, conf.lease_seconds(), start=True) is None:
            return "lease-lost"
        if not futures.register_worker(base, worker_id, conf.lease_seconds()):
            table.release(lease)
            return "another-worker"
    finally:
        futures.clear_starting(base)
    worker: ModelWorker | None = None
    heartbeat = Heartbeat(table, lease, base, worker_id, on_lost=lambda: None)
    heartbeat.start()
    outcome = "failed"
    try:
        worker = ModelWorker(base, base_path, _devices(table, node, gpus)[0], worker_id)
        heartbeat.on_lost = worker.stopping.set
        outcome = worker.serve()
    except Exception as exc:
        log.exception("model worker for %s failed", base)
        outcome = f"failed: {exc}"
    finally:
        heartbeat.stop()
        futures.unregister_worker(base, worker_id)
        if worker is not None:
            worker.fail_everything(f"the model worker for {base} stopped ({outcome})")
        else:
            drain_failed(base, worker_id, f"the model worker for {base} could not start: {outcome}")
        table.release(lease)
        log.info("model worker %s for %s ended: %s", worker_id, base, outcome)
    return outcome


def drain_failed(base: str, worker_id: str, reason: str) -> None:
    """Fail every request queued for ``base``: a worker that cannot load the base model must
    not leave clients polling futures nobody will run."""
    r = conf.get_redis()
    while True:
        got = r.xreadgroup(futures.GROUP, worker_id, {futures.stream_key(base): ">"}, count=512)
        entries = [e for _s, batch in got or [] for e in batch]
        if not entries:
            return
        for entry_id, raw in entries:
            op = json.loads(raw[b"op"])
            futures.fail(str(op["rid"]), reason)
            if op.get("op") == "sample":
                futures.samples_answered(base, 1)
            r.xack(futures.stream_key(base), futures.GROUP, entry_id)
