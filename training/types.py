"""Plain data types shared by the engine, the sampler, the runners and the Tinker API.

They mirror the Tinker SDK's vocabulary (Datum, AdamParams, SamplingParams) so that the wire
protocol can map onto them one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from training.vision import ImageInput

# Keys a Datum's loss_fn_inputs may carry. SFT sends weights; RL sends logprobs, advantages, mask.
# gspo may add sequence_ratio_mask: the tokens that enter the sequence-level ratio.
LOSS_INPUT_KEYS = frozenset(
    {"target_tokens", "weights", "logprobs", "advantages", "mask", "sequence_ratio_mask"}
)


def _as_tensor(value: object, dtype: torch.dtype, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to(dtype=dtype, device="cpu")
    else:
        try:
            tensor = torch.tensor(value, dtype=dtype)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: cannot convert to a tensor: {exc}") from exc
    if tensor.dim() != 1:
        raise ValueError(f"{name}: expected a 1-d sequence, got shape {tuple(tensor.shape)}")
    return tensor


@dataclass
class Datum:
    """One training example: model input z[0:n-1] and per-target-token loss inputs.

    `loss_fn_inputs["target_tokens"]` holds z[1:n] (same length as `model_input`). SFT adds
    `weights` (any float, negative allowed); RL adds `logprobs` (of the sampler that produced
    the tokens), `advantages` and an explicit `mask` (1 = the token carries loss).
    """

    model_input: torch.Tensor
    """Input token ids, shape (T,), int64."""
    loss_fn_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-position tensors, each of shape (T,)."""
    images: tuple[ImageInput, ...] = ()
    """Images of a vision-language model's input, in the order of their placeholder runs in
    `model_input` (each fills `image.tokens` positions holding the image token id)."""

    def __post_init__(self) -> None:
        self.images = tuple(self.images)
        self.model_input = _as_tensor(self.model_input, torch.long, "model_input")
        length = self.model_input.shape[0]
        if length == 0:
            raise ValueError("model_input: must hold at least one token")
        unknown = set(self.loss_fn_inputs) - LOSS_INPUT_KEYS
        if unknown:
            raise ValueError(
                f"loss_fn_inputs: unknown keys {sorted(unknown)}; allowed {sorted(LOSS_INPUT_KEYS)}"
            )
        converted: dict[str, torch.Tensor] = {}
        for key, value in self.loss_fn_inputs.items():
            dtype = torch.long if key == "target_tokens" else torch.float32
            tensor = _as_tensor(value, dtype, f"loss_fn_inputs[{key!r}]")
            if tensor.shape[0] != length:
                raise ValueError(
                    f"loss_fn_inputs[{key!r}]: length {tensor.shape[0]} != model_input length "
                    f"{length}"
                )
            converted[key] = tensor
        self.loss_fn_inputs = converted

    @property
    def length(self) -> int:
        return int(self.model_input.shape[0])

    @classmethod
    def from_sequence(
        cls,
        tokens: list[int] | torch.Tensor,
        weights: list[float] | torch.Tensor | None = None,
    ) -> Datum:
        """SFT datum from a full sequence z[0:n] and optional per-token weights for z[1:n]."""
        full = _as_tensor(tokens, torch.long, "tokens")
        if full.shape[0] < 2:
            raise ValueError("tokens: need at least two tokens to form input and target")
        inputs = {"target_tokens": full[1:]}
        if weights is None:
            inputs["weights"] = torch.ones(full.shape[0] - 1)
        else:
            inputs["weights"] = _as_tensor(weights, torch.float32, "weights")
        return cls(model_input=full[:-1], loss_fn_inputs=inputs)


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyper-parameters for one optim_step (defaults as in the tinker SDK)."""

    learning_rate: float = 1e-4
    """Step size."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.95
    """Second-moment decay."""
    eps: float = 1e-12
    """Denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient L2 norm to this value; None or <= 0 disables clipping."""

    def __post_init__(self) -> None:
        if not self.learning_rate >= 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings for one sampling request."""

    max_tokens: int = 64
    """Most tokens to generate per sequence."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept; 1.0 disables."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    seed: int | None = None
    """Seed for reproducible sampling; None draws from the global generator."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the decoded text contains one."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop token ids (the tokenizer's eos is added by the sampler)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated so far (OpenAI's)."""
    presence_penalty: float = 0.0
    """Subtracted from a token's logit once it has been generated at all (OpenAI's)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before the token is chosen."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        # Accept lists (and a dict for the bias) from JSON while keeping the dataclass hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        raw: Any = self.logit_bias
        bias = raw.items() if isinstance(raw, dict) else raw
        pairs = tuple(sorted((int(t), float(b)) for t, b in bias))
        for token, value in pairs:
            if token < 0 or not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias {token}: {value} (ids >= 0, biases in [-100, 100])")
        object.__setattr__(self, "logit_bias", pairs)


StopReason = Literal["stop", "length"]


@dataclass
class SampledSequence:
    """One generated continuation."""

    tokens: list[int]
    """Generated token ids (prompt excluded; a matched stop token is included)."""
    logprobs: list[float]
    """Log-probability of each generated token under the sampling distribution at T=1."""
    stop_reason: StopReason
    """"stop" when a stop token/string ended it, "length" when max_tokens did."""
    topk_logprobs: list[list[tuple[int, float]]] | None = None
    """When asked for: per generated position, the k most likely (token, logprob) pairs."""


@dataclass
class FwdBwdResult:
    """What forward / forward_backward return."""

    logprobs: list[torch.Tensor]
    """Per datum: log p(target_tokens[t] | model_input[:t+1]), shape (T,), detached, on CPU."""
    metrics: dict[str, float]
    """Named "name:reduction", e.g. "loss:sum", "clip_frac:mean"."""
