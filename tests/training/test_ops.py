"""forward / forward_backward / optim_step: padding, multi-policy batches, accumulation, AdamW."""

from __future__ import annotations

import pytest
import torch

from training.engine import Engine
from training.ops import forward, forward_backward, optim_step, optim_steps
from training.types import AdamParams, Datum


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return Engine(tiny_model, tokenizer=tiny_tokenizer)


def rl_datum(gen: torch.Generator, length: int, mask_prefix: int = 2) -> Datum:
    mask = torch.ones(length)
    mask[:mask_prefix] = 0
    return Datum(
        model_input=torch.randint(3, 290, (length,), generator=gen),
        loss_fn_inputs={
            "target_tokens": torch.randint(3, 290, (length,), generator=gen),
            "logprobs": -torch.rand(length, generator=gen) * 6,
            "advantages": torch.randn(length, generator=gen),
            "mask": mask,
        },
    )


def warm(policy, seed: int) -> None:
    """Give B non-zero values so both A and B receive gradients and policies differ."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, b in policy.lora_weights.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)


def grads(policy) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in policy.named_parameters()}


def test_it_matches_an_unbatched_reference_with_mixed_lengths(engine):
    policy = engine.create_policy(rank=4, alpha=8, seed=0)
    warm(policy, 1)
    gen = torch.Generator().manual_seed(0)
    datums = [rl_datum(gen, n) for n in (9, 3, 14, 6)]
    batched = forward_backward(policy, datums, "ppo")
    batched_grads = grads(policy)
    policy.zero_grad()
    total = 0.0
    for i, datum in enumerate(datums):
        alone = forward_backward(policy, [datum], "ppo")
        torch.testing.assert_close(batched.logprobs[i], alone.logprobs[0], atol=1e-5, rtol=0)
        assert batched.logprobs[i].shape == (datum.length,)
        total += alone.metrics["loss:sum"]
    assert batched.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)
    assert batched.metrics["tokens:sum"] == sum(d.length - 2 for d in datums)
    # Gradients accumulated over four single calls equal the batched call's.
    for name, g in grads(policy).items():
        torch.testing.assert_close(g, batched_grads[name], atol=1e-5, rtol=1e-4)


def test_it_routes_several_policies_in_one_call(engine):
    first = engine.create_policy(rank=4, alpha=8, seed=1, target_modules=["q_proj", "v_proj"])
    second = engine.create_policy(rank=2, alpha=4, seed=2)
    full = engine.create_policy(full_finetune=True)
    warm(first, 3)
    warm(second, 4)
    gen = torch.Generator().manual_seed(1)
    datums = [rl_datum(gen, n) for n in (5, 8, 7, 4, 6)]
    owners = [first, second, full, second, first]
    joint = forward_backward(owners, datums, "importance_sampling")
    joint_grads = {p.id: grads(p) for p in (first, second, full)}
    for p in (first, second, full):
        p.zero_grad()
    for p in (first, second, full):
        rows = [i for i, o in enumerate(owners) if o is p]
        alone = forward_backward(p, [datums[i] for i in rows], "importance_sampling")
        for j, i in enumerate(rows):
            torch.testing.assert_close(joint.logprobs[i], alone.logprobs[j], atol=1e-5, rtol=0)
        for name, g in grads(p).items():
            torch.testing.assert_close(joint_grads[p.id][name], g, atol=1e-5, rtol=1e-4)
    # Rows of different policies really see different models.
    assert not torch.allclose(joint.logprobs[0][:4], forward(second, [datums[0]]).logprobs[0][:4])


def test_it_computes_forward_without_gradients(engine):
    policy = engine.create_policy(rank=4, alpha=8)
    datums = [rl_datum(torch.Generator().manual_seed(2), 6)]
    result = forward(policy, datums, "cispo")
    assert all(p.grad is None for p in policy.parameters())
    assert "loss:sum" in result.metrics and "clip_frac:mean" in result.metrics
    assert forward(policy, datums).metrics == {}


def test_it_applies_adamw_with_clipping(engine, tiny_tokenizer):
    policy = engine.create_policy(rank=4, alpha=8, seed=5)
    warm(policy, 6)
    datum = Datum.from_sequence(tiny_tokenizer("12+34=46 and more")["input_ids"])
    forward_backward(policy, [datum], "cross_entropy")
    reference = [p.detach().clone().requires_grad_(True) for p in policy.parameters()]
    for r, p in zip(reference, policy.parameters(), strict=True):
        r.grad = p.grad.clone()
    norm = torch.linalg.vector_norm(torch.stack([g.grad.norm() for g in reference])).item()
    clip = norm / 4
    adam = AdamParams(
        learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=clip
    )
    out = optim_step(policy, adam)
    assert out["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert out["step"] == 1.0 and out["skipped"] == 0.0
    for r in reference:
        r.grad.mul_(clip / norm)
    ref_opt = torch.optim.AdamW(reference, lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    ref_opt.step()
    for r, p in zip(reference, policy.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-5)
        assert p.grad is None


def test_it_skips_a_step_with_non_finite_gradients(engine, tiny_tokenizer):
    policy = engine.create_policy(rank=4, alpha=8)
    datum = Datum.from_sequence(tiny_tokenizer("1+1=2")["input_ids"], weights=[float("inf")] * 4)
    before = [p.clone() for p in policy.parameters()]
    forward_backward(policy, [datum], "cross_entropy")
    out = optim_step(policy)
    assert out["skipped"] == 1.0 and policy.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters(), strict=True))


def test_it_steps_several_policies_at_once_as_one_by_one(engine, tiny_tokenizer):
    datum = Datum.from_sequence(tiny_tokenizer("12+34=46 and more")["input_ids"])
    bad = Datum.from_sequence(tiny_tokenizer("1+1=2")["input_ids"], weights=[float("inf")] * 4)
    # Two policies share hyperparameters (one foreach update), one has its own and clips,
    # one has a non-finite gradient and is skipped; each is stepped twice (state reused).
    adams = [
        AdamParams(learning_rate=1e-2, weight_decay=0.1),
        AdamParams(learning_rate=1e-2, weight_decay=0.1),
        AdamParams(learning_rate=3e-3, beta1=0.8, grad_clip_norm=1e-3),
        AdamParams(learning_rate=1e-2),
    ]

    def make() -> list:
        policies = [engine.create_policy(rank=4, alpha=8, seed=10 + i) for i in range(4)]
        for i, p in enumerate(policies):
            warm(p, 20 + i)
        return policies

    def backward(policies: list) -> None:
        for i, p in enumerate(policies):
            forward_backward(p, [bad if i == 3 else datum], "cross_entropy")

    together, alone = make(), make()
    for _ in range(2):
        backward(together)
        batched = optim_steps(together, adams)
        backward(alone)
        single = [optim_step(p, a) for p, a in zip(alone, adams, strict=True)]
        for got, want in zip(batched, single, strict=True):
            assert got == pytest.approx(want, rel=1e-5, nan_ok=True)
    assert [b["skipped"] for b in batched] == [0.0, 0.0, 0.0, 1.0]
    assert [p.step for p in together] == [2, 2, 2, 0]
    for a, b in zip(together, alone, strict=True):
        for x, y in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(x.detach(), y.detach(), atol=1e-6, rtol=1e-5)
            assert x.grad is None
        assert a.optimizer.state_dict()["state"].keys() == b.optimizer.state_dict()["state"].keys()
    with pytest.raises(ValueError, match="twice"):
        optim_steps([together[0], together[0]], adams[:2])


def test_it_rejects_bad_calls(engine):
    policy = engine.create_policy(rank=4, alpha=8)
    gen = torch.Generator().manual_seed(3)
    datums = [rl_datum(gen, 4), rl_datum(gen, 5)]
    with pytest.raises(ValueError, match="2 datums"):
        forward_backward([policy], datums, "ppo")
    with pytest.raises(ValueError, match="unknown loss_fn"):
        forward_backward(policy, datums, "nope")
    with pytest.raises(ValueError, match="needs loss_fn_inputs\\['weights'\\]"):
        forward_backward(policy, datums, "cross_entropy")
    with pytest.raises(ValueError, match="no datums"):
        forward(policy, [])
    with pytest.raises(ValueError, match="length"):
        Datum(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3]})
    with pytest.raises(ValueError, match="unknown keys"):
        Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": [2, 3], "reward": [1, 1]})
    other = Engine(type(engine.model)(engine.model.config)).create_policy(rank=4, alpha=8)
    with pytest.raises(ValueError, match="same engine"):
        forward_backward([policy, other], datums, "ppo")


def test_it_returns_the_model_log_probs_on_every_position(engine, monkeypatch):
    policy = engine.create_policy(rank=4, alpha=8, seed=7)
    warm(policy, 8)
    gen = torch.Generator().manual_seed(4)
    datums = [rl_datum(gen, n, mask_prefix=3) for n in (7, 4)]
    fast = forward_backward(policy, datums, "importance_sampling")
    policy.zero_grad()
    # The generic path (full logits from model(...)) must agree with the head-on-demand path.
    monkeypatch.setattr("training.ops._PLAIN_HEAD_MODEL_TYPES", frozenset())
    generic = forward_backward(policy, datums, "importance_sampling")
    for i, datum in enumerate(datums):
        with torch.no_grad(), engine.host.route([policy.id]):
            logits = engine.model(input_ids=datum.model_input[None]).logits[0]
        targets = datum.loss_fn_inputs["target_tokens"]
        expected = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
        torch.testing.assert_close(fast.logprobs[i], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(generic.logprobs[i], expected, atol=1e-5, rtol=0)
    assert fast.metrics["loss:sum"] == pytest.approx(generic.metrics["loss:sum"], rel=1e-5)


@pytest.mark.parametrize("full_finetune", [False, True])
def test_it_chunks_a_large_head_with_the_same_values_and_gradients(
    engine, monkeypatch, full_finetune
):
    policy = engine.create_policy(rank=4, alpha=8, seed=9, full_finetune=full_finetune)
    if not full_finetune:
        warm(policy, 10)
    gen = torch.Generator().manual_seed(5)
    datums = [rl_datum(gen, n, mask_prefix=1) for n in (9, 5)]
    whole = forward_backward(policy, datums, "dro", {"beta": 0.1})
    whole_grads = grads(policy)
    policy.zero_grad()
    # 7 positions' worth of logits per chunk: several chunks, a ragged last one.
    monkeypatch.setattr("training.ops._HEAD_CHUNK_ELEMENTS", 7 * engine.model.config.vocab_size)
    chunked = forward_backward(policy, datums, "dro", {"beta": 0.1})
    for a, b in zip(whole.logprobs, chunked.logprobs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for name, g in grads(policy).items():
        torch.testing.assert_close(g, whole_grads[name], atol=1e-5, rtol=1e-4)
