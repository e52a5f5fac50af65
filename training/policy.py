"""Policies: a LoRA adapter (or a full fine-tuned copy) with identity, training state and versions.

A policy owns
- its live training weights (registered in the engine's `LoRAHost` under ``policy.id``),
- its AdamW state and step counter,
- immutable snapshots (versions) that samplers name; a snapshot is a detached copy registered
  under ``f"{policy.id}@{version}"`` and training never touches it,
- a history of the checkpoints it saved,
- its own random generator, so a resumed run continues bit-for-bit.
"""

from __future__ import annotations

import copy
import math
import os
import re
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from training import peft_io, vision
from training.lora import ALL_LINEAR, LoRAHost, resolve_target_modules, unwrap_linears

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CHECKPOINT_FORMAT = 1


def snapshot_key(policy_id: str, version: int) -> str:
    """Host key of a published version."""
    return f"{policy_id}@{version}"


@dataclass(frozen=True)
class LoRAConfig:
    """Shape of a policy's adapter."""

    rank: int
    """LoRA rank r (ignored for full fine-tuning)."""
    alpha: float
    """LoRA alpha; the delta is scaled by alpha / rank as in peft."""
    target_modules: tuple[str, ...] | str
    """Module name suffixes (e.g. "q_proj") or "all-linear"."""
    seed: int
    """Seed of the adapter initialisation and of the policy's generator."""
    full_finetune: bool = False
    """Train every base parameter of a private copy of the model instead of an adapter."""

    def __post_init__(self) -> None:
        if not self.full_finetune and (not isinstance(self.rank, int) or self.rank < 1):
            raise ValueError(f"rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if isinstance(self.target_modules, str):
            if self.target_modules != ALL_LINEAR:
                object.__setattr__(self, "target_modules", (self.target_modules,))
        else:
            targets = tuple(self.target_modules)
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError("target_modules must be non-empty strings or 'all-linear'")
            object.__setattr__(self, "target_modules", targets)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass
class CheckpointRecord:
    """One saved training state (the policy's checkpoint history)."""

    path: str
    step: int
    created: float = field(default_factory=time.time)


class Policy:
    """Trainable policy bound to an engine's base model. Create it with `Engine.create_policy`."""

    def __init__(
        self,
        policy_id: str,
        config: LoRAConfig,
        host: LoRAHost,
        base_model: nn.Module,
        base_model_name: str | None = None,
    ) -> None:
        self.id = policy_id
        self.config = config
        self.host = host
        self.base_model_name = base_model_name
        self.step = 0
        self.history: list[CheckpointRecord] = []
        self.generator = torch.Generator().manual_seed(config.seed)
        self._next_version = 0
        self._closed = False
        # LoRA: module name -> (A, B) Parameters. Full fine-tuning: a private model copy.
        self.lora_weights: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        self.model: nn.Module | None = None
        self._versions: dict[int, Any] = {}
        # The dtype the base model computes in (bf16 on a GPU).
        self.compute_dtype = next(base_model.parameters()).dtype
        if config.full_finetune:
            self.model = unwrap_linears(copy.deepcopy(base_model))
            if self.compute_dtype != torch.float32:
                # Master weights in float32: an Adam update below a bf16 weight's spacing (most
                # of them at the usual learning rates) would round away. The forward computes
                # in the base's dtype under autocast (`compute`), and versions are published in
                # it (sampling, export).
                self.model.float()
            self.model.requires_grad_(True)
            self.model.eval()  # no dropout: training is deterministic
        else:
            self._init_lora(base_model)
            host.register(self.id, self.lora_weights, config.scaling)
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)

    # -- weights ----------------------------------------------------------------------------

    def _init_lora(self, base_model: nn.Module) -> None:
        names = resolve_target_modules(base_model, self.config.target_modules)
        gen = torch.Generator().manual_seed(self.config.seed)
        for name in names:
            module = self.host.modules.get(name)
            if module is None:
                raise ValueError(f"{name} is not wrapped by the engine's LoRA host")
            device = module.weight.device
            a = torch.empty(self.config.rank, module.in_features)
            # Same initialisation as peft: A Kaiming-uniform, B zero (the adapter starts a no-op).
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            b = torch.zeros(module.out_features, self.config.rank)
            self.lora_weights[name] = (
                nn.Parameter(a.to(device)),
                nn.Parameter(b.to(device)),
            )

    @property
    def is_full_finetune(self) -> bool:
        return self.config.full_finetune

    def compute(self) -> AbstractContextManager[Any]:
        """The context a forward of this policy's own model runs in: autocast to the base's
        dtype over float32 master weights (full fine-tuning of a bf16 base), else nothing."""
        if self.model is None or self.compute_dtype == torch.float32:
            return nullcontext()
        device = next(self.model.parameters()).device
        return torch.autocast(device.type, dtype=self.compute_dtype)

    @property
    def adapter_key(self) -> str | None:
        """Host key of the live training weights (None for full fine-tuning)."""
        return None if self.is_full_finetune else self.id

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        if self.model is not None:
            return list(self.model.named_parameters())
        named = []
        for module, (a, b) in self.lora_weights.items():
            named.append((f"{module}.lora_A.weight", a))
            named.append((f"{module}.lora_B.weight", b))
        return named

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # -- versions ---------------------------------------------------------------------------

    def snapshot(self) -> int:
        """Publish an immutable copy of the current weights; returns its version number."""
        self._check_open()
        version = self._next_version
        if self.model is not None:
            frozen = copy.deepcopy(self.model).to(self.compute_dtype).requires_grad_(False)
            for p in frozen.parameters():
                p.grad = None
            self._versions[version] = frozen
        else:
            weights = {
                name: (a.detach().clone(), b.detach().clone())
                for name, (a, b) in self.lora_weights.items()
            }
            self.host.register(
                snapshot_key(self.id, version), weights, self.config.scaling, frozen=True
            )
            self._versions[version] = weights
        self._next_version += 1
        return version

    @property
    def versions(self) -> list[int]:
        return sorted(self._versions)

    @property
    def latest_version(self) -> int | None:
        return max(self._versions) if self._versions else None

    def version_key(self, version: int) -> str:
        """Host key of a published LoRA version (full fine-tuning versions have none)."""
        self._require_version(version)
        if self.is_full_finetune:
            raise ValueError(f"policy {self.id} is fully fine-tuned: its versions are models")
        return snapshot_key(self.id, version)

    def version_model(self, version: int) -> nn.Module:
        """The frozen model of a full fine-tuning version."""
        self._require_version(version)
        if not self.is_full_finetune:
            raise ValueError(f"policy {self.id} is a LoRA policy: route its version key instead")
        return self._versions[version]

    def version_weights(self, version: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        self._require_version(version)
        if self.is_full_finetune:
            raise ValueError(f"policy {self.id} is fully fine-tuned: it has no LoRA weights")
        return self._versions[version]

    def release(self, version: int) -> None:
        """Drop a published version (samplers must no longer name it)."""
        self._require_version(version)
        if not self.is_full_finetune:
            self.host.unregister(snapshot_key(self.id, version))
        del self._versions[version]

    def _require_version(self, version: int) -> None:
        if version not in self._versions:
            raise KeyError(f"policy {self.id} has no version {version}; have {self.versions}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"policy {self.id} was closed")

    def close(self) -> None:
        """Unregister every adapter of this policy from the host."""
        if self._closed:
            return
        for version in list(self._versions):
            self.release(version)
        if not self.is_full_finetune:
            self.host.unregister(self.id)
        self._closed = True

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "policy_id": self.id,
            "config": asdict(self.config),
            "step": self.step,
            "next_version": self._next_version,
            "weights": {name: p.detach().cpu().clone() for name, p in self.named_parameters()},
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._copy_weights(state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step = int(state["step"])
        self._next_version = max(self._next_version, int(state["next_version"]))

    def _copy_weights(self, state: dict[str, Any]) -> None:
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"unsupported checkpoint format {state.get('format')!r}")
        saved = LoRAConfig(**_config_from_saved(state["config"]))
        mine = LoRAConfig(**_config_from_saved(asdict(self.config)))
        if (saved.rank, saved.alpha, saved.full_finetune) != (
            mine.rank,
            mine.alpha,
            mine.full_finetune,
        ):
            raise ValueError(f"checkpoint config {saved} does not match policy config {mine}")
        params = dict(self.named_parameters())
        weights = state["weights"]
        if set(weights) != set(params):
            missing = sorted(set(params) - set(weights))[:3]
            extra = sorted(set(weights) - set(params))[:3]
            raise ValueError(f"checkpoint weights differ: missing {missing}, unexpected {extra}")
        with torch.no_grad():
            for name, param in params.items():
                if weights[name].shape != param.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(weights[name].shape)} != "
                        f"{tuple(param.shape)}"
                    )
                param.copy_(weights[name])

    def save_state(self, path: str | os.PathLike[str]) -> Path:
        """Write weights, optimizer, step and RNG to `path` (atomically)."""
        self._check_open()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        self.history.append(CheckpointRecord(path=str(path), step=self.step))
        return path

    def load_state(self, path: str | os.PathLike[str]) -> None:
        """Restore a state written by `save_state` into this policy (same shape required)."""
        self._check_open()
        state = torch.load(Path(path), map_location="cpu", weights_only=True)
        self.load_state_dict(state)

    def load_weights(self, path: str | os.PathLike[str]) -> None:
        """Only the weights of a state written by `save_state`: the optimizer, step and RNG
        stay this policy's own (a new run that starts from another run's checkpoint)."""
        self._check_open()
        self._copy_weights(torch.load(Path(path), map_location="cpu", weights_only=True))

    # -- export -----------------------------------------------------------------------------

    def peft_target_modules(self) -> list[str]:
        """Target module suffixes as peft and vLLM expect them (e.g. ["q_proj", "v_proj"])."""
        if isinstance(self.config.target_modules, str):
            return sorted({name.rsplit(".", 1)[-1] for name in self.lora_weights})
        return sorted(self.config.target_modules)

    def export_peft(self, version: int, out_dir: str | os.PathLike[str]) -> Path:
        """Write `version` as a PEFT LoRA adapter: adapter_config.json + adapter_model.safetensors.

        Key names follow peft's saved format (``base_model.model.<module>.lora_A.weight``), which
        `PeftModel.from_pretrained` and vLLM's LoRA loader both read.
        """
        from peft import LoraConfig

        weights = self.version_weights(version)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        spec = vision.spec_of(self.host.model)
        # A vision tower's Linears share names with the language model's (gate_proj...); the
        # adapter adapts the language model only, so peft must leave the tower alone.
        exclude = None if spec is None else rf"{re.escape(spec.tower_prefix)}\..*"
        peft_config = LoraConfig(
            r=self.config.rank,
            # peft annotates lora_alpha as int, yet only divides it by r: a float alpha is kept.
            lora_alpha=self.config.alpha,  # type: ignore[arg-type]
            target_modules=self.peft_target_modules(),
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=self.base_model_name,
            exclude_modules=exclude,
        )
        peft_config.save_pretrained(str(out))
        return peft_io.write_adapter_weights(
            out, weights, metadata={"format": "pt", "policy_id": self.id, "version": str(version)}
        )

    def export_full(self, version: int, out_dir: str | os.PathLike[str]) -> Path:
        """Write a full fine-tuning version in Hugging Face format (config + safetensors)."""
        # A copy of the engine's base model, which load_base builds with transformers.
        model = cast("PreTrainedModel", self.version_model(version))
        out = Path(out_dir)
        model.save_pretrained(str(out))
        return out

    def __repr__(self) -> str:
        kind = "full" if self.is_full_finetune else f"lora r={self.config.rank}"
        return f"Policy(id={self.id!r}, {kind}, step={self.step}, versions={self.versions})"


def _config_from_saved(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    targets: Iterable[str] | str = config["target_modules"]
    config["target_modules"] = targets if isinstance(targets, str) else tuple(targets)
    return config
