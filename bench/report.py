"""The benchmarks' one way to record a result: their section of docs/benchmarks.md."""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach figure is a ratio to a baseline measured in the same run.\n"


def write_section(title: str, section: str, *, keep_subsections: bool = False) -> Path:
    """Replace the ``## {title}`` section (up to the next ``## ``) with ``section``, or append it.

    ``keep_subsections`` keeps the old section's ``### `` parts, which are written by hand.
    """
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else HEADER
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    found = pattern.search(text)
    if found:
        if keep_subsections:
            kept = found.group(0).partition("\n### ")
            if kept[1]:
                section = section.rstrip() + "\n\n### " + kept[2].rstrip() + "\n"
        text = pattern.sub(lambda _: section.rstrip() + "\n\n", text).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section.rstrip() + "\n"
    BENCHMARKS.write_text(text)
    return BENCHMARKS
