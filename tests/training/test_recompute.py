"""Activation checkpointing (`forward_backward(..., recompute=True)`): the decoder layers
recompute their activations in backward under the routing they had in the forward, so the
log-probs, losses and gradients are those of the plain path, for one LoRA policy, several
adapters and a full fine-tune in one batch, packed or padded, and a vision-language model;
and the forward keeps far fewer tensors for backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.training import vl_models
from tests.training.test_ops import grads, rl_datum, warm
from tests.training.test_packing import LENGTHS, sft_datum
from training import vision
from training.engine import Engine
from training.ops import forward_backward
from training.types import Datum


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return Engine(tiny_model, tokenizer=tiny_tokenizer)


def assert_same_with_recompute(owners: list[Any], datums: list[Datum], loss_fn: str, **kw) -> None:
    policies = list(dict.fromkeys(owners))
    plain = forward_backward(owners, datums, loss_fn, **kw)
    plain_grads = {p.id: grads(p) for p in policies}
    for p in policies:
        p.zero_grad()
    again = forward_backward(owners, datums, loss_fn, recompute=True, **kw)
    for a, b in zip(plain.logprobs, again.logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert again.metrics == pytest.approx(plain.metrics, rel=1e-6, abs=1e-6)
    for p in policies:
        got = grads(p)
        assert got.keys() == plain_grads[p.id].keys()
        for name, g in got.items():
            torch.testing.assert_close(g, plain_grads[p.id][name], atol=1e-6, rtol=1e-5)
        p.zero_grad()


@pytest.mark.parametrize("pack", [False, True])
def test_it_gives_the_same_gradients_for_adapters_and_a_full_finetune(engine, pack):
    first = engine.create_policy(rank=4, alpha=8, seed=1)
    second = engine.create_policy(rank=2, alpha=4, seed=2, target_modules=("q_proj", "lm_head"))
    full = engine.create_policy(full_finetune=True)
    warm(first, 3)
    warm(second, 4)
    gen = torch.Generator().manual_seed(5)
    owners = [first, second, full, second, first, first, second, full]
    datums = [rl_datum(gen, n) for n in LENGTHS]
    assert_same_with_recompute(owners, datums, "ppo", pack=pack)
    sft = [sft_datum(gen, n) for n in LENGTHS]
    assert_same_with_recompute([first] * len(sft), sft, "cross_entropy", pack=pack)


def _saved_bytes(fn: Any) -> int:
    """Bytes of the tensors autograd keeps from the forward for backward."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_it_keeps_far_fewer_activations_for_backward(engine):
    policy = engine.create_policy(rank=4, alpha=8, seed=1)
    gen = torch.Generator().manual_seed(6)
    datums = [sft_datum(gen, 256) for _ in range(4)]
    plain = _saved_bytes(lambda: forward_backward(policy, datums, "cross_entropy"))
    policy.zero_grad()
    # A recomputed layer keeps only its inputs from the forward; what it saves again while
    # its backward runs lives under the checkpoint's own hooks, one layer at a time.
    kept = _saved_bytes(lambda: forward_backward(policy, datums, "cross_entropy", recompute=True))
    print(f"saved for backward: {plain} bytes plain, {kept} recomputing")
    assert kept < 0.5 * plain


def test_a_vision_language_model_recomputes_to_the_same_gradients():
    tokenizer = vl_models.vl_tokenizer()
    engine = Engine(vl_models.build_vl_model("qwen2_5_vl", tokenizer), tokenizer=tokenizer)
    policy = engine.create_policy(rank=4, seed=3)
    warm(policy, 7)
    processor = vl_models.processor()
    start, end, pad = vl_models.image_ids(tokenizer)
    datums = []
    for seed in range(3):
        image = vision.encode_image(processor, vl_models.picture(seed))
        sequence = [5, start] + [pad] * image.tokens + [end, 7, 8, 9, 10 + seed]
        datums.append(
            Datum(
                model_input=sequence[:-1],
                loss_fn_inputs={
                    "target_tokens": sequence[1:],
                    "weights": [1.0] * (len(sequence) - 1),
                },
                images=(image,),
            )
        )
    assert_same_with_recompute([policy] * len(datums), datums, "cross_entropy")
