"""The stable_reinforce loss: truncated stop-gradient IS weight, REINFORCE gradient, KL anchor."""

from __future__ import annotations

import math

import pytest
import torch

from training.losses import LOSSES, LossBatch, get_loss


def _batch(
    logprobs: list[list[float]],
    sampler: list[list[float]],
    advantages: list[list[float]],
    mask: list[list[float]] | None = None,
) -> tuple[torch.Tensor, LossBatch]:
    lp = torch.tensor(logprobs, dtype=torch.float32, requires_grad=True)
    inputs = {"logprobs": torch.tensor(sampler), "advantages": torch.tensor(advantages)}
    m = torch.ones_like(lp) if mask is None else torch.tensor(mask)
    return lp, LossBatch(lp, inputs, m)


def test_it_is_registered_under_the_sdk_name() -> None:
    assert get_loss("stable_reinforce") is LOSSES["stable_reinforce"]


def test_it_weights_the_reinforce_gradient_by_the_truncated_ratio() -> None:
    # Token 0: ratio e^0.2 (under the cap); token 1: ratio e^3 (truncated to 2).
    lp, b = _batch([[-1.0, -0.5]], [[-1.2, -3.5]], [[2.0, 1.0]])
    loss, metrics = LOSSES["stable_reinforce"](b, {})
    w0, w1 = math.exp(0.2), 2.0
    assert loss.item() == pytest.approx(-(w0 * 2.0 * -1.0 + w1 * 1.0 * -0.5), rel=1e-6)
    loss.backward()
    # The weight carries no gradient: d/dlp = -w * A, never exp(ratio)-shaped.
    assert lp.grad.tolist()[0] == pytest.approx([-w0 * 2.0, -w1 * 1.0], rel=1e-6)
    assert metrics["truncated_frac:mean"].item() == pytest.approx(0.5)


def test_it_keeps_a_gradient_on_far_off_policy_tokens() -> None:
    # PPO would zero this token's gradient (ratio far above its clip, positive advantage);
    # stable_reinforce keeps it, bounded by the cap.
    lp, b = _batch([[0.0]], [[-10.0]], [[1.0]])
    loss, _ = LOSSES["stable_reinforce"](b, {"ratio_cap": 3.0})
    loss.backward()
    assert lp.grad.item() == pytest.approx(-3.0)
    lp2, b2 = _batch([[0.0]], [[-10.0]], [[1.0]])
    ppo_loss, _ = LOSSES["ppo"](b2, {})
    ppo_loss.backward()
    assert lp2.grad.item() == 0.0


def test_it_adds_a_k3_kl_penalty_only_on_masked_tokens() -> None:
    lp, b = _batch([[-1.0, -0.5, -2.0]], [[-1.5, -0.5, -0.1]], [[0.0, 0.0, 0.0]], [[1.0, 1.0, 0.0]])
    loss, metrics = LOSSES["stable_reinforce"](b, {"kl_coeff": 0.5})
    r = 0.5
    assert metrics["kl_penalty:sum"].item() == pytest.approx(math.expm1(r) - r, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * (math.expm1(r) - r), rel=1e-6)
    loss.backward()
    # d/dlp of kl_coeff * (e^r - 1 - r) is kl_coeff * (e^r - 1); zero where the ratio is 1
    # and on the unmasked third token.
    assert lp.grad.tolist()[0] == pytest.approx([0.5 * math.expm1(r), 0.0, 0.0], abs=1e-6)


def test_it_matches_plain_reinforce_on_policy() -> None:
    _, b = _batch([[-1.0, -2.0]], [[-1.0, -2.0]], [[1.5, -0.5]])
    loss, metrics = LOSSES["stable_reinforce"](b, {"kl_coeff": 0.1})
    assert loss.item() == pytest.approx(-(1.5 * -1.0 + -0.5 * -2.0), rel=1e-6)
    assert metrics["kl_sample_train_k1:mean"].item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"kl_coeff": -1.0}, "kl_coeff"),
        ({"ratio_cap": 0.5}, "ratio_cap"),
        ({"clip_low_threshold": 0.8}, "unknown loss_fn_config"),
    ],
)
def test_it_rejects_bad_config(config: dict[str, float], message: str) -> None:
    _, b = _batch([[-1.0]], [[-1.0]], [[1.0]])
    with pytest.raises(ValueError, match=message):
        LOSSES["stable_reinforce"](b, config)


def test_it_names_the_missing_input() -> None:
    lp = torch.zeros(1, 2, requires_grad=True)
    b = LossBatch(lp, {"advantages": torch.ones(1, 2)}, torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"stable_reinforce.*logprobs"):
        LOSSES["stable_reinforce"](b, {})
