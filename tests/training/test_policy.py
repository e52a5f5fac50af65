"""Policies: peft-like init, immutable snapshots, exact resume, PEFT export, full fine-tuning."""

from __future__ import annotations

import json
import math

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from training.checkpoint import CheckpointDir
from training.engine import Engine
from training.ops import forward, forward_backward, optim_step
from training.types import AdamParams, Datum

ADAM = AdamParams(learning_rate=5e-3)


@pytest.fixture
def engine(tiny_model, tiny_tokenizer):
    return Engine(tiny_model, tokenizer=tiny_tokenizer)


def datums_for(tokenizer, texts):
    return [Datum.from_sequence(tokenizer(t)["input_ids"]) for t in texts]


TEXTS = ["12+34=46", "the quick brown fox 7+8=15", "99+1=100", "lazy dog"]


def train_steps(policy, datums, steps, generator=None):
    losses = []
    for _ in range(steps):
        batch = datums
        if generator is not None:
            order = torch.randperm(len(datums), generator=generator)[:2].tolist()
            batch = [datums[i] for i in order]
        losses.append(forward_backward(policy, batch, "cross_entropy").metrics["loss:sum"])
        optim_step(policy, ADAM)
    return losses


def test_it_initialises_lora_like_peft(engine, tiny_model_factory):
    policy = engine.create_policy(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=3)
    assert len(policy.lora_weights) == 4
    for a, b in policy.lora_weights.values():
        assert torch.count_nonzero(b) == 0
        bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform(a=sqrt(5)) on fan_in
        assert a.abs().max() <= bound and a.abs().max() > 0.5 * bound
    again = Engine(tiny_model_factory()).create_policy(
        rank=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=3
    )
    for name, (a, _) in policy.lora_weights.items():
        torch.testing.assert_close(a, again.lora_weights[name][0], rtol=0, atol=0)
    other = engine.create_policy(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=4)
    name = next(iter(policy.lora_weights))
    assert not torch.equal(policy.lora_weights[name][0], other.lora_weights[name][0])


def test_it_never_mutates_a_published_snapshot(engine, tiny_tokenizer):
    policy = engine.create_policy(rank=4, alpha=8, seed=0)
    datums = datums_for(tiny_tokenizer, TEXTS)
    train_steps(policy, datums, 2)
    version = policy.snapshot()
    frozen = {k: (a.clone(), b.clone()) for k, (a, b) in policy.version_weights(version).items()}
    before = forward(policy, datums).logprobs
    train_steps(policy, datums, 3)
    for name, (a, b) in policy.version_weights(version).items():
        assert torch.equal(a, frozen[name][0]) and torch.equal(b, frozen[name][1])
        assert not a.requires_grad
    # The live weights did move, and the snapshot key still routes the old weights.
    after = forward(policy, datums).logprobs
    assert any(not torch.allclose(x, y) for x, y in zip(before, after, strict=True))
    ids = datums[0].model_input[None]
    with torch.no_grad(), engine.host.route([policy.version_key(version)]):
        snap_logits = engine.model(input_ids=ids).logits
    targets = datums[0].loss_fn_inputs["target_tokens"]
    snap_lp = torch.log_softmax(snap_logits[0], -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(snap_lp, before[0], atol=1e-5, rtol=0)
    assert policy.snapshot() == version + 1
    policy.release(version)
    assert f"{policy.id}@{version}" not in engine.host


def test_it_resumes_bit_for_bit(engine, tiny_model_factory, tiny_tokenizer, tmp_path):
    datums = datums_for(tiny_tokenizer, TEXTS)
    policy = engine.create_policy(rank=4, alpha=8, seed=1)
    train_steps(policy, datums, 3, policy.generator)
    path = policy.save_state(tmp_path / "ckpt.pt")
    assert policy.history[-1].step == 3 and policy.history[-1].path == str(path)
    tail = train_steps(policy, datums, 3, policy.generator)

    resumed_engine = Engine(tiny_model_factory(), tokenizer=tiny_tokenizer)
    resumed = resumed_engine.create_policy(rank=4, alpha=8, seed=99)
    resumed.load_state(path)
    assert resumed.step == 3
    resumed_tail = train_steps(resumed, datums, 3, resumed.generator)
    assert resumed_tail == tail
    for name, param in policy.named_parameters():
        assert torch.equal(param, dict(resumed.named_parameters())[name]), name


def test_it_rejects_a_checkpoint_of_another_shape(engine, tmp_path):
    path = engine.create_policy(rank=4, alpha=8).save_state(tmp_path / "a.pt")
    with pytest.raises(ValueError, match="does not match"):
        engine.create_policy(rank=8, alpha=8).load_state(path)


def test_it_exports_a_peft_adapter_with_the_same_logits(
    engine, tiny_model_factory, tiny_tokenizer, tmp_path
):
    policy = engine.create_policy(rank=4, alpha=16, target_modules=["q_proj", "up_proj"], seed=2)
    datums = datums_for(tiny_tokenizer, TEXTS)
    train_steps(policy, datums, 3)
    version = policy.snapshot()
    out = policy.export_peft(version, tmp_path / "adapter")

    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 16
    assert sorted(config["target_modules"]) == ["q_proj", "up_proj"]
    tensors = load_file(out / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors)

    peft_model = PeftModel.from_pretrained(tiny_model_factory(), str(out)).eval()
    ids = datums[1].model_input[None]
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        with engine.host.route([policy.version_key(version)]):
            got = engine.model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    with pytest.raises(KeyError):
        policy.export_peft(version + 5, tmp_path / "nope")


def test_it_fine_tunes_a_private_copy_without_touching_the_base(engine, tiny_tokenizer):
    base_before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    policy = engine.create_policy(full_finetune=True, seed=0)
    assert policy.adapter_key is None
    datums = datums_for(tiny_tokenizer, TEXTS)
    losses = train_steps(policy, datums, 4)
    assert losses[-1] < losses[0]
    version = policy.snapshot()
    frozen = policy.version_model(version)
    for key, value in engine.model.state_dict().items():
        assert torch.equal(value, base_before[key]), key
    train_steps(policy, datums, 1)
    changed = dict(policy.model.named_parameters())
    assert any(not torch.equal(p, changed[name]) for name, p in frozen.named_parameters())
    with pytest.raises(ValueError, match="fully fine-tuned"):
        policy.export_peft(version, "unused")


def test_a_full_fine_tune_of_a_bf16_base_keeps_float32_master_weights(tiny_model, tiny_tokenizer):
    """A GPU engine is bf16. Updated in bf16, a weight keeps its value unless the step exceeds
    half its spacing (about 4e-3 of its size): at lr 1e-5 Adam's first step of 1e-5 moves
    almost no weight of the tiny model. The master copy is float32, the forward computes in
    bf16 under autocast (with or without recomputed activations), and published versions are
    bf16 again."""
    engine = Engine(tiny_model.to(torch.bfloat16), tokenizer=tiny_tokenizer)
    policy = engine.create_policy(full_finetune=True, seed=0)
    lora = engine.create_policy(rank=4, alpha=8, seed=1)
    assert policy.model is not None
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    datums = datums_for(tiny_tokenizer, TEXTS)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    plain = forward_backward(policy, datums, "cross_entropy")
    plain_grads = {n: p.grad.clone() for n, p in policy.model.named_parameters()}
    policy.zero_grad()
    again = forward_backward(policy, datums, "cross_entropy", recompute=True)
    for n, p in policy.model.named_parameters():
        torch.testing.assert_close(p.grad, plain_grads[n], atol=1e-6, rtol=1e-5)
    assert again.metrics == pytest.approx(plain.metrics, rel=1e-6)
    optim_step(policy, AdamParams(learning_rate=1e-5))
    weights = [n for n in before if n.endswith("proj.weight")]
    moved = sum(
        (p != before[n]).float().mean().item()
        for n, p in policy.model.named_parameters()
        if n in weights
    ) / len(weights)
    assert moved > 0.9
    # In bf16 the same step rounds away nearly everywhere: what the master copy is for.
    assert all(
        (before[n].bfloat16() + 1e-5 * torch.sign(plain_grads[n]).bfloat16())
        .eq(before[n].bfloat16())
        .float()
        .mean()
        > 0.9
        for n in weights
    )
    # LoRA rows and the full fine-tune's rows in one batch.
    mixed = forward_backward([policy, lora, policy, lora], datums, "cross_entropy")
    assert math.isfinite(mixed.metrics["loss:sum"])
    version = policy.snapshot()
    frozen = policy.version_model(version)
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        ids = torch.tensor([datums[0].model_input.tolist()])
        with policy.compute():
            live = policy.model(input_ids=ids).logits.float()
        published = frozen(input_ids=ids).logits.float()
    torch.testing.assert_close(published, live, atol=0.05, rtol=0.05)


def test_it_builds_from_a_directory_and_closes_policies(tiny_model_dir):
    engine = Engine(tiny_model_dir)
    assert engine.tokenizer is not None
    policy = engine.create_policy(rank=2, alpha=4, policy_id="alice")
    policy.snapshot()
    assert set(engine.host.keys) == {"alice", "alice@0"}
    assert engine.resolve("alice", 0) == (engine.model, "alice@0")
    engine.remove_policy("alice")
    assert engine.host.keys == []
    with pytest.raises(ValueError, match="'@'"):
        engine.create_policy(policy_id="a@b")


def test_it_resumes_from_the_latest_checkpoint_in_a_directory(engine, tiny_tokenizer, tmp_path):
    datums = datums_for(tiny_tokenizer, TEXTS)
    policy = engine.create_policy(rank=4, alpha=8, seed=1)
    checkpoints = CheckpointDir(tmp_path / "run")
    assert checkpoints.resume(policy) is None
    train_steps(policy, datums, 1)
    checkpoints.save(policy, extra={"cursor": 1})
    train_steps(policy, datums, 1)
    checkpoints.save(policy, extra={"cursor": 2})
    # A torn line from a crash mid-append is ignored.
    with checkpoints.index_path.open("a") as fh:
        fh.write('{"name": "step-0000')
    fresh = engine.create_policy(rank=4, alpha=8, seed=5)
    record = checkpoints.resume(fresh)
    assert record["step"] == 2 and record["extra"] == {"cursor": 2}
    assert fresh.step == 2
    for (name, a), (_, b) in zip(policy.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert [r["name"] for r in checkpoints.records()] == ["step-000001", "step-000002"]
