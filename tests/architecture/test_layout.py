"""Files of one idea: no Python module of the project over 600 lines (migrations aside)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600


def _project_modules() -> list[Path]:
    # Tracked and new files alike, but nothing git ignores (the venv, var/).
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if "migrations" not in Path(name).parts]


def test_it_keeps_every_module_under_600_lines() -> None:
    modules = _project_modules()
    assert len(modules) > 100
    long = sorted(
        (lines, path.relative_to(ROOT).as_posix())
        for path in modules
        if path.is_file() and (lines := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert not long, "modules over 600 lines: " + ", ".join(f"{p} ({n})" for n, p in long)
