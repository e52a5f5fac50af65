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

    def _rebuild(self, model_id: str) -> Policy:
        row = TrainingModel.objects.filter(pk=model_id).first()
        if row is None:
            raise RequestError(f"unknown model {model_id}")
        policy = self.new(model_id, row.worker_config())
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
