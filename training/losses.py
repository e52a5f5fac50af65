"""Per-token losses, summed over tokens (the Tinker convention).

Every loss sees the padded batch: `logprobs` (B, T) are the trained policy's log-probabilities of
the target tokens (with grad), `inputs` the datums' `loss_fn_inputs` padded to (B, T), and `mask`
(B, T) is 1 where a token carries loss: inside the datum and, for RL, where the datum's explicit
`mask` says so. A missing `mask` means every target token counts; it is never inferred from a
zero advantage.

Each loss returns the summed scalar loss and metrics named "name:reduction".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from training.loss_config import loss_config


@dataclass
class LossBatch:
    logprobs: torch.Tensor
    """(B, T) target log-probabilities under the policy being trained (requires grad)."""
    inputs: Mapping[str, torch.Tensor]
    """Padded loss_fn_inputs, each (B, T)."""
    mask: torch.Tensor
    """(B, T) float, 1 where the token carries loss."""

    def require(self, key: str, loss_name: str) -> torch.Tensor:
        if key not in self.inputs:
            raise ValueError(f"loss {loss_name!r} needs loss_fn_inputs[{key!r}] on every datum")
        return self.inputs[key]


LossResult = tuple[torch.Tensor, dict[str, torch.Tensor]]
LossFn = Callable[[LossBatch, Mapping[str, float]], LossResult]


def _config(config: Mapping[str, float] | None, loss: str) -> dict[str, float]:
    return loss_config(loss, config)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _rl_common(batch: LossBatch, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log ratio train/sampler, advantages, metrics-ready mask)."""
    sampler_logprobs = batch.require("logprobs", name)
    advantages = batch.require("advantages", name)
    log_ratio = batch.logprobs - sampler_logprobs
    return log_ratio, advantages, batch.mask


def _kl_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    # Estimators of KL(sampler || trained) from sampler tokens (Schulman's k1 and k3).
    r = log_ratio.detach()
    return {
        "kl_sample_train_k1:mean": _masked_mean(-r, mask),
        "kl_sample_train_k3:mean": _masked_mean(torch.expm1(r) - r, mask),
        "ratio:mean": _masked_mean(torch.exp(r), mask),
    }


def cross_entropy(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """-sum(weights * logprob). Weights may be any float, negative included."""
    _config(config, "cross_entropy")
    weights = batch.require("weights", "cross_entropy")
    per_token = -batch.logprobs * weights * batch.mask
    loss = per_token.sum()
    weighted = (weights * batch.mask).abs().sum()
    return loss, {
        "loss:sum": loss.detach(),
        # Per-weight mean: the number people compare across batches as "the SFT loss".
        "loss:mean": loss.detach() / weighted.clamp(min=1e-12),
        "weights:sum": (weights * batch.mask).sum(),
    }


def importance_sampling(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """-sum(exp(logprob - sampler_logprob) * advantage): the off-policy-corrected gradient."""
    _config(config, "importance_sampling")
    log_ratio, advantages, mask = _rl_common(batch, "importance_sampling")
    per_token = -torch.exp(log_ratio) * advantages * mask
    loss = per_token.sum()
    return loss, {"loss:sum": loss.detach(), **_kl_metrics(log_ratio, mask)}


def ppo(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """Clipped surrogate: -sum(min(ratio * A, clip(ratio, low, high) * A))."""
    cfg = _config(config, "ppo")
    low, high = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if not 0 <= low <= 1 <= high:
        raise ValueError(
            f"ppo: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {cfg}"
        )
    log_ratio, advantages, mask = _rl_common(batch, "ppo")
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, low, high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    loss = -(objective * mask).sum()
    was_clipped = ((ratio * advantages) != objective).float()
    return loss, {
        "loss:sum": loss.detach(),
        "clip_frac:mean": _masked_mean(was_clipped, mask),
        **_kl_metrics(log_ratio, mask),
    }


def cispo(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """-sum(sg(clip(ratio, low, high)) * A * logprob): clipped IS weight; every token has a grad."""
    cfg = _config(config, "cispo")
    low, high = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if not 0 <= low <= 1 <= high:
        raise ValueError(
            f"cispo: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {cfg}"
        )
    log_ratio, advantages, mask = _rl_common(batch, "cispo")
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, low, high)
    loss = -(weight * advantages * batch.logprobs * mask).sum()
    return loss, {
        "loss:sum": loss.detach(),
        "clip_frac:mean": _masked_mean((weight != ratio).float(), mask),
        **_kl_metrics(log_ratio, mask),
    }


def dro(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """-sum(logprob * A - beta/2 * (logprob - sampler_logprob)^2)."""
    cfg = _config(config, "dro")
    if cfg["beta"] < 0:
        raise ValueError(f"dro: beta must be >= 0, got {cfg['beta']}")
    log_ratio, advantages, mask = _rl_common(batch, "dro")
    objective = batch.logprobs * advantages - 0.5 * cfg["beta"] * log_ratio.square()
    loss = -(objective * mask).sum()
    return loss, {"loss:sum": loss.detach(), **_kl_metrics(log_ratio, mask)}


def gspo(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """Sequence-level clipped ratio (GSPO): s = exp(mean log ratio over the row's masked tokens).

    `sequence_ratio_mask` (optional) restricts the tokens that enter s. Token t of row i uses
    s_i * exp(logprob - sg(logprob)) (value s_i, gradient of its own logprob), clipped at the
    sequence level and divided by the row's token count, so summing over tokens gives one term
    per sequence.
    """
    cfg = _config(config, "gspo")
    low, high = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if not 0 <= low <= 1 <= high:
        raise ValueError(
            f"gspo: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {cfg}"
        )
    log_ratio, advantages, mask = _rl_common(batch, "gspo")
    tokens_B = mask.sum(dim=1).clamp(min=1.0)
    ratio_mask = mask
    if "sequence_ratio_mask" in batch.inputs:
        ratio_mask = batch.inputs["sequence_ratio_mask"] * mask
    seq_log_ratio_B = (log_ratio * ratio_mask).sum(dim=1) / ratio_mask.sum(dim=1).clamp(min=1.0)
    token_log_ratio = seq_log_ratio_B.detach()[:, None] + batch.logprobs - batch.logprobs.detach()
    ratio = torch.exp(token_log_ratio)
    clipped = torch.clamp(ratio, low, high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    loss = -(objective * mask / tokens_B[:, None]).sum()
    rows = (mask.sum(dim=1) > 0).float()
    seq_ratio_B = torch.exp(seq_log_ratio_B.detach())
    seq_clipped = ((seq_ratio_B < low) | (seq_ratio_B > high)).float()
    return loss, {
        "loss:sum": loss.detach(),
        "clip_frac:mean": (seq_clipped * rows).sum() / rows.sum().clamp(min=1.0),
        **_kl_metrics(log_ratio, mask),
    }


def stable_reinforce(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """REINFORCE with a truncated, stop-gradient importance weight and an optional KL anchor.

    The Tinker SDK names this loss and its inputs but does not publish its formula; this is
    ours. For each masked token: ``w = sg(min(exp(logprob - sampler_logprob), ratio_cap))``
    and the loss is ``-sum(w * A * logprob) + kl_coeff * sum(exp(r) - 1 - r)`` with
    ``r = logprob - sampler_logprob`` (Schulman's k3 estimate of KL(sampler || trained),
    summed over sampled tokens). Why it stays stable off-policy: the weight never exceeds
    ``ratio_cap`` and carries no gradient, so a stale or numerically different sampler cannot
    blow the step up, while every token keeps its REINFORCE gradient (unlike PPO clipping,
    which zeroes it).

    ``sampler_logprob`` is ``loss_fn_inputs["logprobs"]``; the server overwrites it on sampled
    positions with what it recorded at sampling time (``record_stability_info``).
    The server also sets the datum's ``mask`` to the positions its provenance spans name as
    sampled tokens, so the KL term never acts on prompt tokens (and it rejects a nonzero
    advantage elsewhere, as the cookbook documents).
    """
    cfg = _config(config, "stable_reinforce")
    if cfg["kl_coeff"] < 0:
        raise ValueError(f"stable_reinforce: kl_coeff must be >= 0, got {cfg['kl_coeff']}")
    if cfg["ratio_cap"] < 1:
        raise ValueError(f"stable_reinforce: ratio_cap must be >= 1, got {cfg['ratio_cap']}")
    log_ratio, advantages, mask = _rl_common(batch, "stable_reinforce")
    token_mask = mask
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, max=cfg["ratio_cap"])
    pg = -(weight * advantages * batch.logprobs * token_mask).sum()
    k3 = torch.expm1(log_ratio) - log_ratio
    kl = (k3 * token_mask).sum()
    loss = pg + cfg["kl_coeff"] * kl
    return loss, {
        "loss:sum": loss.detach(),
        "kl_penalty:sum": kl.detach(),
        "truncated_frac:mean": _masked_mean((ratio > cfg["ratio_cap"]).float(), token_mask),
        **_kl_metrics(log_ratio, token_mask),
    }


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}


def get_loss(loss_fn: str | LossFn) -> LossFn:
    """A built-in loss by name, or a callable with the same signature (a custom loss)."""
    if callable(loss_fn):
        return loss_fn
    try:
        return LOSSES[loss_fn]
    except KeyError:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; choose one of {sorted(LOSSES)}") from None
