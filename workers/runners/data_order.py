"""The order a run visits its data in, and the seeds derived from positions in it.

Everything random in a run is derived from (seed, position): row order from (seed, epoch),
generator env seeds from the example's position, sampling seeds from (seed, step, row, turn).
A cursor into the order is therefore a complete description of the position in the data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from workers.runners.loop_types import TrainingError

__all__ = ["DataOrder", "mix_seed"]

_SEED_MOD = 2**61 - 1


@dataclass
class DataOrder:
    """Example i of the run is row ``perm(epoch)[i % n]`` with ``epoch = i // n``; each
    epoch's permutation comes from (seed, epoch) alone."""

    size: int
    seed: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise TrainingError("the dataset has no rows to train on")
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # one epoch at a time is all a run touches
        return perm

    def take(self, cursor: int, count: int) -> list[int]:
        return [self._perm(i // self.size)[i % self.size] for i in range(cursor, cursor + count)]


def mix_seed(*parts: int) -> int:
    """One seed from a tuple of positions (run seed, step, group, episode, turn, ...)."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part) + 1) % _SEED_MOD
    return value
