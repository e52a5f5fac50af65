"""A fix to verl 0.9.1 that vision-language jobs need, loaded into every verl process.

The verl runner puts this directory on the trainer's ``PYTHONPATH`` and names this module in
``VERL_USE_EXTERNAL_MODULES`` for every block, GPU or CPU (verl's ``__init__`` imports it in
the driver and in every Ray worker).

verl turns a batch's padded position ids into a nested tensor with
``torch.nested.as_nested_tensor`` (``verl/workers/utils/padding.py``,
``left_right_2_no_padding``). For a vision-language model each row's ids are
``(4, length)`` (the text position and the three rotary axes), and torch makes the varying
dimension the ragged one: the length, as verl's engine expects (``values()`` of shape
``(4, total)``). When every row of a batch happens to have the same length, nothing varies
and torch makes the 4 ragged instead; the batch is then split, merged or padded as if its
ids were the transposed tensor, and the step fails ("The size of tensor a (4) must match the
size of tensor b (0)") or reads wrong positions. Measured: a verl job on the geometry env
failed at one step in four this way. The fix rebuilds such a batch's ids with the length as
the ragged dimension, which is what torch gives whenever the lengths differ.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

PADDING = "verl.workers.utils.padding"


def length_ragged(position_ids: Any) -> Any:
    """``(rows, 4, length)`` position ids with the length as the ragged dimension."""
    import torch

    if not (position_ids.is_nested and position_ids.dim() == 3):
        return position_ids
    if getattr(position_ids, "_ragged_idx", 2) == 2:
        return position_ids
    rows = list(position_ids.unbind(0))  # (4, length) each: the ragged 4 unbinds correctly
    lengths = torch.tensor([0] + [r.shape[1] for r in rows], device=rows[0].device)
    return torch.nested.nested_tensor_from_jagged(
        torch.cat(rows, dim=1), offsets=lengths.cumsum(0), jagged_dim=2
    )


def _patch(padding: Any) -> None:
    original = padding.left_right_2_no_padding

    def left_right_2_no_padding(data: Any) -> Any:
        data = original(data)
        # A TensorDict refuses `in` itself: its keys answer it.
        if "position_ids" in data.keys():  # noqa: SIM118
            data["position_ids"] = length_ragged(data["position_ids"])
        return data

    left_right_2_no_padding.__wrapped__ = original  # type: ignore[attr-defined]
    padding.left_right_2_no_padding = left_right_2_no_padding


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _AfterPadding(importlib.abc.MetaPathFinder):
    """Patches the module as it is imported, so that every ``from ... import`` of the
    function (verl's trainer has one) gets the fixed one."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != PADDING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


if PADDING in sys.modules:
    _patch(sys.modules[PADDING])
elif not any(isinstance(f, _AfterPadding) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterPadding())
