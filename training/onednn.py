"""CPU projections without autograd through oneDNN, with each weight packed once.

PyTorch runs a float32 `F.linear` on the CPU through MKL's sgemm. On AMD CPUs MKL takes a
generic code path and reaches about half of what the cores can do; oneDNN's matmul, given
the weight in its own blocked layout (`_reorder_linear_weight`, the op PyTorch's compiler
uses for frozen CPU weights), runs the same projection about twice as fast here (measured
at the sampler's shapes: 64 x 256 x 768 at 223 against 104 GFLOP/s on one core). The
result is an IEEE float32 matmul summed in another order (relative differences ~1e-6).

Used for no-grad work only (sampling, scoring, evaluation): the op has no autograd formula.
A packed copy of each base weight is kept while the weight lives and is rebuilt when the
weight changes in place (its version counter moves), so full fine-tuning stays exact. Set
OPENTINKER_ONEDNN_LINEAR=0 to use `F.linear` everywhere.

`linear_rows` applies several projections of one input (a layer's query, key and value, or
its gate and up) as one matmul over their weights stacked by rows, packed once in the same
way: a decode step then streams each layer's weights in two calls instead of five. The
stacked copy replaces the separate ones where every no-grad use goes through it (the fused
decoder's); a process that also calls the modules one by one without autograd holds both.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

# ids of the packed weights -> (their versions when packed, weak references, packed weight)
_Entry = tuple[tuple[int, ...], list[weakref.ref[torch.Tensor]], torch.Tensor]
_packed: dict[tuple[int, ...], _Entry] = {}
# ("bias", ids of the weights and biases) -> (the biases' versions, the biases stacked, zeros
# where one is None)
_biases: dict[tuple[object, ...], tuple[tuple[int, ...], torch.Tensor]] = {}
_lock = threading.Lock()
_state: dict[str, bool] = {}


def available() -> bool:
    """oneDNN's packed linear exists in this build, is enabled, and agrees with F.linear."""
    ok = _state.get("ok")
    if ok is None:
        ok = _state["ok"] = _self_check()
    return ok


def _self_check() -> bool:
    if os.environ.get("OPENTINKER_ONEDNN_LINEAR", "1").strip().lower() in ("0", "false", "no"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 3, 48, generator=gen)
        w = torch.randn(40, 48, generator=gen)
        b = torch.randn(40, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    expected = F.linear(x, w, b)
    return got.shape == expected.shape and bool(torch.allclose(got, expected, atol=1e-4, rtol=1e-5))


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and available()
    )


def _pack(*weights: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of ``weights`` stacked by rows (of the one weight, usually):
    cached while every one of them lives and unchanged."""
    key = tuple(id(w) for w in weights)
    versions = tuple(w._version for w in weights)
    entry = _packed.get(key)
    if (
        entry is not None
        and entry[0] == versions
        and all(ref() is w for ref, w in zip(entry[1], weights))
    ):
        return entry[2]
    stacked = weights[0] if len(weights) == 1 else torch.cat(weights)
    packed = torch.ops.mkldnn._reorder_linear_weight(stacked.detach(), None)
    with _lock:
        old = _packed.get(key)
        fresh = old is None or any(ref() is not w for ref, w in zip(old[1], weights))
        _packed[key] = (versions, [weakref.ref(w) for w in weights], packed)
        if fresh:
            # Drop the packed copy with any of its weights (ids are reused after that).
            for w in weights:
                weakref.finalize(w, _packed.pop, key, None)
    return packed


def _stacked_bias(
    weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    # The weights' ids too: where a bias is missing, its part's height comes from the weight.
    owners = [*weights, *(b for b in biases if b is not None)]
    key = ("bias", *(id(w) for w in weights), *(id(b) if b is not None else 0 for b in biases))
    versions = tuple(b._version for b in biases if b is not None)
    entry = _biases.get(key)
    if entry is not None and entry[0] == versions:
        return entry[1]
    stacked = torch.cat(
        [b.detach() if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)]
    )
    with _lock:
        fresh = key not in _biases
        _biases[key] = (versions, stacked)
        if fresh:
            for owner in owners:
                weakref.finalize(owner, _biases.pop, key, None)
    return stacked


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN when `usable(x, weight)`."""
    if not usable(x, weight):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, _pack(weight), bias, "none", [], "")


def linear_rows(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """``torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)`` in one matmul,
    for `usable` inputs (every weight float32 on the CPU, no autograd)."""
    packed = _pack(*weights)
    return torch.ops.mkldnn._linear_pointwise(
        x, packed, _stacked_bias(weights, biases), "none", [], ""
    )
