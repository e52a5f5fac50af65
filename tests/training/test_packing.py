"""Packed batches: datums laid end to end with per-datum position ids give the log-probs,
losses and gradients of the padded batch, for one policy and for several in one call."""

from __future__ import annotations

import pytest
import torch

from tests.training.test_ops import grads, rl_datum, warm
from training import packing
from training.engine import Engine
from training.ops import forward, forward_backward
from training.types import Datum

# Mixed lengths, so that several datums share a packed row.
LENGTHS = (61, 4, 17, 9, 33, 2, 25, 12)


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return Engine(tiny_model, tokenizer=tiny_tokenizer)


def sft_datum(gen: torch.Generator, length: int) -> Datum:
    weights = torch.rand(length, generator=gen)
    weights[: length // 3] = 0
    return Datum(
        model_input=torch.randint(3, 290, (length,), generator=gen),
        loss_fn_inputs={
            "target_tokens": torch.randint(3, 290, (length,), generator=gen),
            "weights": weights,
        },
    )


def assert_same_both_ways(owners, datums, loss_fn):
    policies = list(dict.fromkeys(owners))
    padded = forward_backward(owners, datums, loss_fn, pack=False)
    padded_grads = {p.id: grads(p) for p in policies}
    for p in policies:
        p.zero_grad()
    packed = forward_backward(owners, datums, loss_fn, pack=True)
    for a, b in zip(padded.logprobs, packed.logprobs, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert padded.metrics.keys() == packed.metrics.keys()
    for name, value in padded.metrics.items():
        assert packed.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-5)
    for p in policies:
        for name, g in grads(p).items():
            torch.testing.assert_close(g, padded_grads[p.id][name], atol=1e-5, rtol=1e-4)


def test_it_packs_several_datums_per_row_by_owner():
    layout = packing.plan(LENGTHS, ["a"] * len(LENGTHS), torch.device("cpu"))
    assert layout is not None and layout.rows < len(LENGTHS)
    assert layout.length == max(LENGTHS)
    assert int(layout.real_S.sum()) == sum(LENGTHS)
    # Two owners never share a row.
    owners = ["a", "b"] * (len(LENGTHS) // 2)
    split = packing.plan(LENGTHS, owners, torch.device("cpu"), force=True)
    assert split is not None
    source_datum = split.source_S.view(split.rows, split.length) // split.length
    real = split.real_S.view(split.rows, split.length)
    for row in range(split.rows):
        assert {owners[int(i)] for i in source_datum[row][real[row]]} == {
            owners[split.owner_datum[row]]
        }
    # Equal lengths gain nothing: the padded batch is kept.
    assert packing.plan([64] * 8, ["a"] * 8, torch.device("cpu")) is None


def test_it_gives_the_padded_logprobs_and_gradients_for_one_policy(engine):
    policy = engine.create_policy(rank=4, alpha=8, seed=0)
    warm(policy, 1)
    gen = torch.Generator().manual_seed(0)
    assert_same_both_ways([policy] * len(LENGTHS), [rl_datum(gen, n) for n in LENGTHS], "ppo")
    policy.zero_grad()
    sft = [sft_datum(gen, n) for n in LENGTHS]
    assert_same_both_ways([policy] * len(LENGTHS), sft, "cross_entropy")


def test_it_gives_the_padded_logprobs_and_gradients_for_several_policies(engine):
    first = engine.create_policy(rank=4, alpha=8, seed=1, target_modules=["q_proj", "v_proj"])
    second = engine.create_policy(rank=2, alpha=4, seed=2, target_modules=("q_proj", "lm_head"))
    full = engine.create_policy(full_finetune=True)
    warm(first, 3)
    warm(second, 4)
    gen = torch.Generator().manual_seed(1)
    datums = [rl_datum(gen, n) for n in LENGTHS]
    owners = [first, second, full, second, first, first, second, full]
    assert_same_both_ways(owners, datums, "importance_sampling")
    # Rows of different policies really see their own models when packed.
    alone = forward(second, [datums[0]], pack=False).logprobs[0]
    joint = forward(owners, datums, pack=True).logprobs[0]
    assert not torch.allclose(joint, alone)


def test_it_packs_by_default_only_when_it_saves_work(engine, monkeypatch):
    policy = engine.create_policy(rank=4, alpha=8)
    gen = torch.Generator().manual_seed(2)
    plans: list[packing.PackPlan | None] = []
    real_plan = packing.plan

    def recording_plan(*args, **kwargs):
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(packing, "plan", recording_plan)
    forward(policy, [rl_datum(gen, n) for n in LENGTHS])
    forward(policy, [rl_datum(gen, 16) for _ in range(4)])
    assert plans[0] is not None and plans[1] is None
