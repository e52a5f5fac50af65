"""Activation checkpointing: the decoder layers keep only their inputs during the forward and
recompute their activations in backward, trading about one more forward for memory that no
longer grows with layers x tokens (long sequences, large batches).

The engine routes LoRA rows through `LoRAHost.route`, a block that has ended by the time the
loss's backward runs; a recomputed layer therefore runs again under the routing it had in the
forward (`LoRAHost.replay_route`), so recomputation gives the very same activations and
gradients as keeping them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.lora import LoRAHost


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of the language model (a vision tower's stay as they are)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no decoder layers to recompute (get_decoder().layers)"
        )
    return layers


def _recomputing(original: Callable[..., Any], host: LoRAHost | None) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        route = host.current_route() if host is not None else None

        def run(*a: Any, **k: Any) -> Any:
            if host is None or route is None:
                return original(*a, **k)
            with host.replay_route(route):
                return original(*a, **k)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return forward


@contextmanager
def recomputed(model: nn.Module, host: LoRAHost | None) -> Iterator[None]:
    """Inside the block (forward and backward), `model`'s decoder layers recompute their
    activations in backward. `host`: the LoRA host that routes `model`'s rows, if any."""
    layers = list(decoder_layers(model))
    for layer in layers:
        # An instance attribute shadows the class's forward; nn.Module.__call__ finds it.
        layer.forward = _recomputing(layer.forward, host)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@contextmanager
def recomputed_all(models: list[tuple[nn.Module, LoRAHost | None]]) -> Iterator[None]:
    """`recomputed` for each distinct model of a batch (a LoRA host's, full fine-tunes')."""
    with ExitStack() as stack:
        seen: set[int] = set()
        for model, host in models:
            if id(model) not in seen:
                seen.add(id(model))
                stack.enter_context(recomputed(model, host))
        yield
