"""Dataset rows for the end-to-end jobs."""

from __future__ import annotations

from typing import Any

from training import data


def addition_rows(n: int, offset: int = 0) -> list[dict[str, Any]]:
    """Rows of the math env's schema from the base model's pre-training split of additions."""
    train = data.addition_split()[0]
    return [
        {"question": p.question(i), "answer": str(p.answer)}
        for i, p in enumerate(train[offset : offset + n])
    ]
