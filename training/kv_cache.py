"""The KV cache of `training.decoder.FusedDecoder`: slots that rows of a continuous batch
join and leave without copying the others.

`keys` and `values` (layers, rows, kv_heads, capacity, head_dim) are views of the first
`rows` slots of larger stores, filled up to `length`; `bias_B_T` is 0 where a row may attend
and -inf on its left padding. A row that joins is written into a free slot (`join`), a row
that leaves is overwritten by one from the end (`select` with a `compaction_order`), and the
columns no live row attends to any more are dropped from time to time (`trim`): a batch that
rows keep joining and leaving would otherwise attend over, and hold, its whole history.
"""

from __future__ import annotations

import torch

# A continuous batch drops the cache columns left of every live row's first one once they are
# at least this many and a quarter of its length (a copy of the cache, so not at every step).
TRIM_MIN_COLUMNS = 16


def _first_live_column(bias_B_T: torch.Tensor, length: int) -> int:
    """The first cache column below ``length`` that some row attends to (0 if none)."""
    live_T = (bias_B_T[:, :length] == 0).any(dim=0)
    return int(live_T.to(torch.uint8).argmax()) if bool(live_T.any()) else 0


def compaction_order(rows: int, keep: list[int]) -> list[int]:
    """The order in which to keep the rows ``keep`` (increasing positions among ``rows``)
    that moves the fewest: each kept row stays where it is, except those beyond the new end,
    which fill the places of the rows that left (`KVCache.select` then copies only them)."""
    n = len(keep)
    kept = set(keep)
    tail = [i for i in keep if i >= n]
    order = []
    for j in range(n):
        order.append(j if j in kept else tail.pop())
    return order


class KVCache:
    """One decode call's (or continuous batch's) cache; see the module's docstring."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        bias_B_T: torch.Tensor,
        cos_T_D: torch.Tensor,
        sin_T_D: torch.Tensor,
        length: int,
    ) -> None:
        self.key_store = keys
        self.value_store = values
        self.bias_store = bias_B_T
        self.rows = keys.shape[1]
        self.cos_T_D = cos_T_D
        self.sin_T_D = sin_T_D
        self.length = length
        self._views()

    def _views(self) -> None:
        self.keys = self.key_store[:, : self.rows]
        self.values = self.value_store[:, : self.rows]
        self.bias_B_T = self.bias_store[: self.rows]

    @property
    def slots(self) -> int:
        return self.key_store.shape[1]

    @property
    def capacity(self) -> int:
        return self.key_store.shape[3]

    def use(self, rows: int) -> None:
        self.rows = rows
        self._views()

    def replace(
        self, keys: torch.Tensor, values: torch.Tensor, bias_B_T: torch.Tensor, rows: int
    ) -> None:
        self.key_store, self.value_store, self.bias_store = keys, values, bias_B_T
        self.use(rows)

    def select(self, index_B: torch.Tensor) -> None:
        """Keep the rows ``index_B``, in that order.

        An index that keeps each row in place or moves rows from beyond its end into the
        slots of rows that left (`compaction_order`) costs a copy of the moved rows only;
        any other index, a copy of the cache. The columns left of the first one any kept row
        attends to go with the rows that needed them (`TRIM_MIN_COLUMNS`): a continuous batch
        that rows keep joining and leaving would otherwise attend over (and hold) a cache as
        long as its whole history."""
        order = index_B.tolist()
        n = len(order)
        in_place = len(set(order)) == n and all(
            i == j or n <= i < self.rows for j, i in enumerate(order)
        )
        if in_place:
            moves = [(j, i) for j, i in enumerate(order) if i != j]
            if moves:
                dst = torch.tensor([j for j, _ in moves], device=index_B.device)
                src = torch.tensor([i for _, i in moves], device=index_B.device)
                for store in (self.key_store, self.value_store):
                    store[:, dst] = store[:, src]
                self.bias_store[dst] = self.bias_store[src]
            self.use(n)
            start = _first_live_column(self.bias_B_T, self.length)
            if start >= TRIM_MIN_COLUMNS and 4 * start >= self.length:
                self.trim(start)
            return
        bias = self.bias_B_T.index_select(0, index_B)
        start = _first_live_column(bias, self.length)
        self.replace(
            self.keys[:, :, :, start:].index_select(1, index_B),
            self.values[:, :, :, start:].index_select(1, index_B),
            bias[:, start:].contiguous(),
            n,
        )
        self.length -= start

    def join(self, other: KVCache) -> None:
        """Append the rows of `other` (a prefill of new prompts) to those of `self`, which
        may be mid-decode: continuous batching.

        Both caches are right-aligned at their current length (every row's next token is
        written at the same column), so the shorter one is shifted right and its new left
        columns are padding. Positions are per row (rotary is applied before caching), so a
        row's column offset changes nothing it computes. When `self` has free slots, its
        prompt fits left of the current column and its room suffices, the new rows are
        written into those slots and nothing else moves; otherwise both go into larger
        stores, with room for more rows and columns so that the next joins fit.
        """
        rows, new = self.rows, other.rows
        t, u = self.length, other.length
        room_new = other.capacity - u
        if rows + new <= self.slots and u <= t and t + room_new <= self.capacity:
            for mine, theirs in ((self.key_store, other.keys), (self.value_store, other.values)):
                mine[:, rows : rows + new, :, : t - u] = 0
                mine[:, rows : rows + new, :, t - u : t] = theirs[:, :, :, :u]
            bias = self.bias_store[rows : rows + new]
            bias[:, : t - u] = float("-inf")
            bias[:, t - u : t] = other.bias_B_T[:, :u]
            bias[:, t:] = 0
            if other.cos_T_D.shape[0] > self.cos_T_D.shape[0]:
                self.cos_T_D, self.sin_T_D = other.cos_T_D, other.sin_T_D
            self.use(rows + new)
            return
        # Columns left of every row's first attended one are dropped on the way.
        s0 = _first_live_column(self.bias_B_T, t)
        s1 = _first_live_column(other.bias_B_T, u)
        t, u = t - s0, u - s1
        length = max(t, u)
        room = max(self.capacity - self.length, room_new)
        capacity = length + room + max(length, TRIM_MIN_COLUMNS)
        total = rows + new
        slots = max(total, 2 * self.slots)
        layers, _, kv_heads, _, head_dim = self.keys.shape
        merged = []
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            both = mine.new_empty((layers, slots, kv_heads, capacity, head_dim))
            both[:, :rows, :, : length - t] = 0
            both[:, :rows, :, length - t : length] = mine[:, :, :, s0 : s0 + t]
            both[:, rows:total, :, : length - u] = 0
            both[:, rows:total, :, length - u : length] = theirs[:, :, :, s1 : s1 + u]
            merged.append(both)
        bias = self.bias_B_T.new_zeros((slots, capacity))
        bias[:total, :length] = float("-inf")
        bias[:rows, length - t : length] = self.bias_B_T[:, s0 : s0 + t]
        bias[rows:total, length - u : length] = other.bias_B_T[:, s1 : s1 + u]
        if other.cos_T_D.shape[0] > self.cos_T_D.shape[0]:
            self.cos_T_D, self.sin_T_D = other.cos_T_D, other.sin_T_D
        self.replace(merged[0], merged[1], bias, total)
        self.length = length

    def _columns(self, start: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New key and value stores of ``capacity`` columns holding the live rows' columns
        from ``start`` to the cache's length, at their left."""
        rows, end = self.rows, self.length
        moved = []
        for store in (self.key_store, self.value_store):
            layers, slots, kv_heads, _, head_dim = store.shape
            new = store.new_empty((layers, slots, kv_heads, capacity, head_dim))
            new[:, :rows, :, : end - start] = store[:, :rows, :, start:end]
            moved.append(new)
        return moved[0], moved[1]

    def grow(self, capacity: int, cos_T_D: torch.Tensor, sin_T_D: torch.Tensor) -> None:
        """Room for ``capacity`` columns (rotary tables as long): the rows' written columns
        and padding move to larger stores. A batch starts with room for its first tokens
        only and grows as rows keep decoding, so that a request that may run to the end of
        a long context holds that memory only if it gets there."""
        rows, end = self.rows, self.length
        keys, values = self._columns(0, capacity)
        bias = self.bias_store.new_zeros((self.bias_store.shape[0], capacity))
        bias[:rows, :end] = self.bias_store[:rows, :end]
        self.cos_T_D, self.sin_T_D = cos_T_D, sin_T_D
        self.replace(keys, values, bias, rows)

    def trim(self, start: int) -> None:
        """Drop the cache columns left of ``start``, which no row attends to."""
        rows, end = self.rows, self.length
        keys, values = self._columns(start, self.capacity - start)
        self.replace(keys, values, self.bias_store[:, start:].clone(), rows)
        self.length = end - start
