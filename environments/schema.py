"""What an environment's dataset must hold: its required columns, their types and meaning.

Kept apart from `environments.datasets` (reading and validating files) so that the registry,
which declares each environment's schema, and the file readers, which look schemas up in the
registry, depend on it and not on each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Column:
    name: str
    types: tuple[type, ...]
    non_empty: bool = True
    description: str = ""
    check: Callable[[Any], str | None] | None = None
    """What is wrong with a value of the right type (None: nothing), e.g. an undecodable
    image."""
    required: bool = True
    """False: a row may leave the column out (or null); when present it is checked."""

    def type_names(self) -> str:
        names = dict.fromkeys("number" if t in (int, float) else t.__name__ for t in self.types)
        return " or ".join(names)


@dataclass(frozen=True)
class DatasetSchema:
    """The columns of an environment's dataset (required unless marked optional); extra
    columns are kept and ignored."""

    columns: tuple[Column, ...]

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "name": c.name,
                "type": c.type_names(),
                "description": c.description,
                "required": c.required,
            }
            for c in self.columns
        ]
