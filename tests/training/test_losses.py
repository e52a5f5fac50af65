"""Loss formulas on hand-made tensors: values, gradients, clipping and explicit masks."""

from __future__ import annotations

import math

import pytest
import torch

from training.losses import LOSSES, LossBatch, get_loss


def batch(logprobs, sampler=None, advantages=None, mask=None, weights=None):
    lp = torch.tensor(logprobs, dtype=torch.float32, requires_grad=True)
    inputs = {}
    if sampler is not None:
        inputs["logprobs"] = torch.tensor(sampler)
    if advantages is not None:
        inputs["advantages"] = torch.tensor(advantages)
    if weights is not None:
        inputs["weights"] = torch.tensor(weights)
    m = torch.ones_like(lp) if mask is None else torch.tensor(mask)
    return lp, LossBatch(lp, inputs, m)


def test_it_sums_weighted_cross_entropy_with_negative_weights():
    lp, b = batch([[-1.0, -2.0, -3.0]], weights=[[1.0, -0.5, 2.0]], mask=[[1.0, 1.0, 0.0]])
    loss, metrics = LOSSES["cross_entropy"](b, {})
    assert loss.item() == pytest.approx(1.0 * 1 + (-0.5) * 2)
    loss.backward()
    assert lp.grad.tolist() == [[-1.0, 0.5, 0.0]]
    assert metrics["loss:sum"].item() == pytest.approx(0.0)


def test_it_computes_importance_sampling():
    lp, b = batch([[-1.0, -0.5]], sampler=[[-1.2, -0.5]], advantages=[[2.0, -1.0]])
    loss, metrics = LOSSES["importance_sampling"](b, {})
    expected = -(math.exp(0.2) * 2.0 + 1.0 * -1.0)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # d/dlp of -ratio * A is -ratio * A.
    torch.testing.assert_close(lp.grad, torch.tensor([[-math.exp(0.2) * 2.0, 1.0]]))
    assert metrics["kl_sample_train_k1:mean"].item() == pytest.approx(-0.1, abs=1e-6)


def test_it_clips_ppo_at_the_configured_thresholds():
    # ratios e^0.5 (above 1.2, A > 0: clipped), e^-0.5 (below 0.8, A > 0: not clipped, min picks it)
    lp, b = batch([[0.0, -1.0, 0.0]], sampler=[[-0.5, -0.5, -0.5]], advantages=[[1.0, 1.0, -1.0]])
    loss, metrics = LOSSES["ppo"](b, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    r_hi, r_lo = math.exp(0.5), math.exp(-0.5)
    expected = -(1.2 * 1.0 + r_lo * 1.0 + r_hi * -1.0)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # The clipped token has no gradient; the others do.
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(-r_lo, rel=1e-6)
    assert lp.grad[0, 2].item() == pytest.approx(r_hi, rel=1e-6)
    assert metrics["clip_frac:mean"].item() == pytest.approx(1 / 3)
    wide, _ = LOSSES["ppo"](b, {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0})
    assert wide.item() == pytest.approx(-(r_hi + r_lo - r_hi), rel=1e-6)


def test_it_keeps_cispo_gradients_on_clipped_tokens():
    lp, b = batch([[0.0, -1.0]], sampler=[[-0.5, -1.0]], advantages=[[1.0, 2.0]])
    loss, metrics = LOSSES["cispo"](b, {"clip_high_threshold": 1.2})
    assert loss.item() == pytest.approx(-(1.2 * 1.0 * 0.0 + 1.0 * 2.0 * -1.0), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.2, -2.0]]))
    assert metrics["clip_frac:mean"].item() == pytest.approx(0.5)


def test_it_computes_dro_with_beta():
    lp, b = batch([[-1.0]], sampler=[[-1.5]], advantages=[[2.0]])
    loss, _ = LOSSES["dro"](b, {"beta": 0.4})
    assert loss.item() == pytest.approx(-(-1.0 * 2.0 - 0.5 * 0.4 * 0.25), rel=1e-6)
    loss.backward()
    assert lp.grad.item() == pytest.approx(-(2.0 - 0.4 * 0.5), rel=1e-6)


def test_it_uses_one_ratio_per_sequence_in_gspo():
    lp, b = batch(
        [[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]],
        sampler=[[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]],
        advantages=[[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]],
        mask=[[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]],
    )
    loss, _ = LOSSES["gspo"](b, {})
    # On-policy: ratio 1, so the loss is -sum_i A_i (per-token terms divided by the row length).
    assert loss.item() == pytest.approx(-(1.0 - 1.0), abs=1e-6)
    loss.backward()
    torch.testing.assert_close(
        lp.grad, torch.tensor([[-0.5, -0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]), atol=1e-6, rtol=0
    )


def test_it_counts_masked_tokens_with_zero_advantage():
    # A zero advantage does not mask a token: it still enters the KL metrics.
    _, b = batch([[-1.0, -1.0]], sampler=[[-2.0, -1.0]], advantages=[[0.0, 0.0]])
    _, metrics = LOSSES["importance_sampling"](b, {})
    assert metrics["kl_sample_train_k1:mean"].item() == pytest.approx(-0.5)
    _, b = batch([[-1.0, -1.0]], sampler=[[-2.0, -1.0]], advantages=[[0.0, 0.0]], mask=[[0.0, 1.0]])
    _, metrics = LOSSES["importance_sampling"](b, {})
    assert metrics["kl_sample_train_k1:mean"].item() == pytest.approx(0.0)


def test_it_rejects_bad_configs_and_inputs():
    _, b = batch([[-1.0]], sampler=[[-1.0]], advantages=[[1.0]])
    with pytest.raises(ValueError, match="unknown loss_fn_config"):
        LOSSES["ppo"](b, {"clip": 0.2})
    with pytest.raises(ValueError, match="clip_low_threshold <= 1"):
        LOSSES["ppo"](b, {"clip_low_threshold": 1.5})
    with pytest.raises(ValueError, match="beta"):
        LOSSES["dro"](b, {"beta": -1.0})
    _, no_adv = batch([[-1.0]], sampler=[[-1.0]])
    with pytest.raises(ValueError, match="advantages"):
        LOSSES["importance_sampling"](no_adv, {})
    with pytest.raises(ValueError, match="unknown loss_fn"):
        get_loss("mse")


def test_it_restricts_the_gspo_sequence_ratio_to_sequence_ratio_mask():
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    inputs = {
        "logprobs": torch.tensor([[-1.0, -3.0]]),
        "advantages": torch.tensor([[1.0, 1.0]]),
        "sequence_ratio_mask": torch.tensor([[1.0, 0.0]]),
    }
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 100.0}
    loss, _ = LOSSES["gspo"](LossBatch(lp, inputs, torch.ones(1, 2)), wide)
    # Only the first token enters the ratio (log ratio 0), so s = 1 and the loss is -A.
    assert loss.item() == pytest.approx(-1.0, rel=1e-6)
    del inputs["sequence_ratio_mask"]
    loss, _ = LOSSES["gspo"](LossBatch(lp, inputs, torch.ones(1, 2)), wide)
    assert loss.item() == pytest.approx(-math.exp(1.0), rel=1e-6)
