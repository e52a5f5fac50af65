"""What a training job leaves in its workdir, as the API lists and serves it.

The runner (``workers.runners.native``) writes under ``<OPENTINKER_DATA_DIR>/jobs/<job id>/``:
``checkpoints/<name>/state.pt`` indexed by ``checkpoints/checkpoints.jsonl``, ``adapter/``
(PEFT) or ``model/`` (full fine-tuning), ``eval/step-*.jsonl`` transcripts (an eval job:
``eval/transcripts.jsonl``) and ``summary.json``. The files are the record; this module only
reads them, and every name that comes from a URL is checked against what is listed, so no
path outside the workdir is served.
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path
from typing import IO, Any

from django.conf import settings

CHECKPOINT_INDEX = "checkpoints.jsonl"
CHECKPOINT_STATE = "state.pt"
# Directories served as one zip; files served as they are.
ARTIFACT_DIRS = {"adapter": "adapter", "model": "model"}
ARTIFACT_FILES = {"summary.json": "summary"}
# Served from the database (the job's metric rows), not from the workdir.
METRICS_ARTIFACT = "metrics.jsonl"


def workdir(job_id: Any) -> Path:
    """The job's working directory (same rule as ``workers.tasks.job_workdir``; not created)."""
    return Path(settings.OPENTINKER_DATA_DIR) / "jobs" / str(job_id)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def checkpoints(job_id: Any) -> list[dict[str, Any]]:
    """Checkpoints whose state file exists, oldest first (a torn index line is skipped)."""
    root = workdir(job_id) / "checkpoints"
    index = root / CHECKPOINT_INDEX
    if not index.is_file():
        return []
    out: dict[str, dict[str, Any]] = {}
    for line in index.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        name = str(record.get("name", ""))
        state = root / name / CHECKPOINT_STATE
        if not name or "/" in name or name.startswith(".") or not state.is_file():
            continue
        extra = record.get("extra") or {}
        # A resumed run may save a step again: the later line wins.
        out[name] = {
            "name": name,
            "step": int(extra.get("step", record.get("step", 0))),
            "created": float(record.get("created", 0.0)),
            "attempt": extra.get("attempt"),
            "eval": extra.get("eval") or {},
            "size_bytes": state.stat().st_size,
        }
    return sorted(out.values(), key=lambda c: (c["step"], c["created"]))


def checkpoint_file(job_id: Any, name: str) -> Path | None:
    if not any(c["name"] == name for c in checkpoints(job_id)):
        return None
    return workdir(job_id) / "checkpoints" / name / CHECKPOINT_STATE


def adapter_dir(job_id: Any) -> Path | None:
    """The job's final PEFT adapter directory, once the run has exported it."""
    path = workdir(job_id) / "adapter"
    return path if (path / "adapter_model.safetensors").is_file() else None


def artifacts(job_id: Any) -> list[dict[str, Any]]:
    """The final weights, the summary and the eval transcripts that exist now."""
    root = workdir(job_id)
    out: list[dict[str, Any]] = []
    for name, kind in ARTIFACT_DIRS.items():
        path = root / name
        if path.is_dir():
            files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
            out.append(
                {
                    "name": name,
                    "kind": kind,
                    "format": "zip",
                    "files": files,
                    "size_bytes": _size(path),
                }
            )
    for name, kind in ARTIFACT_FILES.items():
        path = root / name
        if path.is_file():
            out.append(
                {
                    "name": name,
                    "kind": kind,
                    "format": "json",
                    "files": [name],
                    "size_bytes": _size(path),
                }
            )
    eval_dir = root / "eval"
    if eval_dir.is_dir():
        # step-*.jsonl: a training run's evaluations; transcripts.jsonl: an eval job's.
        for path in sorted(eval_dir.glob("*.jsonl")):
            out.append(
                {
                    "name": f"eval/{path.name}",
                    "kind": "eval",
                    "format": "jsonl",
                    "files": [path.name],
                    "size_bytes": _size(path),
                }
            )
    return out


def artifact_path(job_id: Any, name: str) -> Path | None:
    if not any(a["name"] == name for a in artifacts(job_id)):
        return None
    return workdir(job_id) / name


def zip_directory(path: Path) -> IO[bytes]:
    """A zip of `path`'s files (names relative to it), rewound; spills to disk when large."""
    spool = tempfile.SpooledTemporaryFile(max_size=64 * 1024 * 1024)  # noqa: SIM115
    with zipfile.ZipFile(spool, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            zf.write(file, arcname=str(file.relative_to(path)))
    spool.seek(0)
    return spool  # type: ignore[return-value]
