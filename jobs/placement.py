"""Whether a block of GPUs could be placed on a set of nodes: one rule for the submission check
(``jobs.services``, against every node ever announced) and the dispatcher's reservations
(``workers.dispatcher``, against the live nodes). The lock table's allocator takes exactly such
a placement when the GPUs are free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["fits", "nodes_needed", "too_large_reason"]


def nodes_needed(gpus: int, per_node: int | None) -> int:
    """Nodes a block spans: one, or ``ceil(gpus / per_node)`` for a gang."""
    if per_node is None or per_node >= gpus:
        return 1
    return math.ceil(gpus / per_node)


def fits(sizes: Iterable[int], gpus: int, per_node: int | None) -> bool:
    """True when nodes of these sizes (GPUs each) can hold the block: ``per_node`` GPUs on
    each of ``nodes_needed - 1`` distinct nodes and the rest on one more."""
    per = gpus if per_node is None else min(per_node, gpus)
    k = nodes_needed(gpus, per_node)
    rest = gpus - (k - 1) * per
    sizes = list(sizes)
    return sum(1 for s in sizes if s >= per) >= k - 1 and sum(1 for s in sizes if s >= rest) >= k


def too_large_reason(sizes: Iterable[int], gpus: int, per_node: int | None) -> str:
    sizes = sorted(sizes, reverse=True)
    k = nodes_needed(gpus, per_node)
    if k == 1:
        return f"the job asks for {gpus} GPUs but the largest node has {sizes[0] if sizes else 0}"
    per = min(per_node or gpus, gpus)
    enough = sum(1 for s in sizes if s >= per)
    return (
        f"the job asks for {gpus} GPUs, {per} per node, on {k} nodes, but {enough} of the "
        f"{len(sizes)} nodes have {per} GPUs"
    )
