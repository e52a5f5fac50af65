"""Weights out: ``save_weights_external`` writes the model's adapter as a checkpoint of kind
``external`` (the worker exports it, age-encrypted to the caller's keys when asked), and
``external_weights_urls`` hands out signed download links for its files, which is what the
cookbook's ``weights.download`` reads."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from django.core import signing
from django.utils import timezone

from tinker_api import schemas as s
from tinker_api import wire
from tinker_api.models import Checkpoint
from tinker_api.services.checkpoints import _checkpoint_by_id, _new_checkpoint, check_name
from tinker_api.services.lookups import Caller, NotFound, get_model
from tinker_api.services.queue import ordered, submit

# Download links stay valid this long; the cookbook signs new ones when they run out.
URL_SECONDS = 3600
_SALT = "tinker_api.external_weights"


def _check_recipients(recipients: list[str]) -> None:
    import pyrage

    for i, recipient in enumerate(recipients):
        try:
            pyrage.x25519.Recipient.from_str(recipient)
        except Exception:
            raise wire.WireError(
                f"age_encryption_recipients[{i}]: not an age X25519 public key (age1...)"
            ) from None


def save_weights_external(caller: Caller, req: s.SaveWeightsExternalRequest) -> str:
    model = get_model(caller, req.model_id)
    with ordered(caller, model, req.seq_id) as turn:
        _check_recipients(req.age_encryption_recipients or [])
        check_name(req.path)
        earlier = turn.claim()
        if earlier is not None:
            return earlier
        ckpt = _new_checkpoint(
            model,
            Checkpoint.Kind.EXTERNAL,
            req.path,
            ttl_seconds=req.ttl_seconds,
            overwrite=False,
            user_metadata=None,
            seq=turn.seq,
        )
    return submit(
        caller,
        model,
        turn.seq,
        {
            "op": "save_external",
            "checkpoint": ckpt.pk,
            "recipients": req.age_encryption_recipients or [],
        },
        turn=turn,
    )


def external_weights_urls(
    caller: Caller, run: str, segment: str, name: str, *, url_for: Callable[[str, str], str]
) -> s.ExternalWeightsUrlsResponse:
    """Signed links to each file of an export, ``url_for(token, file)`` building each one."""
    if segment != "external_weights":
        raise wire.WireError(
            "only external weights (tinker://<run>/external_weights/<name>, from "
            "save_weights_external) can be downloaded"
        )
    ckpt = _checkpoint_by_id(caller, run, segment, name)
    folder = ckpt.file_path()
    if ckpt.size_bytes is None or not folder.is_dir():
        raise wire.WireError(f"{ckpt.tinker_path} is not written yet", status=409)
    urls = {
        f.name: url_for(signing.dumps({"c": ckpt.pk, "f": f.name}, salt=_SALT), f.name)
        for f in sorted(folder.iterdir())
        if f.is_file()
    }
    return s.ExternalWeightsUrlsResponse(
        urls=urls, expires=timezone.now() + timedelta(seconds=URL_SECONDS)
    )


def download_file(token: str, file: str) -> Path:
    """The file a signed link names, if the link is genuine, unexpired and the export is
    still there."""
    try:
        claim = signing.loads(token, salt=_SALT, max_age=URL_SECONDS)
    except signing.BadSignature:
        raise NotFound("this download link is invalid or has expired") from None
    ckpt = Checkpoint.objects.filter(pk=claim.get("c")).first()
    if ckpt is None or claim.get("f") != file or _expired(ckpt.expires_at):
        raise NotFound("this download link is invalid or has expired")
    path = ckpt.file_path() / file
    if not path.is_file():
        raise NotFound("this export's file is gone")
    return path


def _expired(at: datetime | None) -> bool:
    return at is not None and at <= timezone.now()
