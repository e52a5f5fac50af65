"""KV-cache decoding of Qwen2- and Llama-architecture models without the Hugging Face loop.

`generate` (training/sampler.py) drives a model through one of two backends with the same
three calls, `prefill`, `step` and `select`:

- `FusedDecoder` runs the decoder layers itself for the architectures whose layer it knows
  (Qwen2, Llama: RMSNorm, rotary attention with grouped KV heads, SiLU-gated MLP). It calls
  the model's own modules for every projection, so `MultiLoRALinear` routing, biases and the
  LoRA on the output head apply unchanged, and the model's own rotary module for cos/sin, so
  every rotary scaling type applies. What it does differently is what a decode step costs
  outside the matmuls: the KV cache is preallocated for the whole call and written in place
  (no concatenation per step), the padding mask is one preallocated boolean table, cos/sin
  are computed once for every position the call can reach, and a decode step attends with
  the query heads of each KV head grouped together, so the cache is never repeated per head
  and no causal mask is built (one new token sees every cached position). On the CPU in
  float32 a layer's query, key and value projections run as one matmul over their weights
  stacked by rows, and so do the MLP's gate and up (`training.onednn.linear_rows`, LoRA
  deltas added to each part after): two passes over the weights instead of five, which is
  what a decode step is bound by.
- `HFDecoder` calls the model's forward with a `DynamicCache`: any other causal LM. Rows
  of another prefill join its cache mid-decode (continuous batching) where every layer keeps
  the whole sequence: the shorter cache is padded on the left under the mask, which changes
  no row's attention, since every position is given explicitly.

Both return the same logits up to float32 summation order (tests/training/test_decoder.py:
within 3e-5 + 1e-5 relative on logits of size 1-3).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from training import onednn, vision
from training.kv_cache import TRIM_MIN_COLUMNS, KVCache
from training.lora import MultiLoRALinear

if TYPE_CHECKING:
    from training.lora import LoRAHost

# Architectures whose decoder layer FusedDecoder reproduces exactly.
_FUSED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")

# The model's config and submodules are reached through nn.Module's dynamic attributes, which
# type as Tensor | Module; they are annotated Any where the code relies on the Hugging Face
# structure (FusedDecoder.supports checks it).

State = TypeVar("State")


class Decoder(Protocol[State]):
    """The three calls `generate` drives; `State` is the backend's own per-call cache."""

    def prefill(
        self,
        input_ids_B_L: torch.Tensor,
        mask_B_L: torch.Tensor,
        positions_B_L: torch.Tensor,
        keys_B: Sequence[str | None],
        capacity: int,
    ) -> tuple[torch.Tensor, State]: ...

    def step(
        self,
        tokens_B: torch.Tensor,
        positions_B: torch.Tensor,
        keys_B: Sequence[str | None],
        state: State,
    ) -> torch.Tensor: ...

    def select(self, state: State, index_B: torch.Tensor) -> None: ...


class _RMSNorm(Protocol):
    weight: torch.Tensor
    variance_epsilon: float


def cache_kwarg(model: nn.Module) -> str:
    """The name the model's forward takes its KV cache by: `cache` in the transformers this
    project pins, `past_key_values` in earlier 5.x releases (those in some CUDA images), which
    would swallow `cache=` into **kwargs and decode without a cache."""
    model_class = type(model)
    name = _CACHE_KWARGS.get(model_class)
    if name is None:
        forward = inspect.signature(model_class.forward).parameters
        name = "cache" if "cache" in forward else "past_key_values"
        _CACHE_KWARGS[model_class] = name
    return name


# Read once per model class: a decoder is made for every `generate` call.
_CACHE_KWARGS: dict[type[nn.Module], str] = {}


def cache_of(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _route(host: LoRAHost | None, keys: Sequence[str | None]) -> AbstractContextManager[None]:
    if host is None or all(k is None for k in keys):
        return nullcontext()
    return host.route(keys)


class HFDecoder:
    """The model's own forward with a `DynamicCache`."""

    def __init__(self, model: nn.Module, host: LoRAHost | None = None) -> None:
        self.model = model
        self.host = host
        self.cache_kwarg = cache_kwarg(model)

    def _forward(self, keys_B: Sequence[str | None], cache: Any, **inputs: Any) -> Any:
        with _route(self.host, keys_B):
            return self.model(**inputs, **{self.cache_kwarg: cache}, use_cache=True)

    def prefill(
        self,
        input_ids_B_L: torch.Tensor,
        mask_B_L: torch.Tensor,
        positions_B_L: torch.Tensor,
        keys_B: Sequence[str | None],
        capacity: int,
    ) -> tuple[torch.Tensor, _HFState]:
        config: Any = self.model.config
        out = self._forward(
            keys_B,
            DynamicCache(config=config),
            input_ids=input_ids_B_L,
            attention_mask=mask_B_L,
            position_ids=positions_B_L,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :], _HFState(cache_of(out), mask_B_L)

    def _step_positions(self, positions_B: torch.Tensor, state: Any) -> torch.Tensor:
        return positions_B.unsqueeze(-1)

    def step(
        self,
        tokens_B: torch.Tensor,
        positions_B: torch.Tensor,
        keys_B: Sequence[str | None],
        state: _HFState,
    ) -> torch.Tensor:
        mask = state.mask_B_L
        state.mask_B_L = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        out = self._forward(
            keys_B,
            state.cache,
            input_ids=tokens_B.unsqueeze(-1),
            attention_mask=state.mask_B_L,
            position_ids=self._step_positions(positions_B, state),
        )
        state.cache = cache_of(out)
        return out.logits[:, -1, :]

    @staticmethod
    def select(state: _HFState, index_B: torch.Tensor) -> None:
        state.cache.batch_select_indices(index_B)
        state.mask_B_L = state.mask_B_L.index_select(0, index_B)
        state.trim()

    @staticmethod
    def joinable(state: _HFState) -> bool:
        """Whether rows may join ``state``: every layer keeps the whole sequence (a sliding
        window or a recurrent state could not be padded to another length)."""
        layers: list[Any] = getattr(state.cache, "layers", None) or []
        return bool(layers) and all(
            type(layer) is DynamicLayer and getattr(layer, "keys", None) is not None
            for layer in layers
        )

    @staticmethod
    def join(state: _HFState, other: _HFState) -> None:
        """Append the rows of ``other`` (a prefill of new prompts) to those of ``state``, which
        may be mid-decode; both caches are left-padded to the longer one."""
        width = max(state.mask_B_L.shape[1], other.mask_B_L.shape[1])
        for mine, theirs in zip(state.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat(
                [_pad_left(mine.keys, width, 2), _pad_left(theirs.keys, width, 2)]
            )
            mine.values = torch.cat(
                [_pad_left(mine.values, width, 2), _pad_left(theirs.values, width, 2)]
            )
        state.mask_B_L = torch.cat(
            [_pad_left(state.mask_B_L, width, 1), _pad_left(other.mask_B_L, width, 1)]
        )
        state.trim()


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class _HFState:
    def __init__(self, cache: Any, mask_B_L: torch.Tensor) -> None:
        self.cache = cache
        self.mask_B_L = mask_B_L

    @property
    def length(self) -> int:
        """Cached positions (columns), padding included."""
        return int(self.mask_B_L.shape[1])

    def trim(self) -> None:
        """Drop the leading columns no row attends to (rows that needed them left, or joined
        shorter), as `KVCache` does: a batch that never empties would otherwise attend over
        ever more padding."""
        live = self.mask_B_L.any(dim=0).nonzero()
        start = int(live[0]) if len(live) else 0
        if start < TRIM_MIN_COLUMNS or 4 * start < self.mask_B_L.shape[1]:
            return
        layers = getattr(self.cache, "layers", None)
        if not layers or not all(type(layer) is DynamicLayer for layer in layers):
            return
        for layer in layers:
            if getattr(layer, "keys", None) is not None:
                layer.keys = layer.keys[:, :, start:]
                layer.values = layer.values[:, :, start:]
        self.mask_B_L = self.mask_B_L[:, start:]


class VLDecoder(HFDecoder):
    """A vision-language model's own forward with a `DynamicCache`: the prompt's images go
    through the vision tower at prefill, and every position is given explicitly in the
    model's 3-D rotary form (`training.vision`). A generated token is text: its three
    rotary components are equal, the row's next text position plus the offset its images
    left (an image advances the position by its side, not by its token count)."""

    def prefill(
        self,
        input_ids_B_L: torch.Tensor,
        mask_B_L: torch.Tensor,
        positions_B_L: torch.Tensor,
        keys_B: Sequence[str | None],
        capacity: int,
        images_B: Sequence[Sequence[vision.ImageInput]] | None = None,
    ) -> tuple[torch.Tensor, _VLState]:
        spec = vision.spec_of(self.model)
        assert spec is not None
        pixels, grid, mm = vision.batch_images(spec, input_ids_B_L, mask_B_L, images_B)
        positions, deltas = vision.rope_positions(self.model, input_ids_B_L, mask_B_L, grid, mm)
        config: Any = self.model.config
        out = self._forward(
            keys_B,
            DynamicCache(config=config),
            input_ids=input_ids_B_L,
            attention_mask=mask_B_L,
            position_ids=positions,
            pixel_values=pixels,
            image_grid_thw=grid,
            mm_token_type_ids=mm,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :], _VLState(cache_of(out), mask_B_L, deltas)

    def _step_positions(self, positions_B: torch.Tensor, state: _VLState) -> torch.Tensor:
        return (positions_B + state.deltas_B).view(1, -1, 1).expand(3, -1, -1)

    @staticmethod
    def select(state: _VLState, index_B: torch.Tensor) -> None:  # type: ignore[override]
        HFDecoder.select(state, index_B)
        state.deltas_B = state.deltas_B.index_select(0, index_B)

    @staticmethod
    def join(state: _VLState, other: _VLState) -> None:  # type: ignore[override]
        HFDecoder.join(state, other)
        state.deltas_B = torch.cat([state.deltas_B, other.deltas_B])


class _VLState(_HFState):
    def __init__(self, cache: Any, mask_B_L: torch.Tensor, deltas_B: torch.Tensor) -> None:
        super().__init__(cache, mask_B_L)
        self.deltas_B = deltas_B


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: the sign `rotate_half` gives the swapped halves,
    folded into the table once so that `_rotary` needs no per-layer negation or concatenation."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in three operations: rolling the last dimension by
    half swaps its halves, and `_signed_sin` carries rotate_half's sign."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _rms_norm(norm: _RMSNorm, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused kernel; the same arithmetic as the module in float32.
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    # As Qwen2RMSNorm / LlamaRMSNorm: statistics in float32, scale in the input dtype.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _project(h: torch.Tensor, modules: Sequence[Any]) -> list[torch.Tensor]:
    """``[m(h) for m in modules]``; where oneDNN can (float32 on the CPU, no autograd) the
    base projections in one matmul over the weights stacked by rows, then each module's
    routed LoRA deltas on its part."""
    weights = [m.weight for m in modules]
    if not all(type(m) in (nn.Linear, MultiLoRALinear) for m in modules) or not all(
        onednn.usable(h, w) for w in weights
    ):
        return [m(h) for m in modules]
    out = onednn.linear_rows(h, weights, [m.bias for m in modules])
    parts = out.split([w.shape[0] for w in weights], dim=-1)
    return [
        m.add_adapters(h, part) if isinstance(m, MultiLoRALinear) else part
        for m, part in zip(modules, parts)
    ]


class FusedDecoder:
    """Runs the decoder layers of a Qwen2 / Llama model for prefill and decode (see module)."""

    def __init__(self, model: nn.Module, host: LoRAHost | None = None) -> None:
        self.model = model
        self.host = host
        config: Any = model.config
        inner: Any = model.model
        self.inner = inner
        self.layers: list[Any] = list(inner.layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5
        # CUDA's fused attention kernels take a mask or grouped key/value heads, not both
        # (flash attention no mask, memory-efficient no grouping), and the prefill has a mask:
        # repeating the shared heads keeps it off the unfused reference kernel.
        device = next(model.parameters()).device
        self.repeat_kv = self.group > 1 and device.type == "cuda"

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """True for the architectures and settings this decoder computes exactly."""
        if type(model).__name__ not in _FUSED_ARCHITECTURES:
            return False
        config = model.config
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            return False  # sliding-window layers
        if getattr(config, "use_sliding_window", False):
            return False
        if model.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
            return False
        inner: Any = getattr(model, "model", None)
        if inner is None or not all(
            hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")
        ):
            return False
        for layer in inner.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is None or mlp is None:
                return False
            # Qwen3-style q/k norms are not part of this layer.
            if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
                return False
            if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                return False
        return hasattr(model, "lm_head")

    # -- the three calls --------------------------------------------------------------------

    def prefill(
        self,
        input_ids_B_L: torch.Tensor,
        mask_B_L: torch.Tensor,
        positions_B_L: torch.Tensor,
        keys_B: Sequence[str | None],
        capacity: int,
    ) -> tuple[torch.Tensor, KVCache]:
        """Run the prompts, fill the cache, return the logits after each prompt's last token.

        The projections and MLPs run over the prompts' real tokens only, packed one after
        another (left padding costs no matmul work); attention scatters them into the padded
        (B, heads, L, D) layout the cache keeps and gathers the result back.
        """
        batch, length = input_ids_B_L.shape
        capacity = max(capacity, length)
        valid_B_L = mask_B_L.bool()
        lengths = valid_B_L.sum(dim=1).tolist()
        packed_N = valid_B_L.reshape(-1).nonzero().squeeze(1)  # flat (row, column) of tokens
        x = self.inner.embed_tokens(input_ids_B_L.reshape(-1)[packed_N]).unsqueeze(1)  # (N,1,H)
        tokens = x.shape[0]
        device, dtype = x.device, x.dtype
        # cos/sin of every position this call can reach, computed once.
        all_positions = torch.arange(capacity, device=device).unsqueeze(0)
        cos_T_D, sin_T_D = self.inner.rotary_emb(x, all_positions)
        cos_T_D, sin_T_D = cos_T_D[0].to(dtype), sin_T_D[0].to(dtype)
        # Every column below `length` is written below (padding as zeros), every later one
        # by the decode step that first reads it: no need to clear the cache.
        state = KVCache(
            keys=torch.empty(
                (len(self.layers), batch, self.num_kv_heads, capacity, self.head_dim),
                device=device,
                dtype=dtype,
            ),
            values=torch.empty(
                (len(self.layers), batch, self.num_kv_heads, capacity, self.head_dim),
                device=device,
                dtype=dtype,
            ),
            bias_B_T=torch.zeros((batch, capacity), device=device, dtype=dtype),
            cos_T_D=cos_T_D,
            sin_T_D=sin_T_D,
            length=length,
        )
        state.bias_B_T[:, :length].masked_fill_(~valid_B_L, float("-inf"))
        token_positions = positions_B_L.reshape(-1)[packed_N]
        cos = cos_T_D[token_positions].unsqueeze(1)  # (N, 1, D)
        sin = _signed_sin(sin_T_D[token_positions].unsqueeze(1))
        causal_L_L = torch.ones((length, length), device=device, dtype=torch.bool).tril()
        # A padded query position sees itself only, which keeps its (unused) output finite.
        mask_B_1_L_L = (causal_L_L & valid_B_L[:, None, :]) | torch.eye(
            length, device=device, dtype=torch.bool
        )
        mask_B_1_L_L = mask_B_1_L_L.unsqueeze(1)
        padded_q = torch.zeros(
            (batch * length, self.num_heads, self.head_dim), device=device, dtype=dtype
        )
        padded_kv = torch.zeros(
            (batch * length, self.num_kv_heads, self.head_dim), device=device, dtype=dtype
        )

        def to_padded(buffer: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
            # (N, heads, D) -> (B, heads, L, D)
            buffer.index_copy_(0, packed_N, packed)
            return buffer.view(batch, length, -1, self.head_dim).transpose(1, 2)

        token_keys = [key for key, n in zip(keys_B, lengths) for _ in range(n)]
        with _route(self.host, token_keys):
            for index, layer in enumerate(self.layers):
                attn = layer.self_attn
                h = _rms_norm(layer.input_layernorm, x)
                q, k, v = _project(h, (attn.q_proj, attn.k_proj, attn.v_proj))
                q = q.view(tokens, self.num_heads, self.head_dim)
                k = k.view(tokens, self.num_kv_heads, self.head_dim)
                v = v.view(tokens, self.num_kv_heads, self.head_dim)
                q = _rotary(q, cos, sin)
                k = _rotary(k, cos, sin)
                state.keys[index, :, :, :length] = to_padded(padded_kv, k)
                state.values[index, :, :, :length] = to_padded(padded_kv, v)
                keys = state.keys[index, :, :, :length]
                values = state.values[index, :, :, :length]
                if self.repeat_kv:
                    keys = keys.repeat_interleave(self.group, dim=1)
                    values = values.repeat_interleave(self.group, dim=1)
                out = F.scaled_dot_product_attention(
                    to_padded(padded_q, q),
                    keys,
                    values,
                    attn_mask=mask_B_1_L_L,
                    scale=self.scale,
                    enable_gqa=self.group > 1 and not self.repeat_kv,
                )
                out = out.transpose(1, 2).reshape(batch * length, -1).index_select(0, packed_N)
                x = x + attn.o_proj(out.unsqueeze(1))
                x = x + self._mlp(layer, x)
        last_B = torch.tensor(lengths, device=device).cumsum(0) - 1
        with _route(self.host, keys_B):
            return self._logits(x.index_select(0, last_B)), state

    def step(
        self,
        tokens_B: torch.Tensor,
        positions_B: torch.Tensor,
        keys_B: Sequence[str | None],
        state: KVCache,
    ) -> torch.Tensor:
        with _route(self.host, keys_B):
            return self._step(tokens_B, positions_B, state)

    def _make_room(self, state: KVCache, x: torch.Tensor) -> None:
        """A column, and rotary tables, for the token at ``state.length``. A row's position
        never exceeds its column (its tokens are contiguous and end there), so tables as
        long as the cache cover every row; a cache merged from joins may be longer than the
        tables its prefills made."""
        # Doubling: each column is copied a bounded number of times on average.
        grow = state.length >= state.capacity
        capacity = 2 * state.capacity if grow else state.capacity
        positions = torch.arange(capacity, device=x.device).unsqueeze(0)
        cos_T_D, sin_T_D = self.inner.rotary_emb(x, positions)
        cos_T_D, sin_T_D = cos_T_D[0].to(x.dtype), sin_T_D[0].to(x.dtype)
        if grow:
            state.grow(capacity, cos_T_D, sin_T_D)
        else:
            state.cos_T_D, state.sin_T_D = cos_T_D, sin_T_D

    def _step(
        self, tokens_B: torch.Tensor, positions_B: torch.Tensor, state: KVCache
    ) -> torch.Tensor:
        batch = tokens_B.shape[0]
        t = state.length
        x = self.inner.embed_tokens(tokens_B.unsqueeze(-1))  # (B, 1, H)
        if t >= state.capacity or t >= state.cos_T_D.shape[0]:
            self._make_room(state, x)
        cos = state.cos_T_D[positions_B][:, None, None, :]  # (B, 1, 1, D)
        sin = _signed_sin(state.sin_T_D[positions_B][:, None, None, :])
        # Additive mask (0 or -inf) for the B * kv_heads attention rows: (B * kv, group, t+1).
        bias = state.bias_B_T[:, None, None, : t + 1].expand(
            batch, self.num_kv_heads, self.group, t + 1
        )
        bias = bias.reshape(batch * self.num_kv_heads, self.group, t + 1)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = _rms_norm(layer.input_layernorm, x)
            q, k, v = _project(h, (attn.q_proj, attn.k_proj, attn.v_proj))
            # Query heads grouped by the KV head they read: (B, kv_heads, group, D).
            q = q.view(batch, self.num_kv_heads, self.group, self.head_dim)
            k = k.view(batch, self.num_kv_heads, 1, self.head_dim)
            v = v.view(batch, self.num_kv_heads, 1, self.head_dim)
            q = _rotary(q, cos, sin)
            k = _rotary(k, cos, sin)
            keys, values = state.keys[index], state.values[index]
            keys[:, :, t : t + 1] = k
            values[:, :, t : t + 1] = v
            # One new token sees every cached position: no causal mask, only the padding.
            # Two small bmm calls beat the fused attention kernel at these sizes (its mask
            # handling costs more than the arithmetic).
            rows = batch * self.num_kv_heads
            scores = torch.baddbmm(
                bias,
                q.reshape(rows, self.group, self.head_dim),
                keys[:, :, : t + 1].reshape(rows, t + 1, self.head_dim).transpose(1, 2),
                alpha=self.scale,
            )
            out = torch.bmm(
                torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype),
                values[:, :, : t + 1].reshape(rows, t + 1, self.head_dim),
            )
            x = x + attn.o_proj(out.view(batch, 1, self.num_heads * self.head_dim))
            x = x + self._mlp(layer, x)
        state.length = t + 1
        return self._logits(x)

    @staticmethod
    def select(state: KVCache, index_B: torch.Tensor) -> None:
        state.select(index_B)

    @staticmethod
    def join(state: KVCache, other: KVCache) -> None:
        """Append the rows of `other` (a prefill of new prompts) to those of `state`, which
        may be mid-decode: continuous batching (`training.kv_cache`)."""
        state.join(other)

    # -- pieces -----------------------------------------------------------------------------

    @staticmethod
    def _mlp(layer: Any, x: torch.Tensor) -> torch.Tensor:
        mlp = layer.mlp
        h = _rms_norm(layer.post_attention_layernorm, x)
        gate, up = _project(h, (mlp.gate_proj, mlp.up_proj))
        hidden = mlp.act_fn(gate)
        # The activation returns a new tensor: scale it in place when no graph is recorded.
        hidden = hidden * up if torch.is_grad_enabled() else hidden.mul_(up)
        return mlp.down_proj(hidden)

    def _logits(self, x_B_1_H: torch.Tensor) -> torch.Tensor:
        lm_head: Any = self.model.lm_head
        return lm_head(_rms_norm(self.inner.norm, x_B_1_H))[:, -1, :]


def decoder_for(model: nn.Module, host: LoRAHost | None = None) -> Decoder[Any]:
    """The fastest exact backend for `model`; `host` routes rows to LoRA adapters."""
    if FusedDecoder.supports(model):
        return FusedDecoder(model, host)
    if vision.is_vision_model(model):
        return VLDecoder(model, host)
    return HFDecoder(model, host)
