"""Continuous batching: a decode batch that rows join and leave between steps.

`sampler.generate` runs a fixed set of rows to their end, which suits a rollout. A server
wants more: a request that arrives while others decode should start at once rather than wait
for the whole batch, and a request whose client went away should stop costing compute. This
batch is driven one step at a time: `add` prefills new rows (rows of one prompt and adapter
share that prefill) and merges their KV cache into the running one, `step` draws one token
for every row and drops the rows that finished, and `drop` removes rows at any time.

Sampling is `generate`'s: the same token choice (temperature, top-p, top-k, greedy at 0,
frequency and presence penalties, logit bias),
logprobs of the untempered distribution, stop ids, stop strings and EOS, and a seeded row
draws its own random stream whatever else is in the batch, joined early or late. Joining
mid-decode needs a decoder that can merge caches: `FusedDecoder.join` (the Qwen2 and Llama
path) and `HFDecoder.join` (any other model, vision-language ones included, whose cache keeps
every position in every layer). Where the cache cannot be merged (a sliding window, a recurrent
state) `can_join` is False and rows may only be added to an empty batch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from training import vision
from training.decoder import VLDecoder, decoder_for
from training.kv_cache import compaction_order
from training.penalties import Penalties
from training.sampler import (
    _choose_tokens,
    _row_generator,
    _Uniforms,
    banned,
    default_stop_ids,
    placeholder_ids,
)
from training.types import SamplingParams

if TYPE_CHECKING:
    from training.lora import LoRAHost


# Cache columns a prefill leaves for decoding before the cache must grow.
INITIAL_ROOM = 256


class StepToken(NamedTuple):
    """One token a row received in one decode step."""

    row: int
    token: int
    logprob: float
    topk: list[tuple[int, float]] | None
    finished: bool
    """The row ends with this token (a stop, or max_tokens reached): it has left the batch."""
    stopped: bool = False
    """It ended at a stop id or string (EOS included), not at max_tokens."""


@dataclass
class Row:
    """One sequence to generate."""

    prompt: list[int]
    params: SamplingParams
    adapter: str | None = None
    """The LoRA host key that computes it; None: the base model."""
    sample_index: int = 0
    """Tells apart the seeded samples of one request."""
    stop_on_eos: bool = True
    topk: int = 0
    """Also report the k most likely tokens at every position."""
    images: tuple[vision.ImageInput, ...] = field(default=())
    """The prompt's images (a vision-language model), in the order of their placeholders."""


@dataclass
class _Live:
    """Per-row bookkeeping that is not a tensor."""

    ident: int
    key: str | None
    stops: set[int]
    strings: tuple[str, ...]
    window: int
    max_tokens: int
    topk: int
    tokens: list[int]


class ContinuousBatch:
    def __init__(self, model: Any, tokenizer: Any, host: LoRAHost | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.decoder = decoder_for(model, host)
        self.device = next(model.parameters()).device
        self.vocab = int(model.config.get_text_config().vocab_size)
        self.positions = int(
            getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0
        )
        self.eos = set(default_stop_ids(model, tokenizer))
        self.placeholders = placeholder_ids(model)
        pad = tokenizer.pad_token_id if tokenizer is not None else None
        self.pad_id = int(pad) if pad is not None else 0
        self._next = 0
        self._reset()

    def _reset(self) -> None:
        self.can_join = hasattr(self.decoder, "join")
        self.rows: list[_Live] = []
        self.state: Any = None
        self.logits_B_V: torch.Tensor | None = None
        self.next_pos_B = torch.zeros(0, dtype=torch.long, device=self.device)
        self.temperature_B = torch.zeros(0, device=self.device)
        self.top_p_B = torch.zeros(0, device=self.device)
        self.top_k_B = torch.zeros(0, dtype=torch.long, device=self.device)
        self.uniforms = _Uniforms([], self.device)
        self.penalties = Penalties([], self.vocab, self.device)

    def __len__(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ joining

    def check(self, row: Row) -> None:
        """Raise ValueError for a row that cannot run (so that it fails alone)."""
        if not row.prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in row.prompt if not 0 <= int(t) < self.vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab})")
        if self.positions and len(row.prompt) + row.params.max_tokens > self.positions:
            raise ValueError(
                f"{len(row.prompt)} prompt tokens + max_tokens {row.params.max_tokens} exceed "
                f"the model's {self.positions} positions"
            )
        if row.topk < 0:
            raise ValueError("topk must not be negative")
        bad = [t for t, _ in row.params.logit_bias if t >= self.vocab]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:5]} outside the vocabulary")
        if row.images and not isinstance(self.decoder, VLDecoder):
            raise ValueError("this model has no vision tower: it cannot take images")

    @torch.no_grad()
    def add(self, rows: Sequence[Row]) -> list[int]:
        """Prefill ``rows`` and put them in the batch; their ids (as ``StepToken.row``)."""
        if not rows:
            return []
        if self.rows and not self.can_join:
            raise RuntimeError("this model's decoder cannot join a running batch")
        for row in rows:
            self.check(row)
        # Rows of one prompt, adapter and images (a request's n choices) share a prefill.
        unique: dict[tuple[tuple[int, ...], str | None, tuple[str, ...]], int] = {}
        images: list[tuple[vision.ImageInput, ...]] = []
        expand = []
        for r in rows:
            ident = (tuple(int(t) for t in r.prompt), r.adapter, tuple(i.digest for i in r.images))
            if ident not in unique:
                images.append(tuple(r.images))
            expand.append(unique.setdefault(ident, len(unique)))
        width = max(len(p) for p, _, _ in unique)
        ids_U_L = torch.full((len(unique), width), self.pad_id, dtype=torch.long)
        mask_U_L = torch.zeros((len(unique), width), dtype=torch.long)
        for i, (prompt, _key, _images) in enumerate(unique):
            ids_U_L[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask_U_L[i, width - len(prompt) :] = 1
        ids_U_L, mask_U_L = ids_U_L.to(self.device), mask_U_L.to(self.device)
        positions_U_L = (mask_U_L.cumsum(-1) - 1).clamp(min=0)
        # Room for the first tokens only: the cache grows (doubling) as rows keep decoding, so
        # a row allowed the rest of a long context costs that memory only if it uses it.
        capacity = width + min(INITIAL_ROOM, max(r.params.max_tokens for r in rows))
        keys = [k for _, k, _ in unique]
        if isinstance(self.decoder, VLDecoder):
            logits, state = self.decoder.prefill(
                ids_U_L, mask_U_L, positions_U_L, keys, capacity, images
            )
        else:
            logits, state = self.decoder.prefill(ids_U_L, mask_U_L, positions_U_L, keys, capacity)
        next_pos = positions_U_L[:, -1] + 1
        index = torch.tensor(expand, device=self.device)
        if len(unique) < len(rows):
            self.decoder.select(state, index)
        logits = logits.float().index_select(0, index)
        next_pos = next_pos.index_select(0, index)
        if self.state is None:
            self.state, self.logits_B_V = state, logits
            joinable = getattr(self.decoder, "joinable", None)
            self.can_join = self.can_join and (joinable is None or joinable(state))
        else:
            self.decoder.join(self.state, state)  # type: ignore[attr-defined]
            assert self.logits_B_V is not None
            self.logits_B_V = torch.cat([self.logits_B_V, logits])
        self.next_pos_B = torch.cat([self.next_pos_B, next_pos])
        params = [r.params for r in rows]
        self.temperature_B = torch.cat(
            [self.temperature_B, torch.tensor([p.temperature for p in params], device=self.device)]
        )
        self.top_p_B = torch.cat(
            [self.top_p_B, torch.tensor([p.top_p for p in params], device=self.device)]
        )
        self.top_k_B = torch.cat(
            [self.top_k_B, torch.tensor([p.top_k for p in params], device=self.device)]
        )
        self.uniforms.extend(
            [_row_generator(r.params.seed, r.sample_index, self.device) for r in rows]
        )
        self.penalties.extend(Penalties(params, self.vocab, self.device))
        idents = []
        for r in rows:
            idents.append(self._next)
            self.rows.append(
                _Live(
                    ident=self._next,
                    key=r.adapter,
                    stops=(self.eos if r.stop_on_eos else set()) | set(r.params.stop_token_ids),
                    strings=r.params.stop,
                    # A stop string of k characters spans at most 4k byte-level tokens.
                    window=4 * max((len(s) for s in r.params.stop), default=0) + 1,
                    max_tokens=r.params.max_tokens,
                    topk=min(r.topk, self.vocab),
                    tokens=[],
                )
            )
            self._next += 1
        return idents

    # ------------------------------------------------------------------ leaving

    def drop(self, idents: Collection[int]) -> None:
        """Remove these rows now (their clients are gone)."""
        keep = [b for b, row in enumerate(self.rows) if row.ident not in idents]
        if len(keep) < len(self.rows):
            self._keep(compaction_order(len(self.rows), keep))

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self._reset()
            return
        index = torch.tensor(keep, device=self.device)
        self.decoder.select(self.state, index)
        self.uniforms.select(index, keep)
        self.penalties.select(index)
        assert self.logits_B_V is not None
        self.logits_B_V = self.logits_B_V.index_select(0, index)
        self.next_pos_B, self.temperature_B, self.top_p_B, self.top_k_B = (
            t.index_select(0, index)
            for t in (self.next_pos_B, self.temperature_B, self.top_p_B, self.top_k_B)
        )
        self.rows = [self.rows[b] for b in keep]

    # ------------------------------------------------------------------ decoding

    @torch.no_grad()
    def step(self) -> list[StepToken]:
        """One token for every row; rows that finish with it leave the batch."""
        if not self.rows:
            return []
        assert self.logits_B_V is not None
        logits = self.logits_B_V
        any_filter = bool(((self.top_p_B < 1.0) | (self.top_k_B > 0)).any())
        tokens_B = _choose_tokens(
            banned(self.penalties.apply(logits), self.placeholders),
            self.temperature_B,
            self.top_p_B,
            self.top_k_B,
            self.uniforms,
            any_filter,
        )
        self.penalties.observe(tokens_B)
        logp_B_V = torch.log_softmax(logits, dim=-1)
        logprobs = logp_B_V.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1).tolist()
        max_topk = max(row.topk for row in self.rows)
        if max_topk:
            top_lp, top_ids = (t.tolist() for t in logp_B_V.topk(max_topk, dim=-1))
        out: list[StepToken] = []
        keep: list[int] = []
        for b, (row, token) in enumerate(zip(self.rows, tokens_B.tolist(), strict=True)):
            row.tokens.append(token)
            done = token in row.stops
            if not done and row.strings and self.tokenizer is not None:
                tail = self.tokenizer.decode(row.tokens[-row.window :], skip_special_tokens=False)
                done = any(s in tail for s in row.strings)
            finished = done or len(row.tokens) >= row.max_tokens
            topk = list(zip(top_ids[b][: row.topk], top_lp[b][: row.topk])) if row.topk else None
            out.append(StepToken(row.ident, token, logprobs[b], topk, finished, done))
            if not finished:
                keep.append(b)
        if not keep:
            self._reset()
            return out
        if len(keep) < len(self.rows):
            # The rows that stay keep their places but for a few from the end (no cache copy).
            order = compaction_order(len(self.rows), keep)
            tokens_B = tokens_B.index_select(0, torch.tensor(order, device=self.device))
            self._keep(order)
        keys = [row.key for row in self.rows]
        self.logits_B_V = self.decoder.step(tokens_B, self.next_pos_B, keys, self.state).float()
        self.next_pos_B = self.next_pos_B + 1
        return out
