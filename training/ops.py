"""The training primitives: forward, forward_backward (gradient accumulation) and optim_step.

A call may mix datums of several policies of one engine: LoRA rows go through the shared base
model in ONE forward, each row routed to its own adapter by `LoRAHost.route`; a fully
fine-tuned policy runs its private model on its rows. Datums of different lengths are right
padded; with causal attention a real token never attends to the padding after it, so no
attention mask is needed and the padded positions are simply excluded from the loss. When the
lengths differ widely, the datums are packed end to end instead (`training.packing`) and the
log-probs scattered back to the padded layout, so losses see the same tensors either way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from training import packing, vision
from training import recompute as recompute_layers
from training.chunked_head import ChunkedLoRAHeadLogprob, ChunkedTargetLogprob, lora_head_logits
from training.lora import LoRAHost, MultiLoRALinear
from training.losses import LOSSES, LossBatch, LossFn, get_loss
from training.policy import Policy
from training.types import AdamParams, Datum, FwdBwdResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _policies_per_row(policy: Policy | Sequence[Policy], datums: Sequence[Datum]) -> list[Policy]:
    if not datums:
        raise ValueError("no datums given")
    if isinstance(policy, Policy):
        return [policy] * len(datums)
    policies = list(policy)
    if len(policies) != len(datums):
        raise ValueError(
            f"got {len(policies)} policies for {len(datums)} datums: pass one policy, "
            "or one per datum"
        )
    hosts = {id(p.host) for p in policies}
    if len(hosts) != 1:
        raise ValueError("all policies of one call must belong to the same engine")
    return policies


def _collate(
    datums: Sequence[Datum], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Right-pad to (B, T): input ids, target ids, loss inputs, and the in-datum mask."""
    for i, datum in enumerate(datums):
        if not isinstance(datum, Datum):
            raise TypeError(f"datum {i}: expected a Datum, got {type(datum).__name__}")
        if "target_tokens" not in datum.loss_fn_inputs:
            raise ValueError(f"datum {i}: loss_fn_inputs has no 'target_tokens'")
    keys = set(datums[0].loss_fn_inputs)
    for i, datum in enumerate(datums[1:], start=1):
        if set(datum.loss_fn_inputs) != keys:
            raise ValueError(
                f"datum {i}: loss_fn_inputs keys {sorted(datum.loss_fn_inputs)} differ from "
                f"datum 0's {sorted(keys)}"
            )
    pad = torch.nn.utils.rnn.pad_sequence
    input_ids = pad([d.model_input for d in datums], batch_first=True)
    inputs = {
        key: pad([d.loss_fn_inputs[key] for d in datums], batch_first=True).to(device)
        for key in keys
    }
    lengths = torch.tensor([d.length for d in datums])
    valid = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).float()
    targets = inputs.pop("target_tokens")
    return input_ids.to(device), targets, inputs, valid.to(device)


def _next_input(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T): the input token after each position (-1 after the last)."""
    nxt = torch.full_like(input_ids, -1)
    nxt[:, :-1] = input_ids[:, 1:]
    return nxt


# Architectures whose logits are exactly lm_head(decoder(x)): for them the head runs only on the
# positions that need it. Others (e.g. with logit soft-capping) go through the full forward.
_PLAIN_HEAD_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


def _target_logprobs(
    policies: list[Policy],
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    loss_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    images_B: list[tuple[vision.ImageInput, ...]] | None = None,
) -> torch.Tensor:
    """(B, T) log p(target | prefix), each row under its own policy; 0 on padding.
    `position_ids` restart at 0 at each datum of a packed row (see `training.packing`);
    `images_B` are the images of each row of a vision-language model."""
    lora_rows = [i for i, p in enumerate(policies) if not p.is_full_finetune]
    groups: list[tuple[list[int], nn.Module, AbstractContextManager[None]]] = []
    if lora_rows:
        host = policies[lora_rows[0]].host
        keys = [policies[i].adapter_key for i in lora_rows]
        groups.append((lora_rows, host.model, host.route(keys)))
    full_rows: dict[int, list[int]] = {}
    for i, p in enumerate(policies):
        if p.is_full_finetune:
            full_rows.setdefault(id(p), []).append(i)
    for rows in full_rows.values():
        model = policies[rows[0]].model
        assert model is not None
        groups.append((rows, model, policies[rows[0]].compute()))

    if len(groups) == 1:
        _, model, ctx = groups[0]
        with ctx:
            return _logprobs_of(model, input_ids, targets, valid, loss_mask, position_ids, images_B)
    parts = []
    for rows, model, ctx in groups:
        index = torch.tensor(rows, device=input_ids.device)
        sub_mask = None if loss_mask is None else loss_mask[index]
        sub_positions = None if position_ids is None else position_ids[index]
        sub_images = None if images_B is None else [images_B[i] for i in rows]
        with ctx:
            lp = _logprobs_of(
                model,
                input_ids[index],
                targets[index],
                valid[index],
                sub_mask,
                sub_positions,
                sub_images,
            )
        parts.append((index, lp))
    index = torch.cat([i for i, _ in parts])
    values = torch.cat([v for _, v in parts])
    # Out-of-place index_put keeps the autograd graph of every part.
    return torch.zeros(targets.shape, device=targets.device).index_put((index,), values)


# Above this many logits (N x V) the head runs in chunks and recomputes them in backward, so a
# large vocabulary (Qwen: 151k) never holds an (N, V) float32 tensor for the whole batch.
_HEAD_CHUNK_ELEMENTS = 1 << 26


def _adapted_head_logprobs(
    head: MultiLoRALinear,
    adapters: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float]],
    hidden_N_H: torch.Tensor,
    targets_N: torch.Tensor,
    rows_N: torch.Tensor | None,
) -> torch.Tensor:
    """Target log-probs through an output head that adapters of the current route target:
    each position gets the adapter of the batch row it came from (`rows_N`)."""
    n, vocab = hidden_N_H.shape[0], head.out_features
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    covered = torch.zeros(n, dtype=torch.bool, device=hidden_N_H.device)
    for rows, a, b, scaling in adapters:
        if rows is None:
            index = torch.arange(n, device=hidden_N_H.device)
        else:
            if rows_N is None:
                raise ValueError("adapters route some rows only: rows_N is required")
            index = torch.isin(rows_N, rows).nonzero().squeeze(1)
        covered[index] = True
        h, t = hidden_N_H[index], targets_N[index]
        if index.numel() * vocab > _HEAD_CHUNK_ELEMENTS:
            chunk = max(1, _HEAD_CHUNK_ELEMENTS // vocab)
            values = ChunkedLoRAHeadLogprob.apply(
                h, head.weight, head.bias, a, b, t, scaling, chunk
            )
        else:
            logits = lora_head_logits(h, head.weight, head.bias, a, b, scaling)
            values = -F.cross_entropy(logits, t, reduction="none")
        parts.append((index, values))
    rest = (~covered).nonzero().squeeze(1)
    if rest.numel():
        plain = _head_logprobs(_plain_linear(head), hidden_N_H[rest], targets_N[rest])
        parts.append((rest, plain))
    out = torch.zeros(n, device=hidden_N_H.device)
    for index, values in parts:
        # Out-of-place index_put keeps the autograd graph of every part.
        out = out.index_put((index,), values.float())
    return out


def _plain_linear(head: MultiLoRALinear) -> nn.Linear:
    """The base projection of a wrapped head as a Linear sharing its parameters."""
    linear = nn.Linear(
        head.in_features, head.out_features, bias=head.bias is not None, device="meta"
    )
    linear.weight = head.weight
    linear.bias = head.bias
    return linear


def _head_logprobs(
    head: nn.Module,
    hidden_N_H: torch.Tensor,
    targets_N: torch.Tensor,
    rows_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(target) per position through the output `head`; `rows_N` names each position's
    batch row, which a routed LoRA head (LoRA on the unembedding) needs."""
    if isinstance(head, MultiLoRALinear):
        adapters = head.routed_adapters()
        if adapters:
            return _adapted_head_logprobs(head, adapters, hidden_N_H, targets_N, rows_N)
        # The wrapper would refuse positions gathered from many rows: use the base projection.
        head = _plain_linear(head)
    weight = getattr(head, "weight", None)
    vocab = weight.shape[0] if isinstance(head, nn.Linear) and weight is not None else 0
    if vocab and hidden_N_H.shape[0] * vocab > _HEAD_CHUNK_ELEMENTS:
        chunk = max(1, _HEAD_CHUNK_ELEMENTS // vocab)
        return ChunkedTargetLogprob.apply(hidden_N_H, head.weight, head.bias, targets_N, chunk)
    logits = head(hidden_N_H)  # (N, V)
    # cross_entropy is log_softmax + gather fused, without keeping (N, V) log-probs around.
    return -F.cross_entropy(logits.float(), targets_N, reduction="none")


def _logprobs_of(
    model: nn.Module,
    input_ids: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    loss_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    images_B: list[tuple[vision.ImageInput, ...]] | None = None,
) -> torch.Tensor:
    """Target log-probs of one model's rows.

    With a plain head, the vocabulary projection runs only on real (non-padding) positions, and
    when gradients are on, its backward only covers positions that carry loss (`loss_mask`).
    """
    batch, length = targets.shape
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in vision.VISION_MODEL_TYPES:
        if position_ids is not None:
            raise ValueError("packed rows are not supported for vision-language models")
        hidden = vision.hidden_states(model, input_ids, valid, images_B)
        return _head_of(cast("PreTrainedModel", model), hidden, targets, valid, loss_mask)
    if images_B is not None and any(images_B):
        raise ValueError(f"model type {model_type!r} has no vision tower: it cannot take images")
    if model_type not in _PLAIN_HEAD_MODEL_TYPES:
        if position_ids is not None:
            raise ValueError("packed rows need a plain-head model type")
        logits = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
        flat = _head_logprobs(
            nn.Identity(), logits.reshape(batch * length, -1), targets.reshape(-1)
        )
        return flat.view(batch, length) * valid
    # The plain-head model types are transformers models.
    hf_model = cast("PreTrainedModel", model)
    hidden = hf_model.get_decoder()(
        input_ids=input_ids, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    return _head_of(hf_model, hidden, targets, valid, loss_mask)


def _head_of(
    hf_model: PreTrainedModel,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    loss_mask: torch.Tensor | None,
) -> torch.Tensor:
    """(B, T) target log-probs from the last hidden states, through the model's output head."""
    batch, length = targets.shape
    hidden_N_H = hidden.reshape(batch * length, -1)
    targets_N = targets.reshape(-1)
    head = hf_model.get_output_embeddings()
    # The batch row of every flattened position, for a head with per-row LoRA adapters.
    rows_N = torch.arange(batch, device=targets.device).repeat_interleave(length)
    out = torch.zeros(batch * length, device=targets.device)
    if torch.is_grad_enabled() and loss_mask is not None:
        with_grad = (loss_mask.reshape(-1) != 0).nonzero().squeeze(1)
        no_grad = ((loss_mask.reshape(-1) == 0) & (valid.reshape(-1) != 0)).nonzero().squeeze(1)
        with torch.no_grad():
            out[no_grad] = _head_logprobs(
                head, hidden_N_H[no_grad], targets_N[no_grad], rows_N[no_grad]
            )
        values = _head_logprobs(
            head, hidden_N_H[with_grad], targets_N[with_grad], rows_N[with_grad]
        )
        out = out.index_put((with_grad,), values)
    else:
        real = (valid.reshape(-1) != 0).nonzero().squeeze(1)
        out = out.index_put(
            (real,), _head_logprobs(head, hidden_N_H[real], targets_N[real], rows_N[real])
        )
    return out.view(batch, length)


def _run(
    policy: Policy | Sequence[Policy],
    datums: Sequence[Datum],
    loss_fn: str | LossFn | None,
    loss_fn_config: Mapping[str, float] | None,
    backward: bool,
    pack: bool | None,
    recompute: bool = False,
) -> FwdBwdResult:
    policies = _policies_per_row(policy, datums)
    fn = get_loss(loss_fn) if loss_fn is not None else None
    # A transformers model: its embedding accessor is invisible to nn.Module's typing.
    base_model: Any = policies[0].host.model
    device = base_model.get_input_embeddings().weight.device
    input_ids, targets, inputs, valid = _collate(datums, device)
    grad = torch.enable_grad() if backward else torch.no_grad()
    spec = vision.spec_of(base_model)
    images_B = [d.images for d in datums] if any(d.images for d in datums) else None
    # An image placeholder is the model's input, not a token it could predict: no loss on the
    # positions that precede one, whatever target the datum gives them.
    scored = valid if spec is None else valid * (_next_input(input_ids) != spec.image_token_id)
    if spec is not None:
        scored = scored * (targets != spec.image_token_id)
    mask = scored * inputs["mask"] if "mask" in inputs else scored
    # Positions whose log-prob gets a gradient; a zero SFT weight contributes none.
    grad_mask = mask
    if fn is not None and fn is LOSSES["cross_entropy"]:
        grad_mask = mask * (inputs["weights"] != 0) if "weights" in inputs else mask
    loss_mask = grad_mask if fn is not None else None
    layout = None
    if (
        pack is not False
        and spec is None
        and base_model.config.model_type in _PLAIN_HEAD_MODEL_TYPES
    ):
        lengths = [d.length for d in datums]
        layout = packing.plan(lengths, [p.id for p in policies], device, force=bool(pack))
    models: list[tuple[nn.Module, LoRAHost | None]] = [
        (p.host.model, p.host) if p.model is None else (p.model, None) for p in policies
    ]
    saving = recompute_layers.recomputed_all(models) if recompute and backward else nullcontext()
    with grad, saving:
        if layout is None:
            logprobs = _target_logprobs(
                policies, input_ids, targets, valid, loss_mask, None, images_B
            )
        else:
            packed = _target_logprobs(
                [policies[i] for i in layout.owner_datum],
                layout.gather(input_ids),
                layout.gather(targets),
                layout.gather(valid),
                None if loss_mask is None else layout.gather(loss_mask),
                layout.position_ids,
            )
            logprobs = layout.scatter(packed, *targets.shape)
        if spec is not None:
            logprobs = logprobs * scored
        metrics: dict[str, torch.Tensor] = {}
        if fn is not None:
            loss, metrics = fn(LossBatch(logprobs, inputs, mask), loss_fn_config or {})
            if backward:
                if not loss.requires_grad:
                    raise RuntimeError("the loss does not depend on any trainable parameter")
                loss.backward()
            metrics = {**metrics, "tokens:sum": mask.sum()}
    detached = logprobs.detach().cpu()
    lengths = [d.length for d in datums]
    names = list(metrics)
    # One device->host copy for all metrics instead of one sync per value.
    values = (
        torch.stack([metrics[n].detach().float().reshape(()) for n in names]).cpu().tolist()
        if names
        else []
    )
    return FwdBwdResult(
        logprobs=[detached[i, :n] for i, n in enumerate(lengths)],
        metrics=dict(zip(names, values, strict=True)),
    )


def forward_backward(
    policy: Policy | Sequence[Policy],
    datums: Sequence[Datum],
    loss_fn: str | LossFn,
    loss_fn_config: Mapping[str, float] | None = None,
    *,
    pack: bool | None = None,
    recompute: bool = False,
) -> FwdBwdResult:
    """Compute the summed loss and add its gradients to each policy's accumulated gradients.

    `policy` is one policy for all datums or one per datum. Gradients accumulate until
    `optim_step`. Returns each datum's target log-probabilities and the loss metrics.
    `pack`: lay the datums end to end in a few rows instead of padding each to the longest
    (`training.packing`); None packs when that saves enough work, True whenever the model
    type allows it, False never. `recompute`: activation checkpointing
    (`training.recompute`), less memory for about one more forward. The results are the
    same either way.
    """
    return _run(
        policy, datums, loss_fn, loss_fn_config, backward=True, pack=pack, recompute=recompute
    )


def forward(
    policy: Policy | Sequence[Policy],
    datums: Sequence[Datum],
    loss_fn: str | LossFn | None = None,
    loss_fn_config: Mapping[str, float] | None = None,
    *,
    pack: bool | None = None,
) -> FwdBwdResult:
    """Like `forward_backward` without gradients; metrics only if a loss is named."""
    return _run(policy, datums, loss_fn, loss_fn_config, backward=False, pack=pack)


def optim_step(policy: Policy, adam: AdamParams | None = None) -> dict[str, float]:
    """One AdamW step on the accumulated gradients, then clear them.

    Clips the global gradient norm when `adam.grad_clip_norm` is set. A non-finite gradient norm
    skips the update (the weights stay as they were) and is reported as `skipped = 1`.
    """
    return optim_steps([policy], [adam or AdamParams()])[0]


# Optimizer options that must agree for two param groups to update in one call.
_ADAM_FLAGS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")


def optim_steps(policies: Sequence[Policy], adams: Sequence[AdamParams]) -> list[dict[str, float]]:
    """`optim_step` of several policies at once, each with its own `AdamParams`.

    The gradient norms of all policies come from one foreach pass and one device->host copy,
    and the AdamW updates of all policies with equal hyperparameters run as one foreach
    update; each policy keeps its own parameters, optimizer state, clipping and metrics, so
    the result equals stepping them one by one.
    """
    if len(policies) != len(adams):
        raise ValueError(f"got {len(adams)} AdamParams for {len(policies)} policies")
    if len({id(p) for p in policies}) != len(policies):
        raise ValueError("a policy appears twice in one optim_steps call")
    for policy in policies:
        policy._check_open()
    grads_P = [[p.grad for p in policy.parameters() if p.grad is not None] for policy in policies]
    norms = _grad_norms(grads_P)
    skipped = [not math.isfinite(n) for n in norms]
    for grads, adam, norm in zip(grads_P, adams, norms, strict=True):
        clip = adam.grad_clip_norm
        if grads and clip is not None and clip > 0 and math.isfinite(norm):
            # As clip_grad_norm_: scale by max_norm / (norm + 1e-6), never up.
            torch._foreach_mul_(grads, min(1.0, clip / (norm + 1e-6)))
    updates: dict[tuple[Any, ...], list[tuple[torch.optim.Adam, dict[str, Any]]]] = {}
    for policy, adam, skip in zip(policies, adams, skipped, strict=True):
        if skip:
            continue
        for group in policy.optimizer.param_groups:
            group["lr"] = adam.learning_rate
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps
            group["weight_decay"] = adam.weight_decay
            key = (
                adam.learning_rate,
                adam.beta1,
                adam.beta2,
                adam.eps,
                adam.weight_decay,
                type(policy.optimizer),
                *(group.get(flag) for flag in _ADAM_FLAGS),
                group.get("decoupled_weight_decay"),
            )
            updates.setdefault(key, []).append((policy.optimizer, group))
    for members in updates.values():
        _adam_update(members)
    out = []
    for policy, adam, norm, skip in zip(policies, adams, norms, skipped, strict=True):
        if not skip:
            policy.step += 1
        policy.zero_grad()
        out.append(
            {
                "grad_norm": norm,
                "learning_rate": adam.learning_rate,
                "step": float(policy.step),
                "skipped": float(skip),
            }
        )
    return out


def _grad_norms(grads_P: Sequence[Sequence[torch.Tensor]]) -> list[float]:
    """The global L2 norm of each list of gradients (0.0 for an empty one)."""
    flat = [g for grads in grads_P for g in grads]
    if not flat:
        return [0.0] * len(grads_P)
    per_tensor = torch.stack([n.float() for n in torch._foreach_norm(flat)])  # (N,)
    totals = []
    start = 0
    for grads in grads_P:
        stop = start + len(grads)
        totals.append(torch.linalg.vector_norm(per_tensor[start:stop]))
        start = stop
    return [float(x) for x in torch.stack(totals).cpu().tolist()]


@torch.no_grad()
def _adam_update(members: list[tuple[torch.optim.Adam, dict[str, Any]]]) -> None:
    """One Adam(W) update over the param groups of several optimizers that share every
    hyperparameter, through each optimizer's own state (what `Adam.step` does per group)."""
    from torch.optim.adam import adam

    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    exp_avgs: list[torch.Tensor] = []
    exp_avg_sqs: list[torch.Tensor] = []
    max_exp_avg_sqs: list[torch.Tensor] = []
    state_steps: list[torch.Tensor] = []
    has_complex = False
    for optimizer, group in members:
        # Adam's own lazy state initialisation, so the state matches what step() writes.
        has_complex |= optimizer._init_group(
            group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
        )
    if not params:
        return
    group = members[0][1]
    beta1, beta2 = group["betas"]
    adam(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        max_exp_avg_sqs,
        state_steps,
        amsgrad=group["amsgrad"],
        has_complex=has_complex,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        foreach=group["foreach"],
        capturable=group["capturable"],
        differentiable=group["differentiable"],
        fused=group["fused"],
        decoupled_weight_decay=group.get("decoupled_weight_decay", False),
    )
