"""Scoring prompts in one forward pass: per-position logprobs, top-k, logprobs of given
target tokens and alternative draws, as the Tinker protocol's sampling and
``compute_logprobs`` ask for them. Every value comes from the log-softmax of the raw logits,
the distribution `training.sampler.generate` reports logprobs of.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from training import vision
from training.sampler import _row_generator

if TYPE_CHECKING:
    from training.lora import LoRAHost


@dataclass
class PromptScoring:
    """What to compute over one prompt's own tokens, in one forward pass.

    Row i of every per-position output covers prompt position i + 1 (position 0 has no
    preceding context); ``last_n`` limits `logprobs` and `topk` to the last n positions.
    """

    tokens: list[int]
    adapter: str | None = None
    """LoRAHost key; None: the base model."""
    logprobs: bool = False
    """log p(tokens[t] | tokens[:t]) per position (None at 0 and before `last_n`)."""
    topk: int = 0
    """The k most likely (token, logprob) pairs per position, most likely first."""
    last_n: int | None = None
    targets: torch.Tensor | None = None
    """int64 (len(tokens) - 1, K) token ids to score at each position; -1 asks nothing."""
    alt_k: int = 0
    """Draw k tokens per position from the next-token distribution at `temperature`."""
    temperature: float = 1.0
    seed: int | None = None
    images: tuple[vision.ImageInput, ...] = ()
    """The prompt's images (a vision-language model), in the order of their placeholders."""


@dataclass
class PromptScores:
    logprobs: list[float | None] | None = None
    topk: list[list[tuple[int, float]] | None] | None = None
    target_logprobs: torch.Tensor | None = None
    """float32, the shape of `targets`; 0.0 where the target was -1."""
    alt_tokens: torch.Tensor | None = None
    """int64 (len(tokens) - 1, alt_k)."""
    alt_logprobs: torch.Tensor | None = None
    """float32 (len(tokens) - 1, alt_k): the model's logprob (T=1) of each draw."""


# Rows of one scoring forward are grouped so that their padded logits stay under this many
# elements (float32), whatever the vocabulary.
_SCORE_LOGITS_ELEMENTS = 1 << 27


@torch.no_grad()
def score_prompts(
    model: Any, requests: Sequence[PromptScoring], *, host: LoRAHost | None = None
) -> list[PromptScores]:
    """Per request: prompt logprobs, top-k, target logprobs and alternative draws, all from
    the log-softmax of the raw logits (the distribution `generate` reports logprobs of)."""
    if not requests:
        return []
    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config().vocab_size)
    for i, rq in enumerate(requests):
        if len(rq.tokens) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in rq.tokens if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if rq.targets is not None:
            if rq.targets.dim() != 2 or rq.targets.shape[0] != len(rq.tokens) - 1:
                raise ValueError(
                    f"prompt {i}: targets must have shape [{len(rq.tokens) - 1}, K], got "
                    f"{list(rq.targets.shape)}"
                )
            if rq.targets.numel() and int(rq.targets.max()) >= vocab:
                raise ValueError(
                    f"prompt {i}: target token id {int(rq.targets.max())} outside the "
                    f"vocabulary [0, {vocab})"
                )
    out: list[PromptScores] = [PromptScores() for _ in requests]
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].tokens))
    group: list[int] = []
    for i in order:
        width = len(requests[i].tokens)
        if group and (len(group) + 1) * width * vocab > _SCORE_LOGITS_ELEMENTS:
            _score_group(model, requests, group, out, host, device)
            group = []
        group.append(i)
    if group:
        _score_group(model, requests, group, out, host, device)
    return out


def _score_group(
    model: Any,
    requests: Sequence[PromptScoring],
    group: list[int],
    out: list[PromptScores],
    host: LoRAHost | None,
    device: torch.device,
) -> None:
    width = max(len(requests[i].tokens) for i in group)
    # Right padding: real tokens keep positions 0..n-1, padding sits after them.
    ids = torch.zeros((len(group), width), dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for row, i in enumerate(group):
        tokens = requests[i].tokens
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = 1
    ids, mask = ids.to(device), mask.to(device)
    keys = [requests[i].adapter for i in group]
    ctx = (
        host.route(keys) if host is not None and any(k is not None for k in keys) else nullcontext()
    )
    images = [requests[i].images for i in group]
    with ctx:
        logits_B_T_V = vision.logits(model, ids, mask, images if any(images) else None)
    for row, i in enumerate(group):
        rq = requests[i]
        n = len(rq.tokens)
        # (n - 1, V): the distribution over prompt token t + 1 given tokens[: t + 1].
        logits = logits_B_T_V[row, : n - 1].float()
        logp = torch.log_softmax(logits, dim=-1)
        scores = out[i]
        first = 1 if rq.last_n is None else max(1, n - rq.last_n)
        if rq.logprobs:
            picked = logp.gather(-1, ids[row, 1:n].unsqueeze(-1)).squeeze(-1).tolist()
            scores.logprobs = [None] * first + picked[first - 1 :]
        if rq.topk:
            k = min(rq.topk, logp.shape[-1])
            top_lp, top_ids = logp[first - 1 :].topk(k, dim=-1)
            scores.topk = [None] * first + [
                list(zip(ids_row, lp_row))
                for ids_row, lp_row in zip(top_ids.tolist(), top_lp.tolist())
            ]
        if rq.targets is not None:
            targets = rq.targets.to(device)
            values = logp.gather(-1, targets.clamp(min=0))
            scores.target_logprobs = values.masked_fill(targets < 0, 0.0).cpu()
        if rq.alt_k:
            if n == 1:
                draws = torch.zeros((0, rq.alt_k), dtype=torch.long, device=device)
            elif rq.temperature == 0:
                draws = logits.argmax(dim=-1, keepdim=True).expand(-1, rq.alt_k)
            else:
                probs = torch.softmax(logits / rq.temperature, dim=-1)
                draws = torch.multinomial(
                    probs, rq.alt_k, replacement=True, generator=_row_generator(rq.seed, 0, device)
                )
            scores.alt_tokens = draws.cpu()
            scores.alt_logprobs = logp.gather(-1, draws).cpu()
