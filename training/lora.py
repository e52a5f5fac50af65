"""Multi-LoRA batching: many adapters share one frozen base model inside a single forward.

`LoRAHost` swaps the target `nn.Linear` modules of a model for `MultiLoRALinear`. Adapters are
registered under string keys (a policy's live weights under ``policy.id``, a published snapshot
under ``f"{policy.id}@{version}"``). Inside ``with host.route(keys_per_row):`` every forward runs
the base projection once over all rows, then for each adapter in the batch gathers its rows,
computes ``(x @ A^T) @ B^T * scaling`` and scatter-adds it back. Rows routed to ``None`` see the
base model only. The routing is per batch row, so prefill and KV-cache decode steps both use it.

The per-module hot path is kept small on purpose: the grouping of rows into adapters is computed
once per ``route()`` and shared by every wrapped module through one `_RouteState` object.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training import onednn, vision

# Projection names of Qwen2 / Llama / Mistral decoder layers.
DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
ALL_LINEAR = "all-linear"

AdapterWeights = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Group:
    key: str
    # None: the adapter covers every row, so no gather/scatter is needed.
    rows: torch.Tensor | None
    # (start, stop) when the rows are one contiguous range (a batch laid out adapter by
    # adapter): the LoRA path slices them instead of gathering and scattering.
    span: tuple[int, int] | None = None


@dataclass
class _Stacked:
    """Rows of K adapters laid out as K equal slots, so two bmm calls serve all adapters.

    Slot k holds the rows of adapter `keys[k]`, padded to the largest group with copies of its
    first row whose contribution is zeroed by `weight_K_G`.
    """

    keys: tuple[str, ...]
    # (K * G,) row of x behind each slot entry; None when the batch is already K equal
    # contiguous groups in key order (a view, no gather or scatter).
    index: torch.Tensor | None
    weight_K_G: torch.Tensor  # (K, G, 1, 1): adapter scaling, 0 on padding
    slots: int  # G


RouteSnapshot = tuple[tuple[_Group, ...], int, _Stacked | None]
"""What `LoRAHost.current_route` gives: the groups, the row count and the stacked weights."""


class _RouteState:
    """Routing shared by all wrapped modules of one host (one object, read per forward)."""

    # Distinct adapter combinations whose stacked weights are kept (a sampler's decode steps
    # reuse one combination; a model worker alternates between a few).
    STACK_CACHE_COMBINATIONS = 8

    def __init__(self) -> None:
        self.groups: tuple[_Group, ...] = ()
        self.num_rows: int = 0
        self.stacked: _Stacked | None = None
        # Keys registered frozen (published snapshots: never written after registration).
        self.frozen: set[str] = set()
        # adapter keys -> module name -> (A_K, B_K)
        self.stack_cache: OrderedDict[
            tuple[str, ...], dict[str, tuple[torch.Tensor, torch.Tensor]]
        ] = OrderedDict()

    def kept_stack(
        self, name: str, keys: tuple[str, ...]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stacked A and B of module `name` for `keys`, if kept (see `stack`)."""
        per_module = self.stack_cache.get(keys)
        if per_module is None:
            return None
        self.stack_cache.move_to_end(keys)
        return per_module.get(name)

    def stack(
        self,
        name: str,
        keys: tuple[str, ...],
        a_list: list[torch.Tensor],
        b_list: list[torch.Tensor],
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`torch.stack` of the adapters' A and B in `dtype`; kept across calls when every
        adapter is frozen (live training weights change in place and need their autograd
        graph)."""
        stacked = (torch.stack(a_list).to(dtype), torch.stack(b_list).to(dtype))
        if self.frozen.issuperset(keys):
            per_module = self.stack_cache.setdefault(keys, {})
            per_module[name] = stacked
            while len(self.stack_cache) > self.STACK_CACHE_COMBINATIONS:
                self.stack_cache.popitem(last=False)
        return stacked


class MultiLoRALinear(nn.Module):
    """A frozen base `nn.Linear` plus any number of registered low-rank adapters.

    `weight` and `bias` are the very Parameter objects of the wrapped Linear, so the model's
    state_dict keys do not change when a host is attached.
    """

    def __init__(self, base: nn.Linear, name: str, state: _RouteState) -> None:
        super().__init__()
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.name = name
        self._state = state
        # key -> (A [r, in], B [out, r], scaling). Plain dict: adapters are not module state.
        self.adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, adapters={len(self.adapters)}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_adapters(x, onednn.linear(x, self.weight, self.bias))

    def add_adapters(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out``, the base projection of ``x`` (computed here or, stacked with other
        modules', by the caller), plus the deltas of the adapters routed to ``x``'s rows."""
        groups = self._state.groups
        if not groups:
            return out
        if not out.is_contiguous():
            # A slice of a stacked projection: the batched path adds into a view of it.
            out = out.contiguous()
        if x.shape[0] != self._state.num_rows:
            raise RuntimeError(
                f"{self.name}: batch has {x.shape[0]} rows but the route names "
                f"{self._state.num_rows}"
            )
        stacked = self._state.stacked
        if stacked is not None and x.dim() == 3:
            result = self._forward_stacked(x, out, stacked)
            if result is not None:
                return result
        for group in groups:
            entry = self.adapters.get(group.key)
            if entry is None:
                # This adapter does not target this module.
                continue
            lora_a, lora_b, scaling = entry
            rows, span = group.rows, group.span
            if rows is None:
                xs = x
            elif span is not None:
                xs = x[span[0] : span[1]]
            else:
                xs = x.index_select(0, rows)
            if lora_a.dtype != xs.dtype:
                # A bf16 base with fp32 adapters (a GPU): the deltas in the activations' dtype,
                # the cast's backward carrying gradients to the fp32 weights, rather than an
                # fp32 copy of every activation.
                lora_a, lora_b = lora_a.to(xs.dtype), lora_b.to(xs.dtype)
            hidden = F.linear(xs, lora_a)  # (..., r)
            if rows is None and hidden.dtype == out.dtype:
                # One fused out + scaling * hidden @ B^T instead of mul, mm and add.
                out_2d = out.reshape(-1, self.out_features)
                out = torch.addmm(
                    out_2d, hidden.reshape(-1, hidden.shape[-1]), lora_b.t(), alpha=scaling
                ).view(out.shape)
                continue
            delta = F.linear(hidden, lora_b)
            if delta.dtype != out.dtype:
                delta = delta.to(out.dtype)
            # In place is safe for autograd: F.linear does not save its output.
            if rows is None:
                out = out + delta * scaling
            elif span is not None:
                out[span[0] : span[1]].add_(delta, alpha=scaling)
            else:
                out.index_add_(0, rows, delta, alpha=scaling)
        return out

    def routed_adapters(
        self,
    ) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float]]:
        """(batch rows or None for all, A, B, scaling) of each adapter of the current route
        that targets this module: for callers that apply the module to positions gathered
        from many rows (the output head of the training forward) and add the deltas
        themselves."""
        out = []
        for group in self._state.groups:
            entry = self.adapters.get(group.key)
            if entry is not None:
                out.append((group.rows, *entry))
        return out

    def _forward_stacked(
        self, x: torch.Tensor, out: torch.Tensor, stacked: _Stacked
    ) -> torch.Tensor | None:
        """All adapters in one gather, two bmm calls and one scatter; None if not applicable."""
        dtype = out.dtype
        kept = self._state.kept_stack(self.name, stacked.keys)
        if kept is None:
            entries = [self.adapters.get(key) for key in stacked.keys]
            present = [e for e in entries if e is not None]
            if len(present) < len(entries):
                return None
            a_list = [e[0] for e in present]
            b_list = [e[1] for e in present]
            rank = a_list[0].shape[0]
            if any(a.shape[0] != rank for a in a_list):
                # Mixed ranks: the per-adapter loop handles them.
                return None
            # (K, r, in) and (K, out, r), in the base's dtype (fp32 adapters on a bf16 base)
            kept = self._state.stack(self.name, stacked.keys, a_list, b_list, dtype)
        a_K, b_K = kept
        rank = a_K.shape[1]
        num_keys, slots = len(stacked.keys), stacked.slots
        length = x.shape[1]
        if stacked.index is None:
            xs = x.reshape(num_keys, slots * length, -1).to(dtype)
            hidden = torch.bmm(xs, a_K.transpose(1, 2)) * stacked.weight_K_G[:, 0]  # (K, G*T, r)
            # out += delta in one kernel, in place (safe: F.linear does not save its output).
            out.view(num_keys, slots * length, -1).baddbmm_(hidden, b_K.transpose(1, 2))
            return out
        xs = x.index_select(0, stacked.index).reshape(num_keys, slots * length, -1)
        hidden = torch.bmm(xs.to(dtype), a_K.transpose(1, 2))  # (K, G*T, r)
        hidden = (hidden.view(num_keys, slots, length, rank) * stacked.weight_K_G).view(
            num_keys, slots * length, rank
        )
        delta = torch.bmm(hidden, b_K.transpose(1, 2))  # (K, G*T, out)
        # In place is safe for autograd: F.linear does not save its output.
        return out.index_add_(0, stacked.index, delta.view(num_keys * slots, length, -1))


def _matches(name: str, targets: Sequence[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def output_layer_name(model: nn.Module) -> str | None:
    """Module name of the model's output projection (the unembedding, e.g. "lm_head")."""
    get_output = getattr(model, "get_output_embeddings", None)
    output_layer = get_output() if callable(get_output) else None
    if not isinstance(output_layer, (nn.Linear, MultiLoRALinear)):
        return None
    return next((name for name, m in model.named_modules() if m is output_layer), None)


def resolve_target_modules(model: nn.Module, target_modules: str | Iterable[str]) -> list[str]:
    """Full module names of the Linear layers selected by `target_modules`.

    `"all-linear"` selects every Linear except the output projection (as peft does);
    otherwise entries match a module name exactly or its last dotted components, so the
    output projection is selected only by its name (LoRA on the unembedding). The Linears of
    a vision-language model's vision tower are never selected (`training.vision`).
    """
    spec = vision.spec_of(model)
    output_layer: nn.Module | None = None
    get_output = getattr(model, "get_output_embeddings", None)
    if callable(get_output) and target_modules == ALL_LINEAR:
        output_layer = get_output()
    linear_types = (nn.Linear, MultiLoRALinear)
    if isinstance(target_modules, str):
        if target_modules != ALL_LINEAR:
            target_modules = [target_modules]
    else:
        target_modules = list(target_modules)
        if not target_modules:
            raise ValueError("target_modules must not be empty")
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, linear_types) or module is output_layer:
            continue
        if vision.in_tower(name, spec):
            continue
        if target_modules == ALL_LINEAR or _matches(name, target_modules):
            names.append(name)
    if not names:
        raise ValueError(f"target_modules {target_modules!r} match no Linear layer of the model")
    return names


class LoRAHost:
    """Owns the `MultiLoRALinear` modules of one model and the registry of adapters."""

    def __init__(
        self,
        model: nn.Module,
        target_modules: str | Iterable[str] = ALL_LINEAR,
        *,
        stack_min_adapters: int = 3,
    ):
        """`stack_min_adapters`: from this many adapters in one batch on, the deltas run as
        one grouped bmm instead of a loop over adapters (fewer, larger kernels)."""
        self.model = model
        self.stack_min_adapters = stack_min_adapters
        self._state = _RouteState()
        self._lock = threading.RLock()
        self._scalings: dict[str, float] = {}
        self.modules: dict[str, MultiLoRALinear] = {}
        for name in resolve_target_modules(model, target_modules):
            module = model.get_submodule(name)
            if isinstance(module, MultiLoRALinear):
                raise TypeError(f"{name} is already wrapped by another LoRAHost")
            # resolve_target_modules selects Linear and MultiLoRALinear layers only.
            assert isinstance(module, nn.Linear)
            wrapped = MultiLoRALinear(module, name, self._state)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, wrapped)
            self.modules[name] = wrapped

    # -- registry -------------------------------------------------------------------------

    @property
    def keys(self) -> list[str]:
        return list(self._scalings)

    def __contains__(self, key: object) -> bool:
        return key in self._scalings

    def module_names(self) -> list[str]:
        return list(self.modules)

    def register(
        self, key: str, weights: AdapterWeights, scaling: float, *, frozen: bool = False
    ) -> None:
        """Attach adapter `key`: `weights[module_name] = (A [r, in], B [out, r])`.

        The tensors are used as given (no copy): pass nn.Parameters for live training
        weights, detached clones for immutable snapshots. `frozen=True` promises that the
        tensors are never written again (a published snapshot, loaded sampler weights): the
        batched LoRA path may then keep stacked copies of them across calls.
        """
        if not isinstance(key, str) or not key:
            raise ValueError("adapter key must be a non-empty string")
        if key in self._scalings:
            raise KeyError(f"adapter {key!r} is already registered")
        if not weights:
            raise ValueError(f"adapter {key!r}: no weights given")
        checked: list[tuple[MultiLoRALinear, torch.Tensor, torch.Tensor]] = []
        for name, pair in weights.items():
            module = self.modules.get(name)
            if module is None:
                raise KeyError(f"adapter {key!r}: {name!r} is not a module wrapped by this host")
            lora_a, lora_b = pair
            if lora_a.dim() != 2 or lora_b.dim() != 2:
                raise ValueError(f"adapter {key!r}: {name}: A and B must be 2-d")
            rank = lora_a.shape[0]
            if lora_a.shape[1] != module.in_features:
                raise ValueError(
                    f"adapter {key!r}: {name}: A has shape {tuple(lora_a.shape)}, expected "
                    f"[r, {module.in_features}]"
                )
            if tuple(lora_b.shape) != (module.out_features, rank):
                raise ValueError(
                    f"adapter {key!r}: {name}: B has shape {tuple(lora_b.shape)}, expected "
                    f"[{module.out_features}, {rank}]"
                )
            if lora_a.device != module.weight.device or lora_b.device != module.weight.device:
                raise ValueError(
                    f"adapter {key!r}: {name}: weights on {lora_a.device}, model on "
                    f"{module.weight.device}"
                )
            checked.append((module, lora_a, lora_b))
        with self._lock:
            for module, lora_a, lora_b in checked:
                module.adapters[key] = (lora_a, lora_b, float(scaling))
            self._scalings[key] = float(scaling)
            if frozen:
                self._state.frozen.add(key)

    def unregister(self, key: str) -> None:
        with self._lock:
            if key not in self._scalings:
                raise KeyError(f"adapter {key!r} is not registered")
            for module in self.modules.values():
                module.adapters.pop(key, None)
            del self._scalings[key]
            self._state.frozen.discard(key)
            for combination in [c for c in self._state.stack_cache if key in c]:
                del self._state.stack_cache[combination]

    def weights(self, key: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The registered tensors of adapter `key` (the same objects, not copies)."""
        if key not in self._scalings:
            raise KeyError(f"adapter {key!r} is not registered")
        return {
            name: (m.adapters[key][0], m.adapters[key][1])
            for name, m in self.modules.items()
            if key in m.adapters
        }

    def scaling(self, key: str) -> float:
        if key not in self._scalings:
            raise KeyError(f"adapter {key!r} is not registered")
        return self._scalings[key]

    # -- routing --------------------------------------------------------------------------

    @contextmanager
    def route(self, keys_per_row: Sequence[str | None]) -> Iterator[None]:
        """Route row i of every forward inside the block through adapter `keys_per_row[i]`.

        The block holds the host's lock: one routed computation at a time per model.
        """
        keys = list(keys_per_row)
        if not keys:
            raise ValueError("route: keys_per_row is empty")
        unknown = sorted({k for k in keys if k is not None and k not in self._scalings})
        if unknown:
            raise KeyError(f"route: adapters not registered: {unknown}")
        device = next(iter(self.modules.values())).weight.device
        rows_by_key: dict[str, list[int]] = {}
        for row, key in enumerate(keys):
            if key is not None:
                rows_by_key.setdefault(key, []).append(row)
        groups = []
        for key, rows in rows_by_key.items():
            if len(rows) == len(keys):
                groups.append(_Group(key, None))
            else:
                # Rows are listed in increasing order: contiguous iff first..last has no gap.
                span = (rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else None
                tensor = torch.tensor(rows, dtype=torch.long, device=device)
                groups.append(_Group(key, tensor, span))
        stacked = None
        if len(rows_by_key) >= max(2, self.stack_min_adapters):
            # Adapters in a canonical order: the stacked weights are kept per combination
            # (`_RouteState.stack_cache`), and a continuous batch whose rows come and go
            # meets the same combination in many orders.
            ordered = {key: rows_by_key[key] for key in sorted(rows_by_key)}
            stacked = self._stack(ordered, len(keys), device)
        with self.replay_route((tuple(groups), len(keys), stacked)):
            yield

    def current_route(self) -> RouteSnapshot:
        """The routing in force, to run a forward again later under it (`replay_route`): a
        layer whose activations are recomputed in backward, after `route` has exited."""
        state = self._state
        return (state.groups, state.num_rows, state.stacked)

    @contextmanager
    def replay_route(self, snapshot: RouteSnapshot) -> Iterator[None]:
        """Route as `snapshot` says inside the block (holding the host's lock)."""
        with self._lock:
            state = self._state
            previous = (state.groups, state.num_rows, state.stacked)
            state.groups, state.num_rows, state.stacked = snapshot
            try:
                yield
            finally:
                state.groups, state.num_rows, state.stacked = previous

    def _stack(
        self, rows_by_key: dict[str, list[int]], num_rows: int, device: torch.device
    ) -> _Stacked:
        slots = max(len(rows) for rows in rows_by_key.values())
        index: list[int] = []
        weight: list[list[float]] = []
        for key, rows in rows_by_key.items():
            pad = slots - len(rows)
            index.extend(rows + [rows[0]] * pad)
            scaling = self._scalings[key]
            weight.append([scaling] * len(rows) + [0.0] * pad)
        dtype = next(iter(self.modules.values())).weight.dtype
        in_order = index == list(range(num_rows))
        return _Stacked(
            keys=tuple(rows_by_key),
            index=None if in_order else torch.tensor(index, dtype=torch.long, device=device),
            weight_K_G=torch.tensor(weight, dtype=dtype, device=device)[:, :, None, None],
            slots=slots,
        )

    # -- teardown -------------------------------------------------------------------------

    def detach(self) -> None:
        """Put the original Linear layers back (weights shared, adapters dropped)."""
        for name, module in self.modules.items():
            linear = nn.Linear(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                device="meta",
            )
            linear.weight = module.weight
            linear.bias = module.bias
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, child, linear)
        self.modules = {}
        self._state.stack_cache.clear()
        self._state.frozen.clear()
        self._scalings = {}


def unwrap_linears(model: nn.Module) -> nn.Module:
    """Replace every MultiLoRALinear in `model` (e.g. a deep copy) by a plain Linear, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, MultiLoRALinear):
            linear = nn.Linear(
                module.in_features, module.out_features, bias=module.bias is not None, device="meta"
            )
            linear.weight = module.weight
            linear.bias = module.bias
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, linear)
    return model
