"""The optional vLLM sampler: same interface, hot-reloaded snapshots. CUDA + vllm only."""

from __future__ import annotations

import pytest
import torch

from training.vllm_sampler import VLLMSampler, VLLMUnavailable, vllm_unavailable_reason

REASON = vllm_unavailable_reason()


def test_it_explains_why_it_cannot_start_without_cuda_or_vllm():
    if REASON is None:
        pytest.skip("vLLM is available here; the refusal path cannot be exercised")
    with pytest.raises(VLLMUnavailable, match="needs CUDA and vllm"):
        VLLMSampler(engine=None)


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"vLLM sampler needs CUDA and vllm: {REASON}")
def test_it_samples_snapshots_and_hot_reloads_the_newest():
    from training.engine import Engine
    from training.model import DEFAULT_BASE_MODEL
    from training.sampler import SampleRequest, compute_logprobs
    from training.types import SamplingParams

    engine = Engine(DEFAULT_BASE_MODEL, device="cuda", dtype=torch.float32)
    policy = engine.create_policy(rank=8, alpha=16, seed=0)
    first = policy.snapshot()
    sampler = VLLMSampler(engine, dtype="float32", max_lora_rank=8, enforce_eager=True)
    prompt = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 12+34?"}],
            add_generation_prompt=True,
            tokenize=False,
        ),
        add_special_tokens=False,
    )
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
    seq = sampler.sample([SampleRequest(prompt, params, policy_id=policy.id, version=first)])[0][0]
    scored = compute_logprobs(engine, (policy.id, first), prompt + seq.tokens)[len(prompt) :]
    assert torch.allclose(torch.tensor(seq.logprobs), torch.tensor(scored), atol=2e-3)

    with torch.no_grad():
        for _, b in policy.lora_weights.values():
            b.normal_(0.0, 0.5)
    second = policy.snapshot()
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    new = sampler.sample([SampleRequest(prompt, greedy, policy_id=policy.id, version=second)])[0][0]
    scored = compute_logprobs(engine, (policy.id, second), prompt + new.tokens)[len(prompt) :]
    assert torch.allclose(torch.tensor(new.logprobs), torch.tensor(scored), atol=2e-3)
    with pytest.raises(ValueError, match="older"):
        sampler.sample([SampleRequest(prompt, greedy, policy_id=policy.id, version=first)])
