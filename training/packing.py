"""Packed batches: the datums of one forward laid end to end in a few rows instead of one
padded row each.

A batch of very different lengths (multi-turn transcripts of 10 to 1000 tokens) padded to its
longest datum spends most of its matmuls on padding. Packing places the datums, first-fit by
decreasing length, into rows as long as the longest datum; every datum restarts its position
ids at 0, and transformers reads the restarts as sequence boundaries (its packed-sequence
format), so attention is causal within each datum and blocked between datums
(block-diagonal). A row holds datums of one owner only (one LoRA adapter or one fully
fine-tuned model), so the per-row adapter routing of `LoRAHost.route` applies to packed rows
unchanged.

The plan maps packed slots to positions of the padded (B, T) layout, so callers collate as
before, gather the packed inputs and scatter the log-probs back: losses and results keep the
padded layout.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

# Pack only when the packed rows hold at most this fraction of the padded batch's positions:
# below it the saved work outweighs the block-diagonal mask that packing adds to attention.
PACK_MAX_FILL = 0.8


@dataclass(frozen=True)
class PackPlan:
    """Where each datum goes: `rows` packed rows of `length` positions."""

    rows: int
    length: int
    # (rows * length,) flat position of the padded (B, T) batch behind each packed slot; 0 on
    # the padding of a packed row (any valid index: those slots are masked out).
    source_S: torch.Tensor
    # (rows * length,) True where the slot holds a real token.
    real_S: torch.Tensor
    # (rows, length) position ids: 0.. within each datum and within each row's padding tail.
    position_ids: torch.Tensor
    # A datum of each packed row: its owner is the row's owner.
    owner_datum: list[int]

    def gather(self, padded_B_T: torch.Tensor) -> torch.Tensor:
        """The (rows, length) packed view of a (B, T) tensor; padding slots hold zeros."""
        flat = padded_B_T.reshape(-1)[self.source_S]
        return torch.where(self.real_S, flat, torch.zeros((), dtype=flat.dtype)).view(
            self.rows, self.length
        )

    def scatter(self, packed: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """The (B, T) padded layout of (rows, length) packed values; 0 on padding."""
        real = self.real_S.nonzero().squeeze(1)
        out = torch.zeros(batch * length, dtype=packed.dtype, device=packed.device)
        # Out-of-place index_put keeps the autograd graph of the packed values.
        return out.index_put((self.source_S[real],), packed.reshape(-1)[real]).view(batch, length)


def plan(
    lengths: Sequence[int],
    owners: Sequence[Hashable],
    device: torch.device,
    *,
    force: bool = False,
) -> PackPlan | None:
    """A packing of datums of `lengths`, each row holding datums of one owner; None when it
    would not save at least `1 - PACK_MAX_FILL` of the padded positions (unless `force`)."""
    if len(lengths) != len(owners):
        raise ValueError(f"got {len(owners)} owners for {len(lengths)} datums")
    padded_length = max(lengths)
    # owner -> list of rows, each row a list of datum indices, with the row's free space.
    rows: list[tuple[list[int], list[int]]] = []
    by_owner: dict[Hashable, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        candidates = by_owner.setdefault(owners[i], [])
        for r in candidates:
            if rows[r][1][0] >= lengths[i]:
                rows[r][0].append(i)
                rows[r][1][0] -= lengths[i]
                break
        else:
            candidates.append(len(rows))
            rows.append(([i], [padded_length - lengths[i]]))
    if not force and len(rows) * padded_length > PACK_MAX_FILL * len(lengths) * padded_length:
        return None
    source: list[int] = []
    real: list[bool] = []
    positions: list[int] = []
    for members, free in rows:
        for i in members:
            source.extend(range(i * padded_length, i * padded_length + lengths[i]))
            positions.extend(range(lengths[i]))
        source.extend([0] * free[0])
        positions.extend(range(free[0]))
        real.extend([True] * (padded_length - free[0]) + [False] * free[0])
    return PackPlan(
        rows=len(rows),
        length=padded_length,
        source_S=torch.tensor(source, dtype=torch.long, device=device),
        real_S=torch.tensor(real, dtype=torch.bool, device=device),
        position_ids=torch.tensor(positions, dtype=torch.long, device=device).view(
            len(rows), padded_length
        ),
        owner_datum=[members[0] for members, _ in rows],
    )
