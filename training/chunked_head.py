"""The output head's target log-probs computed chunk by chunk, with a backward that recomputes
each chunk's logits instead of saving them: a large vocabulary (Qwen: 151k) never holds an
(N, V) float32 tensor for the whole batch. `training.ops` decides when to use them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


# The autograd Functions type `ctx` as Any, as torch's own signatures do: FunctionCtx declares
# neither saved_tensors nor needs_input_grad, nor the attributes stored on it here.
class ChunkedTargetLogprob(torch.autograd.Function):
    """log_softmax(h @ W^T + b)[target], computed chunk by chunk without saving the logits."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_N_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        bias_V: torch.Tensor | None,
        targets_N: torch.Tensor,
        chunk: int,
    ) -> torch.Tensor:
        out = torch.empty(hidden_N_H.shape[0], device=hidden_N_H.device)
        for start in range(0, hidden_N_H.shape[0], chunk):
            stop = start + chunk
            logits = F.linear(hidden_N_H[start:stop], weight_V_H, bias_V).float()
            picked = logits.gather(1, targets_N[start:stop, None])[:, 0]
            out[start:stop] = picked - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden_N_H, weight_V_H, bias_V, targets_N)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_N_H, weight_V_H, bias_V, targets_N = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden_N_H) if need_h else None
        grad_w = torch.zeros_like(weight_V_H, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias_V, dtype=torch.float32) if need_b else None
        for start in range(0, hidden_N_H.shape[0], chunk):
            stop = start + chunk
            h = hidden_N_H[start:stop]
            g = grad_N[start:stop]
            # d logprob[t] / d logits = onehot(t) - softmax(logits)
            dlogits = torch.softmax(F.linear(h, weight_V_H, bias_V).float(), dim=-1)
            dlogits.mul_(-g[:, None])
            dlogits.scatter_add_(1, targets_N[start:stop, None], g[:, None])
            if grad_h is not None:
                grad_h[start:stop] = (dlogits.to(weight_V_H.dtype) @ weight_V_H).to(h.dtype)
            if grad_w is not None:
                grad_w += dlogits.t() @ h.float()
            if grad_b is not None:
                grad_b += dlogits.sum(dim=0)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight_V_H.dtype),
            None if grad_b is None else grad_b.to(bias_V.dtype),
            None,
            None,
        )


class ChunkedLoRAHeadLogprob(torch.autograd.Function):
    """log_softmax(h @ W^T + b + s * (h @ A^T) @ B^T)[target], chunk by chunk: the output
    head with a LoRA adapter (LoRA on the unembedding), without saving the logits."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_N_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        bias_V: torch.Tensor | None,
        a_R_H: torch.Tensor,
        b_V_R: torch.Tensor,
        targets_N: torch.Tensor,
        scaling: float,
        chunk: int,
    ) -> torch.Tensor:
        out = torch.empty(hidden_N_H.shape[0], device=hidden_N_H.device)
        for start in range(0, hidden_N_H.shape[0], chunk):
            h = hidden_N_H[start : start + chunk]
            logits = lora_head_logits(h, weight_V_H, bias_V, a_R_H, b_V_R, scaling)
            picked = logits.gather(1, targets_N[start : start + chunk, None])[:, 0]
            out[start : start + chunk] = picked - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden_N_H, weight_V_H, bias_V, a_R_H, b_V_R, targets_N)
        ctx.scaling, ctx.chunk = scaling, chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        hidden_N_H, weight_V_H, bias_V, a_R_H, b_V_R, targets_N = saved
        scaling, chunk = ctx.scaling, ctx.chunk
        need_h, need_w, need_bias, need_a, need_b = ctx.needs_input_grad[:5]
        grad_h = torch.zeros_like(hidden_N_H) if need_h else None
        grad_w = torch.zeros_like(weight_V_H, dtype=torch.float32) if need_w else None
        grad_bias = torch.zeros_like(bias_V, dtype=torch.float32) if need_bias else None
        grad_a = torch.zeros_like(a_R_H, dtype=torch.float32) if need_a else None
        grad_b = torch.zeros_like(b_V_R, dtype=torch.float32) if need_b else None
        a32, b32 = a_R_H.float(), b_V_R.float()
        for start in range(0, hidden_N_H.shape[0], chunk):
            stop = start + chunk
            h = hidden_N_H[start:stop]
            g = grad_N[start:stop]
            logits = lora_head_logits(h, weight_V_H, bias_V, a_R_H, b_V_R, scaling)
            # d logprob[t] / d logits = onehot(t) - softmax(logits)
            dlogits = torch.softmax(logits, dim=-1)
            dlogits.mul_(-g[:, None])
            dlogits.scatter_add_(1, targets_N[start:stop, None], g[:, None])
            d_hidden_r = (dlogits @ b32) * scaling  # (c, r)
            h32 = h.float()
            if grad_h is not None:
                base = (dlogits.to(weight_V_H.dtype) @ weight_V_H).float()
                grad_h[start:stop] = (base + d_hidden_r @ a32).to(h.dtype)
            if grad_w is not None:
                grad_w += dlogits.t() @ h32
            if grad_bias is not None:
                grad_bias += dlogits.sum(dim=0)
            if grad_a is not None:
                grad_a += d_hidden_r.t() @ h32
            if grad_b is not None:
                grad_b += dlogits.t() @ (h32 @ a32.t()) * scaling
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight_V_H.dtype),
            None if grad_bias is None else grad_bias.to(bias_V.dtype),
            None if grad_a is None else grad_a.to(a_R_H.dtype),
            None if grad_b is None else grad_b.to(b_V_R.dtype),
            None,
            None,
            None,
        )


def lora_head_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """(N, V) float32 logits of an output head carrying a LoRA adapter."""
    delta = F.linear(F.linear(h.to(a.dtype), a), b).float()
    return F.linear(h, weight, bias).float() + delta * scaling
