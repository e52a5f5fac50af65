"""`algorithm.loss_aggregation`: how a managed RL job's loss weighs episodes of different
lengths, on real gradients of the tiny model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from environments.types import Trajectory, Turn
from jobs.spec import parse_spec
from training.engine import Engine
from training.model import load_base
from training.ops import forward_backward
from workers.runners.data_processing import apply_kl_penalty, rl_batch


@pytest.fixture(scope="module")
def engine() -> Engine:
    model, tokenizer = load_base(device="cpu")
    return Engine(model, tokenizer=tokenizer)


def _spec(aggregation: str, **algorithm: Any) -> Any:
    return parse_spec(
        {
            "method": "rl",
            "env": "bandit",
            "algorithm": {"loss_aggregation": aggregation, **algorithm},
        }
    )


def _group() -> list[Trajectory]:
    # One short rewarded episode and one long unrewarded one; sampler logprobs that are not
    # the policy's, so the ratio differs from 1 and dro's penalty is not zero.
    def episode(prompt: list[int], action: list[int], reward: float) -> Trajectory:
        logprobs = [-0.5 - 0.1 * i for i in range(len(action))]
        return Trajectory([Turn(prompt, action, logprobs, reward)])

    return [
        episode([5, 17, 40, 41], [70, 71], 1.0),
        episode([5, 17, 40, 42], [80, 81, 82, 83, 84, 85], 0.0),
    ]


def _grads(engine: Engine, datums: list[Any], loss: str, config: dict[str, float]) -> dict:
    policy = engine.create_policy(rank=4, alpha=8, seed=0)
    with torch.no_grad():
        for _, b in policy.lora_weights.values():
            b.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    try:
        forward_backward(policy, datums, loss, config)
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    finally:
        engine.remove_policy(policy.id)


def test_it_gives_each_episode_a_mask_summing_to_one() -> None:
    by_token = rl_batch(_spec("token_sum"), [_group()]).datums
    by_episode = rl_batch(_spec("sequence_mean"), [_group()]).datums
    assert [float(d.loss_fn_inputs["mask"].sum()) for d in by_token] == [2.0, 6.0]
    for token, episode in zip(by_token, by_episode, strict=True):
        mask = token.loss_fn_inputs["mask"]
        torch.testing.assert_close(episode.loss_fn_inputs["mask"], mask / mask.sum())
        # The advantages themselves are the estimator's: only the weights change.
        torch.testing.assert_close(
            episode.loss_fn_inputs["advantages"], token.loss_fn_inputs["advantages"]
        )


@pytest.mark.parametrize(
    "loss, config",
    [("importance_sampling", {}), ("dro", {"beta": 0.5}), ("ppo", {})],
)
def test_its_gradient_is_the_mean_of_each_episodes_own(
    engine: Engine, loss: str, config: dict[str, float]
) -> None:
    by_token = rl_batch(_spec("token_sum"), [_group()]).datums
    by_episode = rl_batch(_spec("sequence_mean"), [_group()]).datums
    together = _grads(engine, by_episode, loss, config)
    # Each episode alone under the per-token sum, divided by its action-token count.
    expected: dict[str, torch.Tensor] = {}
    for datum in by_token:
        count = float(datum.loss_fn_inputs["mask"].sum())
        for name, grad in _grads(engine, [datum], loss, config).items():
            expected[name] = expected.get(name, torch.zeros_like(grad)) + grad / count
    assert together.keys() == expected.keys() and together
    for name, grad in together.items():
        torch.testing.assert_close(grad, expected[name], atol=1e-6, rtol=1e-4)
    # And it is not the per-token sum's gradient: the long episode no longer dominates.
    summed = _grads(engine, by_token, loss, config)
    assert any(not torch.allclose(summed[n], together[n], rtol=1e-2) for n in together)


def test_the_kl_penalty_stays_per_token_under_either_aggregation(engine: Engine) -> None:
    by_token = rl_batch(_spec("token_sum", kl_coef=0.1), [_group()]).datums
    by_episode = rl_batch(_spec("sequence_mean", kl_coef=0.1), [_group()]).datums
    kl_token = apply_kl_penalty(engine, by_token, 0.1)
    kl_episode = apply_kl_penalty(engine, by_episode, 0.1)
    assert kl_episode == pytest.approx(kl_token, rel=1e-6) and kl_token != 0.0
    for token, episode in zip(by_token, by_episode, strict=True):
        torch.testing.assert_close(
            episode.loss_fn_inputs["advantages"], token.loss_fn_inputs["advantages"]
        )


def test_a_bad_aggregation_is_refused_naming_the_field() -> None:
    from jobs.spec_sections import SpecError

    with pytest.raises(SpecError) as caught:
        _spec("token_mean")
    assert "algorithm.loss_aggregation" in [e["field"] for e in caught.value.errors]
