"""The training requests of the model worker: create, load, save, optimizer steps and
forward/backward, the last two batched across models into one engine call."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from django.db import close_old_connections

from tinker_api import futures, wire
from tinker_api.models import Checkpoint
from tinker_api.services import checkpoints
from tinker_api.worker import exports
from tinker_api.worker.datums import expand_images, pad_inputs, to_datums
from tinker_api.worker.policies import Policies
from tinker_api.worker.requests import Op, RequestError, fail_request
from tinker_api.worker.sampler_cache import SamplerCache
from training import ops as engine_ops
from training.losses import LossBatch, get_loss
from training.policy import Policy
from training.types import AdamParams, Datum

log = logging.getLogger(__name__)

Prepared = tuple[Op, wire.ForwardBackwardBatch, list[Datum], Policy]


def strict_json(body: Any) -> bytes:
    """``body`` as JSON that strict parsers read: a NaN or infinity (which Python's json
    writes bare, and the SDK's parser refuses) becomes null."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(body), allow_nan=False).encode()


def optim_reply(metrics: dict[str, float]) -> bytes:
    """An optimizer step's answer. A metric that is not finite (the gradient norm of a step
    skipped for a non-finite gradient) is left out: the SDK reads metrics as numbers, and
    ``optim/skipped:mean`` says what happened."""
    out = {f"optim/{k}:mean": float(v) for k, v in metrics.items() if math.isfinite(float(v))}
    return strict_json({"metrics": out})


class TrainingHandlers:
    def __init__(self, policies: Policies, samplers: SamplerCache) -> None:
        self.policies = policies
        self.samplers = samplers

    def run_single(self, op: Op) -> None:
        # A worker lives for hours: never run a query on a connection the server dropped.
        close_old_connections()
        try:
            handler: Callable[[Op], dict[str, Any]] = getattr(self, f"_op_{op.kind}")
            body = handler(op)
        except Exception as exc:  # every failure is reported, by fail_request
            fail_request(op, exc, op.kind)
            return
        futures.complete(op.rid, json_body=strict_json(body))

    def _op_create(self, op: Op) -> dict[str, Any]:
        f = op.fields
        policy = self.policies.new(op.model, f["config"])
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

    def _load(self, policy: Policy, file: str, *, optimizer: bool) -> None:
        if not Path(file).is_file():
            raise RequestError("the checkpoint's file is gone (deleted or expired)")
        try:
            policy.load_state(file)
        except ValueError as exc:
            raise RequestError(f"cannot load this checkpoint into the model: {exc}") from exc
        if not optimizer:
            # Weights only starts a new run (the SDK: "optimizer resets"): Adam's moments and
            # the step count begin again, as a new model's would.
            policy.optimizer.state.clear()
            policy.step = 0

    def _op_load(self, op: Op) -> dict[str, Any]:
        self._load(
            self.policies.serving(op.model),
            op.fields["file"],
            optimizer=bool(op.fields["optimizer"]),
        )
        return {"type": "load_weights", "path": op.fields.get("path")}

    def run_optims(self, ops: list[Op]) -> None:
        """Optimizer steps of several models in one batched update (``optim_steps``); each
        request keeps its own hyperparameters, outcome and metrics."""
        close_old_connections()
        ready: list[tuple[Op, Policy, AdamParams]] = []
        for op in ops:
            try:
                try:
                    adam = AdamParams(**op.fields["adam"])
                except (TypeError, ValueError) as exc:
                    raise RequestError(f"adam_params: {exc}") from exc
                ready.append((op, self.policies.serving(op.model), adam))
            except Exception as exc:  # every failure is reported, by fail_request
                fail_request(op, exc, "optim")
        if not ready:
            return
        try:
            results = engine_ops.optim_steps(
                [p for _op, p, _a in ready], [a for _op, _p, a in ready]
            )
        except Exception as exc:
            log.exception("optimizer step of %d models failed", len(ready))
            for op, _policy, _adam in ready:
                futures.fail(op.rid, f"{type(exc).__name__}: {exc}", "server")
            return
        for (op, _policy, _adam), metrics in zip(ready, results, strict=True):
            futures.complete(op.rid, json_body=optim_reply(metrics))

    def _op_save_state(self, op: Op) -> dict[str, Any]:
        policy = self.policies.serving(op.model)
        ckpt = Checkpoint.objects.get(pk=op.fields["checkpoint"])
        path = ckpt.file_path()
        policy.save_state(path)
        checkpoints.record_state_saved(ckpt.pk, size_bytes=path.stat().st_size, step=policy.step)
        return {"type": "save_weights", "path": ckpt.tinker_path}

    def _op_save_sampler(self, op: Op) -> dict[str, Any]:
        policy = self.policies.serving(op.model)
        ckpt = Checkpoint.objects.get(pk=op.fields["checkpoint"])
        version = policy.snapshot()
        self.samplers.keep_snapshot(ckpt.pk, policy, version)
        out = policy.export_peft(version, ckpt.file_path())
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        session_id = op.fields.get("sampling_session_id")
        checkpoints.record_sampler_saved(
            ckpt,
            size_bytes=size,
            step=policy.step,
            version=version,
            sampling_session_id=session_id,
        )
        if session_id:
            return {"type": "save_weights_for_sampler", "sampling_session_id": session_id}
        return {"type": "save_weights_for_sampler", "path": ckpt.tinker_path}

    def _op_save_external(self, op: Op) -> dict[str, Any]:
        policy = self.policies.serving(op.model)
        ckpt = Checkpoint.objects.get(pk=op.fields["checkpoint"])
        version = policy.snapshot()
        try:
            out = policy.export_peft(version, ckpt.file_path())
        finally:
            policy.release(version)
        exports.as_cookbook_adapter(out, tied_head=exports.ties_head(self.policies.engine.model))
        exports.encrypt(out, op.fields.get("recipients") or [])
        size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
        checkpoints.record_state_saved(ckpt.pk, size_bytes=size, step=policy.step)
        return {"type": "save_weights_external", "path": ckpt.tinker_path}

    def run_fwdbwd(self, ops: list[Op], forward_only: bool) -> None:
        prepared: list[Prepared] = []
        for op in ops:
            try:
                batch = wire.decode_forward_backward(
                    op.body or b"",
                    content_type=op.fields.get("ctype"),
                    forward_only=forward_only,
                    check=False,
                )
                pictures = expand_images(batch, self.policies.engine)
                wire.check_batch(batch)
                team = ""
                if batch.loss_fn == "stable_reinforce":
                    team = str((futures.get(op.rid) or {}).get("team", ""))
                datums = to_datums(batch, team, pictures)
                policy = self.policies.serving(op.model)
                prepared.append((op, batch, datums, policy))
            except Exception as exc:  # every failure is reported, by fail_request
                fail_request(op, exc, "forward/backward")
        if not prepared:
            return
        try:
            results = self._fwdbwd_call(prepared, forward_only)
        except Exception:  # attributed per request below
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

    def _fwdbwd_alone(self, item: Prepared, forward_only: bool) -> None:
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
        prepared: list[Prepared],
        forward_only: bool,
    ) -> list[tuple[list[dict[str, Any]], dict[str, float]]]:
        all_datums: list[Datum] = []
        policies: list[Policy] = []
        groups: list[tuple[list[int], Any, dict[str, Any]]] = []
        for _op, batch, datums, policy in prepared:
            if batch.loss_fn == "custom":
                raise RequestError("loss_fn 'custom' runs on the client (forward_backward_custom)")
            rows = list(range(len(all_datums), len(all_datums) + len(datums)))
            groups.append((rows, get_loss(batch.loss_fn), dict(batch.loss_fn_config or {})))
            all_datums.extend(datums)
            policies.extend([policy] * len(datums))
        pad_inputs(all_datums)
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
