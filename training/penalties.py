"""Per-row logit adjustments of sampling: OpenAI's frequency and presence penalties and logit
bias, shared by `sampler.generate` and the continuous batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from training.types import SamplingParams

__all__ = ["Penalties"]


class Penalties:
    """Per-row logit adjustments: OpenAI's frequency and presence penalties over the tokens a
    row generated so far, and its logit bias. Costs nothing for rows without them: the batch
    keeps no counts unless some row has a penalty, and no bias matrix unless some row has a
    bias. Applied to the logits the token is chosen from (greedy included); the reported
    logprobs stay those of the model's own distribution."""

    def __init__(self, params: Sequence[SamplingParams], vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        self.freq_B = torch.tensor([p.frequency_penalty for p in params], device=device)
        self.pres_B = torch.tensor([p.presence_penalty for p in params], device=device)
        penalised = any(p.frequency_penalty or p.presence_penalty for p in params)
        self.counts_B_V = torch.zeros(len(params), vocab, device=device) if penalised else None
        self.bias_B_V: torch.Tensor | None = None
        if any(p.logit_bias for p in params):
            self.bias_B_V = torch.zeros(len(params), vocab, device=device)
            for b, p in enumerate(params):
                for token, value in p.logit_bias:
                    if token >= vocab:
                        raise ValueError(f"logit_bias: token id {token} outside the vocabulary")
                    self.bias_B_V[b, token] = value

    @property
    def active(self) -> bool:
        return self.counts_B_V is not None or self.bias_B_V is not None

    def apply(self, logits_B_V: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return logits_B_V
        out = logits_B_V
        if self.bias_B_V is not None:
            out = out + self.bias_B_V
        if self.counts_B_V is not None:
            seen = (self.counts_B_V > 0).to(out.dtype)
            out = out - self.freq_B.unsqueeze(-1) * self.counts_B_V
            out = out - self.pres_B.unsqueeze(-1) * seen
        return out

    def observe(self, tokens_B: torch.Tensor) -> None:
        if self.counts_B_V is not None:
            self.counts_B_V.scatter_add_(
                1, tokens_B.unsqueeze(-1), torch.ones_like(tokens_B, dtype=torch.float32)[:, None]
            )

    def select(self, index: torch.Tensor) -> None:
        self.freq_B = self.freq_B.index_select(0, index)
        self.pres_B = self.pres_B.index_select(0, index)
        if self.counts_B_V is not None:
            self.counts_B_V = self.counts_B_V.index_select(0, index)
        if self.bias_B_V is not None:
            self.bias_B_V = self.bias_B_V.index_select(0, index)

    def extend(self, other: Penalties) -> None:
        """Append ``other``'s rows (rows joining a running batch)."""
        n_self, n_other = len(self.freq_B), len(other.freq_B)
        self.freq_B = torch.cat([self.freq_B, other.freq_B])
        self.pres_B = torch.cat([self.pres_B, other.pres_B])
        for name in ("counts_B_V", "bias_B_V"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is None and theirs is None:
                continue
            zeros = torch.zeros
            mine = zeros(n_self, self.vocab, device=self.device) if mine is None else mine
            theirs = zeros(n_other, self.vocab, device=self.device) if theirs is None else theirs
            setattr(self, name, torch.cat([mine, theirs]))
