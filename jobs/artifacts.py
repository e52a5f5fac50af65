"""What a training job leaves in its workdir, as the API lists and serves it.

The runner (``workers.runners.native``) writes under ``<OPENTINKER_DATA_DIR>/jobs/<job id>/``:
``checkpoints/<name>/state.pt`` indexed by ``checkpoints/checkpoints.jsonl``, ``adapter/``
(PEFT) or ``model/`` (full fine-tuning), ``eval/step-*.jsonl`` transcripts (an eval job:
``eval/transcripts.jsonl``) and ``summary.json``. The files are the record; this module only
reads them, and every name that comes from a URL is checked against what is listed, so no
path outside the workdir is served.

The verl runner (``workers.runners.verl``) adds index lines with ``extra.runner == "verl"``
for the checkpoints verl itself writes under ``verl/checkpoints/global_step_<N>/`` (``data.pt``
and ``actor/``: FSDP shards ``model|optim|extra_state_world_size_<W>_rank_<R>.pt``,
``fsdp_config.json``, ``huggingface/`` config and tokenizer, ``lora_adapter/`` with LoRA).
They are listed with ``kind: "verl"`` and download as one zip of that directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from django.conf import settings

CHECKPOINT_INDEX = "checkpoints.jsonl"
CHECKPOINT_STATE = "state.pt"
# Where the verl runner points verl's trainer.default_local_dir, relative to the workdir.
VERL_CHECKPOINT_DIR = Path("verl") / "checkpoints"
VERL_CHECKPOINT_NAME = re.compile(r"global_step_(\d+)")
# Directories served as one zip; files served as they are.
ARTIFACT_DIRS = {"adapter": "adapter", "model": "model"}
ARTIFACT_FILES = {"summary.json": "summary"}
# Served from the database (the job's metric rows), not from the workdir.
METRICS_ARTIFACT = "metrics.jsonl"
# peft's weights file (training.peft_io writes it): an adapter exists once this file does.
# Named here rather than imported, so that the web process never imports the training core.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# A full model directory as transformers' save_pretrained leaves it (weights possibly sharded).
MODEL_CONFIG = "config.json"
MODEL_WEIGHTS = "*.safetensors"


def workdir(job_id: Any) -> Path:
    """The job's working directory (same rule as ``workers.tasks.job_workdir``; not created)."""
    return Path(settings.OPENTINKER_DATA_DIR) / "jobs" / str(job_id)


def _files(path: Path) -> list[Path]:
    """The regular files under `path`; links are left out, so nothing outside is served."""
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in _files(path))


def _checkpoint_entry(root: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """The listing of one index line, or None when its files are not (or no longer) there.

    Paths come from the name alone, never from the line's ``path``, and a name must look like
    what its runner writes.
    """
    name = str(record.get("name", ""))
    extra = record.get("extra") or {}
    if extra.get("runner") == "verl":
        match = VERL_CHECKPOINT_NAME.fullmatch(name)
        # verl may have rotated it away (max_actor_ckpt_to_keep).
        path = root / VERL_CHECKPOINT_DIR / name
        # PPO saves under actor/; the SFT trainer saves its model shards in place.
        saved = (path / "actor").is_dir() or any(path.glob("model_world_size_*_rank_*.pt"))
        if match is None or not saved:
            return None
        kind, fmt, step = "verl", "zip", int(match.group(1))
    else:
        if not name or "/" in name or name.startswith("."):
            return None
        path = root / "checkpoints" / name / CHECKPOINT_STATE
        if not path.is_file():
            return None
        kind, fmt, step = "native", "pt", int(extra.get("step", record.get("step", 0)))
    return {
        "name": name,
        "kind": kind,
        "format": fmt,
        "step": step,
        "created": float(record.get("created", 0.0)),
        "attempt": extra.get("attempt"),
        "eval": extra.get("eval") or {},
        "size_bytes": _size(path),
    }


def checkpoints(job_id: Any) -> list[dict[str, Any]]:
    """Checkpoints whose files exist, oldest first (a torn index line is skipped).

    ``kind`` is "native" (``state.pt``: weights, AdamW state, step, RNG, data position; the
    download is that file) or "verl" (verl's own ``global_step_N`` directory, downloaded as
    a zip).
    """
    root = workdir(job_id)
    index = root / "checkpoints" / CHECKPOINT_INDEX
    if not index.is_file():
        return []
    out: dict[str, dict[str, Any]] = {}
    for line in index.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        try:
            entry = _checkpoint_entry(root, record)
        except (AttributeError, TypeError, ValueError):
            continue
        if entry is not None:
            # A resumed run may save a step again: the later line wins.
            out[entry["name"]] = entry
    return sorted(out.values(), key=lambda c: (c["step"], c["created"]))


def checkpoint_file(job_id: Any, name: str) -> Path | None:
    """A native checkpoint's ``state.pt`` (what the native engine loads), if it is listed."""
    if not any(c["name"] == name and c["kind"] == "native" for c in checkpoints(job_id)):
        return None
    return workdir(job_id) / "checkpoints" / name / CHECKPOINT_STATE


def checkpoint_download(job_id: Any, name: str) -> Path | None:
    """What the download of a listed checkpoint serves: a native checkpoint's ``state.pt``,
    a verl checkpoint's directory (to be zipped)."""
    for c in checkpoints(job_id):
        if c["name"] == name:
            if c["kind"] == "verl":
                return workdir(job_id) / VERL_CHECKPOINT_DIR / name
            return workdir(job_id) / "checkpoints" / name / CHECKPOINT_STATE
    return None


def adapter_dir(job_id: Any) -> Path | None:
    """The job's final PEFT adapter directory, once the run has exported it."""
    path = workdir(job_id) / "adapter"
    return path if (path / ADAPTER_WEIGHTS).is_file() else None


def model_dir(job_id: Any) -> Path | None:
    """A full fine-tuning job's final model (a Hugging Face directory), once exported."""
    path = workdir(job_id) / "model"
    if not (path / MODEL_CONFIG).is_file():
        return None
    return path if any(path.glob(MODEL_WEIGHTS)) else None


def final_policy(job_id: Any) -> Path | None:
    """What the job left to sample: its PEFT adapter or its full model (None: neither yet)."""
    return adapter_dir(job_id) or model_dir(job_id)


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


ZIP_CACHE = ".zips"


def _zip_name(job_id: Any, path: Path, files: list[Path], compress: bool) -> tuple[Path, str]:
    digest = hashlib.sha256(repr(compress).encode())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    stem = str(path.relative_to(workdir(job_id))).replace("/", "--")
    return workdir(job_id) / ZIP_CACHE / f"{stem}.{digest.hexdigest()[:20]}.zip", stem


def zipped_if_made(job_id: Any, path: Path, *, compress: bool = True) -> Path | None:
    """The zip ``zipped`` made of ``path``'s files as they are now, if it was made."""
    target, _stem = _zip_name(job_id, path, _files(path), compress)
    return target if target.is_file() else None


def zipped(job_id: Any, path: Path, *, compress: bool = True) -> Path:
    """A zip of ``path``'s files (names relative to it) under the job's directory, made once
    for the files as they are: a download of it can then be resumed (``Range``) and asked its
    size (``HEAD``), which a zip made anew for each request cannot. The name carries a digest
    of every file's name, size and modification time, so a directory written again (a
    resumed run's checkpoint) gets a new zip and the old one is removed. Entries take their
    files' modification times, so the bytes are the same whoever makes them.

    ``compress=False`` stores the files as they are: tensor shards hardly compress, and
    deflating gigabytes of them would hold the request for minutes.
    """
    files = _files(path)
    target, stem = _zip_name(job_id, path, files, compress)
    if target.is_file():
        return target
    cache = target.parent
    cache.mkdir(parents=True, exist_ok=True)
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    # Two requests may make it at once: each writes its own file and renames it into place.
    with tempfile.NamedTemporaryFile(dir=cache, suffix=".part", delete=False) as tmp:
        try:
            # A file dated before 1980 (an epoch mtime, as reproducible builds leave) would
            # otherwise fail the whole download: its entry is dated 1980-01-01 instead.
            with zipfile.ZipFile(
                tmp, "w", compression=method, allowZip64=True, strict_timestamps=False
            ) as zf:
                for file in files:
                    zf.write(file, arcname=str(file.relative_to(path)))
            tmp.flush()
            os.replace(tmp.name, target)
        except BaseException:
            Path(tmp.name).unlink(missing_ok=True)
            raise
    for old in cache.glob(f"{stem}.*.zip"):
        if old != target:
            old.unlink(missing_ok=True)
    return target
