"""Batched sampling with a KV cache, where every row may use its own LoRA adapter.

`generate` is the core: prompts are left-padded into one batch, prefilled once and decoded
token by token through a decoder backend (training/decoder.py: the fused decoder for Qwen2 and
Llama models, the model's own forward with a `DynamicCache` for any other), with explicit
padding masks and positions (left padding shifts positions otherwise). Rows that finish are
dropped from the batch (and from the cache), so a long straggler does not drag finished rows
through every step. Every forward is routed through `LoRAHost.route(keys_per_row)`, so rows of
different adapters share the base projections. Generation runs under `no_grad`, not
`inference_mode`: the returned tokens are fed to training and inference tensors cannot be
saved for backward.

Returned logprobs are those of the model's own distribution (log-softmax of the raw logits,
before penalties, logit bias, temperature, top-k and top-p), i.e. what a forward pass over the
same tokens gives; RL losses compare them against training-time logprobs.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from training import vision
from training.decoder import VLDecoder, decoder_for
from training.penalties import Penalties
from training.types import SampledSequence, SamplingParams, StopReason

if TYPE_CHECKING:
    from training.lora import LoRAHost

# Seeds of the n samples of one request must differ; the stride keeps nearby seeds apart.
_SEED_STRIDE = 1_000_003


@dataclass
class SampleRequest:
    """One prompt to complete n times with one policy version (or the base model)."""

    prompt_tokens: list[int]
    """Prompt token ids (already rendered with the chat template if wanted)."""
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    """Number of independent samples."""
    policy_id: str | None = None
    """None: the base model."""
    version: int | None = None
    """A published snapshot of `policy_id`; None: its live training weights."""
    images: tuple[vision.ImageInput, ...] = ()
    """The prompt's images (a vision-language model), in the order of their placeholders."""

    def __post_init__(self) -> None:
        self.images = tuple(self.images)
        self.prompt_tokens = [int(t) for t in self.prompt_tokens]
        if not self.prompt_tokens:
            raise ValueError("prompt_tokens must not be empty")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.version is not None and self.policy_id is None:
            raise ValueError("version given without policy_id")


def default_stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """Tokenizer eos plus the eos ids of the model's generation config."""
    ids: list[int] = []
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    if isinstance(extra, int):
        extra = [extra]
    for token in extra or []:
        if int(token) not in ids:
            ids.append(int(token))
    return ids


def placeholder_ids(model: Any) -> torch.Tensor | None:
    """The image and video placeholder ids of a vision-language model, on its device (None
    for a text model): prompt positions the vision tower fills, never a token to generate.
    A sampled placeholder would be taken for an image's place the next time the sequence is
    read."""
    if not vision.is_vision_model(model):
        return None
    config = model.config
    vocab = int(config.get_text_config().vocab_size)
    ids = {getattr(config, name, None) for name in ("image_token_id", "video_token_id")}
    kept = sorted(int(i) for i in ids if i is not None and 0 <= int(i) < vocab)
    device = next(model.parameters()).device
    return torch.tensor(kept, device=device) if kept else None


def banned(logits_B_V: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """``logits_B_V`` with the tokens ``ids`` made impossible to choose (a copy if any)."""
    if ids is None:
        return logits_B_V
    return logits_B_V.index_fill(-1, ids, float("-inf"))


def _row_generator(
    seed: int | None, sample_index: int, device: torch.device
) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed((int(seed) * _SEED_STRIDE + sample_index) % (2**63 - 1))
    return gen


class _Uniforms:
    """One uniform draw in [0, 1) per row and decode step, `CHUNK` steps drawn at a time.

    Every active row consumes one draw per step, in lockstep, so one (B, CHUNK) buffer serves
    `CHUNK` steps; a seeded row fills its slice from its own generator (a generator yields
    the same stream whether it is drawn a step or a chunk at a time), so a seeded sample does
    not depend on the rest of the batch; unseeded rows share the global generator.
    """

    CHUNK = 16

    def __init__(self, generators: list[torch.Generator | None], device: torch.device) -> None:
        self.generators = generators
        self.device = device
        self.buffer: torch.Tensor | None = None
        self.index = self.CHUNK

    def next(self) -> torch.Tensor:
        if self.index == self.CHUNK:
            rows = len(self.generators)
            self.buffer = torch.empty((rows, self.CHUNK), device=self.device, dtype=torch.float64)
            if any(g is None for g in self.generators):
                self.buffer.uniform_()
            for i, gen in enumerate(self.generators):
                if gen is not None:
                    self.buffer[i].uniform_(generator=gen)
            self.index = 0
        assert self.buffer is not None
        u_B = self.buffer[:, self.index]
        self.index += 1
        return u_B

    def select(self, index_B: torch.Tensor, keep: list[int]) -> None:
        """Keep the rows `keep` (their positions in the current batch)."""
        self.generators = [self.generators[b] for b in keep]
        if self.buffer is not None:
            self.buffer = self.buffer.index_select(0, index_B)

    def extend(self, generators: list[torch.Generator | None]) -> None:
        """Append rows that join mid-call: their draws of the current chunk start where the
        others' stand, so a seeded row gets its generator's stream from its first value."""
        self.generators = self.generators + generators
        if self.buffer is None or self.index == self.CHUNK:
            self.index = self.CHUNK  # the next draw refills every row
            self.buffer = None
            return
        fresh = torch.zeros((len(generators), self.CHUNK), device=self.device, dtype=torch.float64)
        for i, gen in enumerate(generators):
            fresh[i, self.index :].uniform_(generator=gen)
        self.buffer = torch.cat([self.buffer, fresh])


def _choose_tokens(
    logits_B_V: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor,
    uniforms: _Uniforms,
    any_filter: bool,
) -> torch.Tensor:
    """Next token per row: argmax where temperature is 0, else a filtered categorical draw."""
    greedy_B = temperature_B == 0
    tokens_B = logits_B_V.argmax(dim=-1)
    if bool(greedy_B.all()):
        return tokens_B
    scaled = logits_B_V / torch.where(greedy_B, 1.0, temperature_B).unsqueeze(-1)
    if any_filter:
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        vocab = scaled.shape[-1]
        ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)  # (1, V)
        k_B = torch.where(top_k_B > 0, top_k_B, vocab).unsqueeze(-1)
        drop = ranks >= k_B
        probs_sorted = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        drop |= mass_before >= top_p_B.unsqueeze(-1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, sorted_idx, sorted_logits)
    # Inverse CDF: the first token whose cumulative probability exceeds u * total. One random
    # number per row instead of one per vocabulary entry (the exponential race, argmax(p / E),
    # spent more time drawing V exponentials than the rest of the step), and cheaper than
    # torch.multinomial on small batches. Tokens of probability 0 (filtered) are never chosen:
    # the cumulative sum does not rise at them. Sums in float64 keep the tail exact enough
    # for 150k-token vocabularies.
    cdf_B_V = torch.softmax(scaled, dim=-1).cumsum(dim=-1, dtype=torch.float64)
    target_B = uniforms.next() * cdf_B_V[:, -1]
    sampled_B = torch.searchsorted(cdf_B_V, target_B.unsqueeze(-1), right=True).squeeze(-1)
    # u * total rounds up to total once in ~2^53 draws: take the most likely token then.
    sampled_B = torch.where(sampled_B < cdf_B_V.shape[-1], sampled_B, tokens_B)
    return torch.where(greedy_B, tokens_B, sampled_B)


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    **options: Any,
) -> list[SampledSequence]:
    """Complete each prompt once (see `generation`, which takes the same arguments)."""
    steps = generation(model, tokenizer, prompts, params, **options)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: list[SampledSequence] = done.value
            return result


@torch.no_grad()
def generation(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    adapters: Sequence[str | None] | None = None,
    host: LoRAHost | None = None,
    sample_indices: Sequence[int] | None = None,
    stop_on_eos: bool | Sequence[bool] = True,
    topk_logprobs: int | Sequence[int] = 0,
    images: Sequence[Sequence[vision.ImageInput]] | None = None,
) -> Generator[None, None, list[SampledSequence]]:
    """Complete each prompt once; row i uses `params[i]` and LoRA adapter `adapters[i]`.

    A generator: each `next()` runs one forward (the prefill, then a decode step) and the
    sequences are its return value (`generate` runs it through), so that a server can run
    other batches between the steps of this one. The arguments are checked at the first.

    `images[i]`: the images of prompt i (a vision-language model), in placeholder order.
    `sample_indices[i]` distinguishes the seeded samples of one request (default: 0).
    `stop_on_eos=False` (for all rows or per row) decodes to `max_tokens` unless a stop
    id/string is given. `topk_logprobs` (for all rows or per row): at every generated
    position, also return the k most likely tokens and their logprobs (same distribution as
    `logprobs`), most likely first.
    """
    n_rows = len(prompts)
    if n_rows == 0:
        return []
    row_params = [params] * n_rows if isinstance(params, SamplingParams) else list(params)
    if len(row_params) != n_rows:
        raise ValueError(f"{len(row_params)} SamplingParams for {n_rows} prompts")
    keys = [None] * n_rows if adapters is None else list(adapters)
    if len(keys) != n_rows:
        raise ValueError(f"{len(keys)} adapters for {n_rows} prompts")
    if any(k is not None for k in keys) and host is None:
        raise ValueError("adapters given but no LoRAHost to route them")
    indices = [0] * n_rows if sample_indices is None else list(sample_indices)
    eos_rows = [stop_on_eos] * n_rows if isinstance(stop_on_eos, bool) else list(stop_on_eos)
    topk_rows = [topk_logprobs] * n_rows if isinstance(topk_logprobs, int) else list(topk_logprobs)
    if len(eos_rows) != n_rows or len(topk_rows) != n_rows:
        raise ValueError(f"stop_on_eos and topk_logprobs need one value per prompt ({n_rows})")
    if any(k < 0 for k in topk_rows):
        raise ValueError("topk_logprobs must not be negative")
    row_images = [()] * n_rows if images is None else [tuple(i) for i in images]
    if len(row_images) != n_rows:
        raise ValueError(f"{len(row_images)} image lists for {n_rows} prompts")

    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config().vocab_size)
    max_positions = int(getattr(model.config.get_text_config(), "max_position_embeddings", 0) or 0)
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {i}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if max_positions and len(prompt) + row_params[i].max_tokens > max_positions:
            raise ValueError(
                f"prompt {i}: {len(prompt)} tokens + max_tokens {row_params[i].max_tokens} exceed "
                f"the model's {max_positions} positions"
            )

    base_stops = set(default_stop_ids(model, tokenizer)) if any(eos_rows) else set()
    stop_sets = [
        (base_stops if eos else set()) | set(p.stop_token_ids)
        for p, eos in zip(row_params, eos_rows)
    ]
    stop_strings = [p.stop for p in row_params]
    # A stop string of k characters spans at most 4k byte-level tokens: decode only that tail.
    windows = [4 * max((len(s) for s in strs), default=0) + 1 for strs in stop_strings]
    max_tokens = [p.max_tokens for p in row_params]
    uniforms = _Uniforms(
        [_row_generator(p.seed, idx, device) for p, idx in zip(row_params, indices)], device
    )
    any_filter = any(p.top_p < 1.0 or p.top_k > 0 for p in row_params)
    penalties = Penalties(row_params, vocab, device)
    placeholders = placeholder_ids(model)

    pad_id = tokenizer.pad_token_id if tokenizer is not None else None
    pad_id = int(pad_id) if pad_id is not None else 0
    # Rows with the same prompt and adapter (the n samples of a request, a GRPO group) share
    # one prefill; the cache is then expanded to every row.
    unique: dict[tuple[tuple[int, ...], str | None, tuple[str, ...]], int] = {}
    unique_images: list[tuple[vision.ImageInput, ...]] = []
    expand: list[int] = []
    for prompt, key, imgs in zip(prompts, keys, row_images):
        ident = (tuple(int(t) for t in prompt), key, tuple(i.digest for i in imgs))
        if ident not in unique:
            unique_images.append(imgs)
        expand.append(unique.setdefault(ident, len(unique)))
    unique_prompts = [prompt for prompt, _, _ in unique]
    unique_keys = [key for _, key, _ in unique]
    width = max(len(p) for p in unique_prompts)
    input_ids_U_L = torch.full((len(unique_prompts), width), pad_id, dtype=torch.long)
    mask_U_L = torch.zeros((len(unique_prompts), width), dtype=torch.long)
    for i, prompt in enumerate(unique_prompts):
        input_ids_U_L[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask_U_L[i, width - len(prompt) :] = 1
    input_ids_U_L = input_ids_U_L.to(device)
    mask_U_L = mask_U_L.to(device)
    positions_U_L = (mask_U_L.cumsum(-1) - 1).clamp(min=0)

    temperature_B = torch.tensor([p.temperature for p in row_params], device=device)
    top_p_B = torch.tensor([p.top_p for p in row_params], device=device)
    top_k_B = torch.tensor([p.top_k for p in row_params], device=device)

    out_tokens: list[list[int]] = [[] for _ in range(n_rows)]
    out_logprobs: list[list[float]] = [[] for _ in range(n_rows)]
    out_topk: list[list[list[tuple[int, float]]]] = [[] for _ in range(n_rows)]
    max_topk = min(max(topk_rows), vocab)
    reasons: list[StopReason] = ["length"] * n_rows
    active = list(range(n_rows))  # original row index of each batch row

    decoder = decoder_for(model, host)
    capacity = width + max(max_tokens)
    if isinstance(decoder, VLDecoder):
        logits_B_V, state = decoder.prefill(
            input_ids_U_L, mask_U_L, positions_U_L, unique_keys, capacity, unique_images
        )
    elif any(unique_images):
        raise ValueError("this model has no vision tower: it cannot take images")
    else:
        logits_B_V, state = decoder.prefill(
            input_ids_U_L, mask_U_L, positions_U_L, unique_keys, capacity
        )
    logits_B_V = logits_B_V.float()
    next_pos_B = positions_U_L[:, -1] + 1
    if len(unique_prompts) < n_rows:
        idx = torch.tensor(expand, device=device)
        decoder.select(state, idx)
        logits_B_V, next_pos_B = (t.index_select(0, idx) for t in (logits_B_V, next_pos_B))

    while True:
        tokens_B = _choose_tokens(
            banned(penalties.apply(logits_B_V), placeholders),
            temperature_B,
            top_p_B,
            top_k_B,
            uniforms,
            any_filter,
        )
        penalties.observe(tokens_B)
        logp_B_V = torch.log_softmax(logits_B_V, dim=-1)
        logprobs_B = logp_B_V.gather(-1, tokens_B.unsqueeze(-1))
        tokens_list = tokens_B.tolist()
        logprob_list = logprobs_B.squeeze(-1).tolist()
        if max_topk:
            top_lp, top_ids = logp_B_V.topk(max_topk, dim=-1)  # (B, k), most likely first
            top_lp_list, top_ids_list = top_lp.tolist(), top_ids.tolist()
        keep: list[int] = []
        for b, row in enumerate(active):
            token = tokens_list[b]
            out_tokens[row].append(token)
            out_logprobs[row].append(logprob_list[b])
            if topk_rows[row]:
                k = topk_rows[row]
                out_topk[row].append(list(zip(top_ids_list[b][:k], top_lp_list[b][:k])))
            done = token in stop_sets[row]
            if not done and stop_strings[row] and tokenizer is not None:
                tail = tokenizer.decode(out_tokens[row][-windows[row] :], skip_special_tokens=False)
                done = any(s in tail for s in stop_strings[row])
            if done:
                reasons[row] = "stop"
            elif len(out_tokens[row]) < max_tokens[row]:
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(active):
            # Drop finished rows everywhere: cache, mask, positions and per-row settings.
            idx = torch.tensor(keep, device=device)
            decoder.select(state, idx)
            uniforms.select(idx, keep)
            penalties.select(idx)
            next_pos_B = next_pos_B.index_select(0, idx)
            temperature_B, top_p_B, top_k_B = (
                t.index_select(0, idx) for t in (temperature_B, top_p_B, top_k_B)
            )
            tokens_B = tokens_B.index_select(0, idx)
            active = [active[b] for b in keep]
        yield
        logits_B_V = decoder.step(tokens_B, next_pos_B, [keys[r] for r in active], state).float()
        next_pos_B = next_pos_B + 1

    return [
        SampledSequence(
            tokens=out_tokens[i],
            logprobs=out_logprobs[i],
            stop_reason=reasons[i],
            topk_logprobs=out_topk[i] if topk_rows[i] else None,
        )
        for i in range(n_rows)
    ]


def _resolve(engine: Any, policy_id: str | None, version: int | None) -> tuple[Any, str | None]:
    resolve = getattr(engine, "resolve", None)
    if resolve is None:
        if policy_id is not None:
            raise ValueError("this engine has no policies; use policy_id=None")
        return engine.model, None
    return resolve(policy_id, version)


def sample(engine: Any, requests: Sequence[SampleRequest]) -> list[list[SampledSequence]]:
    """Serve many requests, of many adapters, in as few batches as possible.

    All rows that run on the shared base model (the base itself and every LoRA version) go
    into one multi-LoRA batch; fully fine-tuned policies run in one batch per model.
    """
    batches: dict[int, tuple[Any, list[tuple[int, int, str | None]]]] = {}
    for r, request in enumerate(requests):
        model, key = _resolve(engine, request.policy_id, request.version)
        entry = batches.setdefault(id(model), (model, []))
        entry[1].extend((r, j, key) for j in range(request.n))
    results: dict[tuple[int, int], SampledSequence] = {}
    host = getattr(engine, "host", None)
    for model, rows in batches.values():
        seqs = generate(
            model,
            engine.tokenizer,
            [requests[r].prompt_tokens for r, _, _ in rows],
            [requests[r].params for r, _, _ in rows],
            adapters=[key for _, _, key in rows],
            host=host,
            sample_indices=[j for _, j, _ in rows],
            images=[requests[r].images for r, _, _ in rows],
        )
        for (r, j, _), seq in zip(rows, seqs):
            results[r, j] = seq
    return [[results[r, j] for j in range(rq.n)] for r, rq in enumerate(requests)]


def _parse_adapter(adapter: str | tuple[str, int | None] | None) -> tuple[str | None, int | None]:
    if adapter is None:
        return None, None
    if isinstance(adapter, tuple):
        policy_id, version = adapter
        return policy_id, version
    if "@" in adapter:
        # A host snapshot key "policy@version".
        policy_id, _, suffix = adapter.rpartition("@")
        return policy_id, int(suffix)
    return adapter, None


@torch.no_grad()
def sequence_logprobs(
    model: Any,
    sequences: Sequence[Sequence[int]],
    *,
    adapters: Sequence[str | None] | None = None,
    host: LoRAHost | None = None,
    images: Sequence[Sequence[vision.ImageInput]] | None = None,
) -> list[list[float | None]]:
    """Per sequence: None for the first token, then log p(z[t] | z[:t]) for every later one.
    `images[i]`: the images of sequence i (a vision-language model)."""
    if not sequences:
        return []
    device = next(model.parameters()).device
    n_rows = len(sequences)
    width = max(len(s) for s in sequences)
    if min(len(s) for s in sequences) == 0:
        raise ValueError("sequences must not be empty")
    # Right padding: real tokens keep positions 0..n-1, padding sits after them.
    ids = torch.zeros((n_rows, width), dtype=torch.long)
    mask = torch.zeros((n_rows, width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[i, : len(seq)] = 1
    ids, mask = ids.to(device), mask.to(device)
    keys = [None] * n_rows if adapters is None else list(adapters)
    ctx = (
        host.route(keys) if host is not None and any(k is not None for k in keys) else nullcontext()
    )
    with ctx:
        logits = vision.logits(model, ids, mask, images).float()  # (B, T, V)
    logp_B_T = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1))
    logp_B_T = logp_B_T.squeeze(-1).cpu()
    return [[None, *logp_B_T[i, : len(seq) - 1].tolist()] for i, seq in enumerate(sequences)]


def compute_logprobs(
    engine: Any,
    adapter: str | tuple[str, int | None] | None,
    tokens: Sequence[int],
    images: Sequence[vision.ImageInput] = (),
) -> list[float | None]:
    """Score a sequence: None, then log p(tokens[t] | tokens[:t]) under `adapter`.

    `adapter`: None (base model), a policy id (live weights), `(policy_id, version)` or a
    snapshot key `"policy_id@version"`.
    """
    if len(tokens) == 0:
        raise ValueError("tokens must not be empty")
    policy_id, version = _parse_adapter(adapter)
    model, key = _resolve(engine, policy_id, version)
    return sequence_logprobs(
        model,
        [list(tokens)],
        adapters=[key],
        host=getattr(engine, "host", None),
        images=[tuple(images)] if images else None,
    )[0]
