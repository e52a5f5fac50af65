"""Which host adapter samples a sampler checkpoint: a live snapshot, or its files, loaded once.

A save for the sampler snapshots the policy in memory and writes a PEFT adapter; this worker
samples from the snapshot while it holds it and from the adapter files otherwise (a snapshot
it dropped, or one another worker made).

Neither kind is dropped while a request still routes rows to it: a request for a 17th
checkpoint, or training saving its fifth snapshot, while a stream decodes with the oldest one
would otherwise unregister the adapter under the running batch, which fails every request in
it. Loads and saves only record; ``trim`` drops what is past the limits and not in use, at
the worker loop's safe point between steps.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Set
from pathlib import Path
from typing import Any

import torch

from tinker_api.worker.lora import LORA_ALPHA
from tinker_api.worker.requests import RequestError
from training import peft_io
from training.engine import Engine
from training.policy import Policy

# Snapshots kept in memory per model, and sampler checkpoints loaded from disk per worker.
LIVE_SNAPSHOTS = 4
LOADED_SAMPLERS = 16


class SamplerCache:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Snapshots this worker made (checkpoint pk -> policy, version), and adapters loaded
        # from disk (file -> host key), oldest first.
        self.snapshots: dict[int, tuple[Policy, int]] = {}
        self.loaded: dict[str, str] = {}

    def keep_snapshot(self, checkpoint_pk: int, policy: Policy, version: int) -> None:
        """Serve a sampler checkpoint from its in-memory snapshot; ``trim`` drops the oldest
        snapshots of a policy beyond ``LIVE_SNAPSHOTS`` (their files still serve them)."""
        self.snapshots[checkpoint_pk] = (policy, version)

    def trim(self, in_use: Set[str]) -> None:
        """Drop the snapshots and loaded checkpoints past their limits, oldest first, except
        those whose host keys are ``in_use`` (rows of a running batch route to them)."""
        for policy in {id(p): p for p, _v in self.snapshots.values()}.values():
            mine = sorted(pk for pk, (p, _v) in self.snapshots.items() if p is policy)
            for pk in mine[: max(0, len(mine) - LIVE_SNAPSHOTS)]:
                version = self.snapshots[pk][1]
                held = version in policy.versions
                if held and policy.version_key(version) in in_use:
                    continue
                del self.snapshots[pk]
                if held:
                    policy.release(version)
        extra = len(self.loaded) - LOADED_SAMPLERS
        for file, key in list(self.loaded.items()):
            if extra <= 0:
                break
            if key not in in_use:
                del self.loaded[file]
                self.engine.host.unregister(key)
                extra -= 1

    def forget(self, policy: Policy) -> None:
        """``policy`` is gone: its snapshots no longer serve anything."""
        self.snapshots = {k: v for k, v in self.snapshots.items() if v[0] is not policy}

    def key(self, target: Mapping[str, Any], policies: Mapping[str, Policy]) -> str | None:
        """The host adapter key that samples ``target``: None for the base model, a live
        snapshot this worker made, else the sampler checkpoint loaded from disk."""
        if not target.get("model") and not target.get("file"):
            return None
        # A job's adapter or checkpoint (served by the OpenAI-style endpoints) names only its
        # file: no snapshot of this worker can hold it.
        live = self.snapshots.get(int(target["checkpoint"])) if "checkpoint" in target else None
        if live is not None:
            policy, version = live
            # A rebuilt model is a new policy object: its old snapshots are gone.
            if policies.get(target["model"]) is policy and version in policy.versions:
                return str(policy.version_key(version))
        file = target.get("file")
        if not file:
            raise RequestError("the sampler weights are not ready yet")
        key = self.loaded.pop(file, None)
        if key is None:
            key = self._load(file, target)
        self.loaded[file] = key  # the most recently asked for goes last, dropped last
        return key

    def _load(self, file: str, target: Mapping[str, Any]) -> str:
        if file.endswith(".pt"):
            weights = self._read_state(file)
        else:
            if not peft_io.weights_path(file).is_file():
                raise RequestError("the sampler checkpoint's files are gone (deleted or expired)")
            weights = peft_io.read_adapter(file, device=self.engine.device)
        scale = float(target["scale"]) if "scale" in target else LORA_ALPHA / int(target["rank"])
        key = f"sampler:{uuid.uuid4().hex[:12]}"
        self.engine.host.register(key, weights, scale, frozen=True)
        return key

    def _read_state(self, file: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The LoRA pairs of a training state (``Policy.save_state``: a job's checkpoint),
        without its optimizer moments."""
        path = Path(file)
        if not path.is_file():
            raise RequestError("the checkpoint's files are gone (deleted or rotated)")
        state = torch.load(path, map_location=self.engine.device, weights_only=True)
        weights = state.get("weights") or {}
        pairs = peft_io.from_peft_tensors(
            {f"{peft_io.KEY_PREFIX}{name}": value for name, value in weights.items()}
        )
        if not pairs:
            raise RequestError("the checkpoint holds no LoRA weights (a full fine-tuning run)")
        return pairs
