"""A directory of training checkpoints with a `checkpoints.jsonl` index, for resumable runs.

Layout: ``<root>/<name>/state.pt`` (what `Policy.save_state` writes) plus one JSON line per
checkpoint in ``<root>/checkpoints.jsonl``: name, step, path, created and the caller's `extra`
(e.g. a data cursor). A line is appended only after its state file is fully written, so a run
killed mid-save resumes from the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from training.policy import Policy

INDEX = "checkpoints.jsonl"
STATE_FILE = "state.pt"


class CheckpointDir:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @property
    def index_path(self) -> Path:
        return self.root / INDEX

    def save(
        self, policy: Policy, name: str | None = None, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Save `policy`'s full training state; returns the index record."""
        name = name or f"step-{policy.step:06d}"
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"checkpoint name {name!r} must be a plain directory name")
        path = policy.save_state(self.root / name / STATE_FILE)
        record = {
            "name": name,
            "step": policy.step,
            "path": str(path),
            "created": time.time(),
            "extra": extra or {},
        }
        self.root.mkdir(parents=True, exist_ok=True)
        with self.index_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        return record

    def records(self) -> list[dict[str, Any]]:
        """Index records whose state file exists, oldest first (a torn last line is skipped)."""
        if not self.index_path.exists():
            return []
        out = []
        for line in self.index_path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if Path(record.get("path", "")).is_file():
                out.append(record)
        return out

    def latest(self) -> dict[str, Any] | None:
        records = self.records()
        return records[-1] if records else None

    def resume(self, policy: Policy) -> dict[str, Any] | None:
        """Load the latest checkpoint into `policy`; its record, or None if there is none."""
        record = self.latest()
        if record is not None:
            policy.load_state(record["path"])
        return record
