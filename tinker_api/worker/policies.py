"""The policies one worker serves, by model id, rebuilt from the database when missing."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from tinker_api.models import Checkpoint, TrainingModel
from tinker_api.worker.lora import LORA_ALPHA, target_modules
from tinker_api.worker.requests import RequestError
from training.engine import Engine
from training.lora import output_layer_name
from training.policy import Policy

log = logging.getLogger(__name__)


class Policies(Mapping[str, Policy]):
    """The live policies of one ``Engine``, by model id."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._live: dict[str, Policy] = {}

    def __getitem__(self, model_id: str) -> Policy:
        return self._live[model_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def serving(self, model_id: str) -> Policy:
        """The policy of ``model_id``; one this worker has not seen was served by a worker
        that stopped: rebuilt from its last saved state (what a dead worker loses is
        documented)."""
        policy = self._live.get(model_id)
        if policy is None:
            policy = self._rebuild(model_id)
        return policy

    def new(self, model_id: str, config: Mapping[str, Any]) -> Policy:
        """A fresh policy for ``model_id`` from its ``lora_config``, replacing any other."""
        self.remove(model_id)
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
        self._live[model_id] = policy
        return policy

    def remove(self, model_id: str) -> Policy | None:
        """Free ``model_id``'s weights; returns the policy it had, if any."""
        policy = self._live.pop(model_id, None)
        if policy is not None:
            self.engine.remove_policy(model_id)
        return policy

    def spill(self) -> int:
        """Write every live policy's whole state (weights, optimizer, step, RNG) where the
        next worker of this base model looks first, before this one gives its block back;
        returns how many were written. A model whose write fails keeps its last save."""
        written = 0
        for row in TrainingModel.objects.filter(pk__in=list(self._live)):
            try:
                self._live[row.id].save_state(row.spill_path())
                written += 1
            except Exception:
                log.exception("could not write the live state of %s", row.id)
        return written

    def close(self, model_id: str) -> None:
        """``model_id``'s session is over: free its weights, and its live state on disk."""
        self.remove(model_id)
        row = TrainingModel.objects.filter(pk=model_id).first()
        if row is not None:
            row.drop_spill()

    def _rebuild(self, model_id: str) -> Policy:
        row = TrainingModel.objects.filter(pk=model_id).first()
        if row is None:
            raise RequestError(f"unknown model {model_id}")
        policy = self.new(model_id, row.worker_config())
        source = latest_state(row)
        if source:
            policy.load_state(source)
        if source == str(row.spill_path()):
            log.info("model %s taken up from the state its last worker left", model_id)
        else:
            log.warning("model %s rebuilt from %s", model_id, source or "its initial weights")
        return policy


def latest_state(row: TrainingModel) -> str:
    """The newest state of a model on disk: what its last worker left when it gave its block
    back, or a save written after that, else the checkpoint it was created from ("" if none).
    A worker that died left nothing: its model restarts from its last save."""
    last = (
        # Only states whose file was written (a save the dead worker never ran has none).
        Checkpoint.objects.filter(
            model_id=row.id, kind=Checkpoint.Kind.TRAINING, size_bytes__isnull=False
        )
        .order_by("-created")
        .first()
    )
    saved = last.file_path() if last is not None else None
    spilled = row.spill_path()
    if spilled.is_file() and (
        saved is None or not saved.is_file() or spilled.stat().st_mtime >= saved.stat().st_mtime
    ):
        return str(spilled)
    return str(saved) if saved is not None else row.init_checkpoint
