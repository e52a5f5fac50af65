"""The engine: one frozen base model, its tokenizer, a LoRA host and the policies trained on it."""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from training import vision
from training.lora import (
    ALL_LINEAR,
    DEFAULT_TARGET_MODULES,
    LoRAHost,
    output_layer_name,
    resolve_target_modules,
)
from training.policy import LoRAConfig, Policy


class Engine:
    """Base model + tokenizer + `LoRAHost`; the factory and registry of policies.

    `base` is a local model directory (loaded by `training.model.load_base`, hub off) or an
    already built model, in which case `tokenizer` (and a vision model's `processor`) may be
    passed alongside.
    """

    def __init__(
        self,
        base: str | os.PathLike[str] | nn.Module,
        device: str | torch.device | None = None,
        *,
        tokenizer: Any = None,
        dtype: torch.dtype | None = None,
        processor: Any = None,
    ) -> None:
        if isinstance(base, nn.Module):
            model = base
            if device is not None:
                model = model.to(device)
            if dtype is not None:
                model = model.to(dtype)
            self.base_path: str | None = getattr(model.config, "_name_or_path", None) or None
        else:
            from training.model import load_base

            model, loaded_tokenizer = load_base(str(base), device=device, dtype=dtype)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
            self.base_path = str(Path(base))
        model.requires_grad_(False)
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        # A vision-language model's image processor (None for a text-only model, or for a
        # model built in memory: set it with the model's processor to pass images as files).
        self.processor: Any = processor
        if processor is None and self.base_path is not None and vision.is_vision_model(model):
            from training.model import resolve_base_path

            # An alias ("tiny-vl") names the model; the processor's files are in its directory.
            self.processor = vision.load_processor(str(resolve_base_path(self.base_path)))
        self._images: OrderedDict[bytes, vision.ImageInput] = OrderedDict()
        # Wrap every Linear once, the output head included (LoRA on the unembedding); each
        # policy registers weights only on its own targets.
        wrapped = resolve_target_modules(model, ALL_LINEAR)
        head = output_layer_name(model)
        self.host = LoRAHost(model, [*wrapped, head] if head else wrapped)
        self.policies: dict[str, Policy] = {}
        self._counter = itertools.count()

    # Processed images kept by content: a group's episodes and every turn of a conversation
    # show the same pictures again.
    IMAGE_CACHE = 512

    def encode_image(self, data: bytes) -> vision.ImageInput:
        """An image (PNG or JPEG bytes) as the model's vision tower takes it."""
        if self.processor is None:
            raise ValueError("this base model takes no images (it has no image processor)")
        key = hashlib.blake2b(data, digest_size=16).digest()
        image = self._images.get(key)
        if image is None:
            image = vision.encode_image(self.processor, data)
            self._images[key] = image
            while len(self._images) > self.IMAGE_CACHE:
                self._images.popitem(last=False)
        else:
            self._images.move_to_end(key)
        return image

    def image_tokens(self, data: bytes) -> int:
        """How many placeholder tokens the image fills in a sequence."""
        return self.encode_image(data).tokens

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def create_policy(
        self,
        rank: int = 8,
        alpha: float = 16.0,
        target_modules: str | Iterable[str] = DEFAULT_TARGET_MODULES,
        seed: int = 0,
        full_finetune: bool = False,
        *,
        policy_id: str | None = None,
    ) -> Policy:
        """Make a new policy; LoRA weights start as peft's (A Kaiming-uniform, B zero)."""
        if policy_id is None:
            policy_id = f"policy-{next(self._counter)}"
            while policy_id in self.policies:
                policy_id = f"policy-{next(self._counter)}"
        if not policy_id or "@" in policy_id:
            raise ValueError(f"policy id must be non-empty and must not contain '@': {policy_id!r}")
        if policy_id in self.policies:
            raise ValueError(f"policy {policy_id!r} already exists")
        targets = target_modules if isinstance(target_modules, str) else tuple(target_modules)
        config = LoRAConfig(
            rank=rank,
            alpha=alpha,
            target_modules=targets,
            seed=seed,
            full_finetune=full_finetune,
        )
        policy = Policy(policy_id, config, self.host, self.model, base_model_name=self.base_path)
        self.policies[policy_id] = policy
        return policy

    def get_policy(self, policy_id: str) -> Policy:
        try:
            return self.policies[policy_id]
        except KeyError:
            raise KeyError(f"no policy {policy_id!r}") from None

    def remove_policy(self, policy_id: str) -> None:
        self.get_policy(policy_id).close()
        del self.policies[policy_id]

    def resolve(self, policy_id: str | None, version: int | None) -> tuple[nn.Module, str | None]:
        """(model, host key) that serve `policy_id` at `version` (None: live weights).

        A LoRA policy runs on the shared base model with its key routed; a full fine-tuning
        policy runs its own model with no key; `policy_id=None` is the base model itself.
        """
        if policy_id is None:
            return self.model, None
        policy = self.get_policy(policy_id)
        if policy.is_full_finetune:
            if version is None:
                assert policy.model is not None
                return policy.model, None
            return policy.version_model(version), None
        if version is None:
            return self.model, policy.id
        return self.model, policy.version_key(version)
