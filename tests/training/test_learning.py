"""Learning happens: SFT and a GRPO loop improve the project's tiny model on held-out additions.

Fixed seeds and loose thresholds: these check that the engine learns, not how fast.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from training import data
from training.engine import Engine
from training.model import DEFAULT_BASE_MODEL
from training.ops import forward, forward_backward, optim_step
from training.rl import grpo, sample_to_datum
from training.sampler import SampleRequest, sample
from training.types import AdamParams, Datum, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (Path(DEFAULT_BASE_MODEL) / "config.json").is_file(),
        reason="models/tiny-chat is not built (python scripts/build_tiny_model.py)",
    ),
]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    # One thread: on a shared 2-core machine two spinning threads lose more than they gain.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine(DEFAULT_BASE_MODEL, device="cpu")
    torch.set_num_threads(threads)


def prompt_tokens(engine: Engine, question: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return engine.tokenizer.encode(text, add_special_tokens=False)


def answer_format() -> str:
    """The addition answer format the base model was pre-trained on (SFT must keep it)."""
    report = Path(DEFAULT_BASE_MODEL) / "build_report.json"
    if report.is_file():
        return json.loads(report.read_text()).get("answer_format", "equation")
    return "equation"


def sft_datum(engine: Engine, problem: data.AdditionProblem, template: int) -> Datum:
    """Prompt then the reference answer, as the chat template renders it; loss on the answer."""
    conversation = data.addition_chat(problem, template, answer_format())
    prompt = prompt_tokens(engine, conversation[0]["content"])
    text = engine.tokenizer.apply_chat_template(conversation, tokenize=False)
    tokens = engine.tokenizer.encode(text, add_special_tokens=False)
    if tokens[: len(prompt)] != prompt:
        raise AssertionError("the rendered conversation does not start with the rendered prompt")
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt))
    return Datum.from_sequence(tokens, weights)


def reward(engine: Engine, problem: data.AdditionProblem, tokens: list[int]) -> float:
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    return float(data.final_answer(text) == str(problem.answer))


def mean_reward(
    engine: Engine,
    policy_id: str,
    version: int,
    problems: list[data.AdditionProblem],
    params: SamplingParams,
    n: int,
) -> float:
    requests = [
        SampleRequest(prompt_tokens(engine, p.question()), params, n, policy_id, version)
        for p in problems
    ]
    results = sample(engine, requests)
    scores = [reward(engine, p, s.tokens) for p, seqs in zip(problems, results) for s in seqs]
    return sum(scores) / len(scores)


def test_it_lowers_heldout_loss_and_raises_accuracy_with_sft(engine: Engine) -> None:
    train, _, test = data.addition_split()
    heldout = test[:64]
    heldout_datums = [sft_datum(engine, p, 0) for p in heldout]
    policy = engine.create_policy(rank=8, alpha=16, seed=0, policy_id="sft")
    greedy = SamplingParams(max_tokens=16, temperature=0.0)

    def heldout_loss() -> float:
        metrics = forward(policy, heldout_datums, "cross_entropy").metrics
        return metrics["loss:sum"] / metrics["weights:sum"]

    loss_before = heldout_loss()
    acc_before = mean_reward(engine, "sft", policy.snapshot(), heldout, greedy, 1)
    rng = random.Random(0)
    adam = AdamParams(learning_rate=2e-3)
    for _ in range(60):
        batch = [sft_datum(engine, p, rng.randrange(6)) for p in rng.sample(train, 32)]
        forward_backward(policy, batch, "cross_entropy")
        optim_step(policy, adam)
    loss_after = heldout_loss()
    acc_after = mean_reward(engine, "sft", policy.snapshot(), heldout, greedy, 1)
    print(
        f"sft held-out loss {loss_before:.3f} -> {loss_after:.3f}, "
        f"acc {acc_before:.2f} -> {acc_after:.2f}"
    )
    assert loss_after < 0.8 * loss_before
    assert acc_after >= acc_before + 0.1
    engine.remove_policy("sft")


def test_it_raises_mean_reward_with_a_grpo_loop(engine: Engine) -> None:
    train, _, test = data.addition_split()
    heldout = test[:32]
    policy = engine.create_policy(rank=8, alpha=16, seed=1, policy_id="grpo")
    version = policy.snapshot()
    evaluate = SamplingParams(max_tokens=16, temperature=1.0, seed=123)
    heldout_before = mean_reward(engine, "grpo", version, heldout, evaluate, 4)
    rng = random.Random(1)
    adam = AdamParams(learning_rate=1e-3)
    group = 8
    step_rewards = []
    for step in range(30):
        problems = rng.sample(train, 16)
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=1000 + step)
        prompts = [prompt_tokens(engine, p.question()) for p in problems]
        requests = [SampleRequest(t, params, group, "grpo", version) for t in prompts]
        datums, rewards_all = [], []
        for problem, prompt, seqs in zip(problems, prompts, sample(engine, requests)):
            rewards = [reward(engine, problem, s.tokens) for s in seqs]
            rewards_all += rewards
            for seq, adv in zip(seqs, grpo(rewards, normalize_std=True).tolist()):
                datums.append(sample_to_datum(prompt, seq, adv))
        metrics = forward_backward(policy, datums, "importance_sampling").metrics
        # On-policy: the sampler's logprobs are the trained policy's, token for token.
        assert abs(metrics["kl_sample_train_k1:mean"]) < 1e-3
        optim_step(policy, adam)
        policy.release(version)
        version = policy.snapshot()
        step_rewards.append(sum(rewards_all) / len(rewards_all))
    first, last = sum(step_rewards[:5]) / 5, sum(step_rewards[-5:]) / 5
    heldout_after = mean_reward(engine, "grpo", version, heldout, evaluate, 4)
    print(
        f"grpo train reward {first:.2f} -> {last:.2f}, "
        f"held-out {heldout_before:.2f} -> {heldout_after:.2f}"
    )
    assert last >= first + 0.08
    # Rising train reward with a collapsing held-out score would mean memorising, not learning.
    assert heldout_after >= heldout_before - 0.05
    engine.remove_policy("grpo")
