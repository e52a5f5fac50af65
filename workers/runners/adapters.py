"""Reading a job's exported weights back into an engine policy (pure: no Django, no database).

Eval jobs and frozen opponents (``workers.runners.native``) load the ``adapter/`` a LoRA job
exported with ``Policy.export_peft``, or the ``model/`` a full fine-tuning job exported with
``Policy.export_full``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from training import peft_io

if TYPE_CHECKING:
    from training.policy import Policy

__all__ = ["AdapterMismatch", "load_full_model", "load_peft_adapter"]


class AdapterMismatch(ValueError):
    """The adapter's tensors do not fit the policy it is loaded into."""


def load_peft_adapter(policy: Policy, adapter_dir: Path) -> None:
    """Copy an adapter written by `Policy.export_peft` into `policy`'s LoRA weights.

    The policy must have been created with the adapter's rank and targets (those of the job
    that trained it); any missing, extra or misshapen tensor is an error, not a partial load.
    """
    # Lazy: torch loads only when an adapter is actually read.
    import torch

    if policy.is_full_finetune:
        raise AdapterMismatch("a PEFT adapter loads into a LoRA policy, not a full fine-tuning one")
    tensors = peft_io.read_adapter_tensors(adapter_dir)
    expected = peft_io.peft_keys(policy.lora_weights)
    if set(tensors) != expected:
        missing = sorted(expected - set(tensors))[:3]
        extra = sorted(set(tensors) - expected)[:3]
        raise AdapterMismatch(f"adapter does not fit the policy: missing {missing}, extra {extra}")
    with torch.no_grad():
        for name, (a, b) in policy.lora_weights.items():
            for param, part in ((a, "A"), (b, "B")):
                value = tensors[peft_io.peft_key(name, part)]
                if value.shape != param.shape:
                    raise AdapterMismatch(
                        f"{name}.lora_{part}: adapter shape {tuple(value.shape)} != "
                        f"{tuple(param.shape)}"
                    )
                param.copy_(value.to(param.device, param.dtype))


def load_full_model(policy: Policy, model_dir: Path) -> None:
    """Copy a model directory written by `Policy.export_full` (safetensors, possibly sharded)
    into a full fine-tuning `policy`'s weights; the base model's architecture must match, every
    tensor accounted for (a tied output head is saved once, as the policy names it once)."""
    import torch
    from safetensors.torch import load_file

    if not policy.is_full_finetune or policy.model is None:
        raise AdapterMismatch("a full model loads into a full fine-tuning policy, not a LoRA one")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    params = dict(policy.model.named_parameters())
    if set(params) - set(tensors):
        missing = sorted(set(params) - set(tensors))[:3]
        raise AdapterMismatch(f"the model does not fit the policy: missing {missing}")
    with torch.no_grad():
        for name, param in params.items():
            value = tensors[name]
            if value.shape != param.shape:
                raise AdapterMismatch(
                    f"{name}: model shape {tuple(value.shape)} != {tuple(param.shape)}"
                )
            param.copy_(value.to(param.device, param.dtype))
