"""Id conventions the SDK relies on: training model ids and ``tinker://`` paths."""

from __future__ import annotations

from typing import Literal

from tinker_api.wire.media import WireError


def model_id_for(session_id: str, model_seq_id: int) -> str:
    """The id the SDK assumes for a model created by ``load_weights`` (service_client.py);
    use it for ``create_model`` too, so one rule names every training model."""
    return f"{session_id}:train:{model_seq_id}"


CheckpointKind = Literal["training", "sampler", "external"]
_PATH_SEGMENTS: dict[str, CheckpointKind] = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}


def tinker_path(training_run_id: str, kind: CheckpointKind, name: str) -> str:
    """``tinker://<run>/<weights|sampler_weights|external_weights>/<name>``; the SDK parses
    it by splitting on "/" into exactly three parts, so neither id may contain "/"."""
    if "/" in training_run_id or "/" in name or not name:
        raise ValueError("training run id and checkpoint name must be non-empty and '/'-free")
    segment = next(seg for seg, k in _PATH_SEGMENTS.items() if k == kind)
    return f"tinker://{training_run_id}/{segment}/{name}"


def parse_tinker_path(path: str) -> tuple[str, CheckpointKind, str]:
    """(training_run_id, kind, name) of a tinker path, as the SDK parses it."""
    if not path.startswith("tinker://"):
        raise WireError(f"invalid tinker path {path!r}: must start with tinker://")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in _PATH_SEGMENTS or not parts[0] or not parts[2]:
        raise WireError(
            f"invalid tinker path {path!r}: expected tinker://<run>/"
            "<weights|sampler_weights|external_weights>/<name>"
        )
    return parts[0], _PATH_SEGMENTS[parts[1]], parts[2]
