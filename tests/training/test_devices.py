"""The engine as a GPU runs it: a bf16 base model, fp32 adapters on it, float32 master weights
for full fine-tuning. Each case runs on the CPU here and on CUDA where there is one (the
`gpu`-marked cases, which `scripts/gpu_check.sh` runs), against a float32 engine on the CPU
with the same weights."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.training.test_ops import warm
from training.engine import Engine
from training.ops import forward, forward_backward, optim_step
from training.sampler import generate
from training.types import AdamParams, Datum, SamplingParams

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]
TEXTS = ["12+34=46", "the quick brown fox 7+8=15", "99+1=100", "lazy dog jumps"]


def datums(tokenizer) -> list[Datum]:
    return [Datum.from_sequence(tokenizer(t)["input_ids"]) for t in TEXTS]


def sft(policy, batch, steps: int, lr: float) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(forward_backward(policy, batch, "cross_entropy").metrics["loss:mean"])
        optim_step(policy, AdamParams(learning_rate=lr))
    return losses


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_engine_scores_like_float32_and_trains_lora_and_full_policies(
    device, tiny_model, tiny_tokenizer
):
    reference = Engine(copy.deepcopy(tiny_model), tokenizer=tiny_tokenizer)
    engine = Engine(tiny_model, device=device, tokenizer=tiny_tokenizer, dtype=torch.bfloat16)
    assert engine.device.type == device
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    batch = datums(tiny_tokenizer)

    # Two adapters with the same weights on both engines score the same tokens alike.
    pairs = []
    for seed in (1, 2):
        ours = engine.create_policy(rank=4, alpha=8, seed=seed)
        theirs = reference.create_policy(rank=4, alpha=8, seed=seed)
        warm(theirs, seed)
        with torch.no_grad():
            for name, (a, b) in ours.lora_weights.items():
                a.copy_(theirs.lora_weights[name][0])
                b.copy_(theirs.lora_weights[name][1])
        assert {p.dtype for p in ours.parameters()} == {torch.float32}
        pairs.append((ours, theirs))
    owners = [pairs[0][0], pairs[1][0], pairs[1][0], pairs[0][0]]
    expected = forward([pairs[0][1], pairs[1][1], pairs[1][1], pairs[0][1]], batch).logprobs
    for got, want in zip(forward(owners, batch).logprobs, expected, strict=True):
        assert got.device.type == "cpu"
        diff = (got.float() - want).abs()
        assert diff.mean() < 0.05 and diff.max() < 0.3

    # Sampling rows of both adapters in one batch: finite log-probs, and the adapters differ.
    prompt = tiny_tokenizer("12+34=")["input_ids"]
    keys = [p.version_key(p.snapshot()) for p, _ in pairs]
    seqs = generate(
        engine.model,
        tiny_tokenizer,
        [prompt] * 4,
        SamplingParams(max_tokens=8, temperature=1.0, seed=3),
        adapters=[keys[0], keys[1], keys[0], keys[1]],
        host=engine.host,
        stop_on_eos=False,
        sample_indices=[0, 0, 1, 1],
    )
    assert all(len(s.tokens) == 8 and all(torch.isfinite(torch.tensor(s.logprobs))) for s in seqs)
    assert seqs[0].tokens != seqs[1].tokens or seqs[2].tokens != seqs[3].tokens

    # LoRA and full fine-tuning both learn the batch on the bf16 base.
    lora = sft(pairs[0][0], batch, 8, 2e-2)
    assert lora[-1] < 0.8 * lora[0]
    full = engine.create_policy(full_finetune=True, seed=0)
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    losses = sft(full, batch, 8, 1e-3)
    assert losses[-1] < 0.8 * losses[0]
    frozen = full.version_model(full.snapshot())
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
