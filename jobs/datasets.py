"""Team datasets: storing an upload, deleting it, and finding it again from a job spec.

An upload is streamed into a temporary file in the team's dataset directory, checked against
the environment's schema by ``environments.datasets.inspect_file``, and only then renamed
(``os.replace``, atomic within one directory) to ``datasets/<team id>/<id>.<format>`` in the
same transaction that creates the row. Whatever goes wrong before that (too large, not the
schema, a name taken meanwhile), the temporary file is removed: a refused upload leaves
nothing behind. (Call it outside an enclosing transaction, as the API view does: a rollback
of an outer transaction would drop the row but not the placed file.)

A job spec names a dataset by name or id; ``submit_job`` stores the canonical reference
``dataset:<uuid>`` so a running job keeps reading the file it was submitted with, even when
the name is reused. Runners turn a reference into a file with ``resolve_dataset_ref``.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction

from accounts.models import Quota, Team
from environments.archives import unpack_zip
from environments.datasets import (
    FORMATS,
    DatasetValidationError,
    inspect_file,
    resolve,
)
from environments.datasets import detect_format as detect
from environments.registry import ContractError, get_env

from .models import FINAL_STATES, Dataset, Job

DEFAULT_MAX_DATASET_BYTES = 50 * 1024 * 1024
DATASET_REF_PREFIX = "dataset:"
BUILTIN_REF_PREFIX = "builtin:"
# Names end up in CLI arguments and URLs; a colon would make them look like references.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
# The first errors are what a person reads; the count of bad rows tells the rest.
MAX_REPORTED_ERRORS = 10


class DatasetRejected(Exception):
    """An upload or delete refused; ``detail`` is safe to show, ``errors`` name the problems.

    ``errors`` items are ``{"field": ...}`` for request fields and ``{"row", "field",
    "reason"}`` for rows of the file (row 0 for the file as a whole).
    """

    status_code = 400

    def __init__(self, detail: str, errors: list[dict[str, Any]] | None = None) -> None:
        self.detail = detail
        self.errors = errors or []
        super().__init__(detail)


class DatasetTooLarge(DatasetRejected):
    status_code = 413


class DatasetConflict(DatasetRejected):
    """The name is taken in the team, or the dataset is read by a job that has not finished."""

    status_code = 409


def max_dataset_bytes() -> int:
    return int(getattr(settings, "OPENTINKER_MAX_DATASET_BYTES", DEFAULT_MAX_DATASET_BYTES))


def too_large_message(limit: int) -> str:
    return (
        f"the dataset is larger than the limit of {limit} bytes ({limit / 2**20:g} MiB, "
        "OPENTINKER_MAX_DATASET_BYTES)"
    )


def team_dir(team_id: int) -> Path:
    return Path(settings.OPENTINKER_DATA_DIR) / "datasets" / str(team_id)


def _field_error(field: str, reason: str) -> DatasetRejected:
    return DatasetRejected(f"{field}: {reason}", [{"field": field, "reason": reason}])


def validate_name(name: str) -> str:
    name = (name or "").strip()
    if not NAME_RE.match(name):
        raise _field_error(
            "name",
            "1-200 characters: letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    try:
        uuid.UUID(name)
    except ValueError:
        return name
    # A name shaped like an id would be ambiguous where specs accept either.
    raise _field_error("name", "must not look like a dataset id (a UUID)")


def validate_env(env: str) -> str:
    """The environment must exist and read a dataset (a generator env has no schema)."""

    try:
        spec = get_env(env)
    except ContractError as exc:
        raise _field_error("env", exc.reason) from exc
    if spec.schema is None:
        raise _field_error("env", f"env {env!r} is a generator environment and takes no dataset")
    return env


# A zip (rows in JSONL, images as files) is unpacked into the JSONL it is stored as.
ARCHIVE = "zip"
UPLOAD_FORMATS = (*FORMATS, ARCHIVE)


def detect_format(filename: str, fmt: str | None) -> str:
    """The upload's format: `fmt` when given, else from the file name's suffix."""
    if fmt:
        if fmt not in UPLOAD_FORMATS:
            raise _field_error("format", f"must be one of {', '.join(UPLOAD_FORMATS)}")
        return fmt
    if filename.lower().endswith(".zip"):
        return ARCHIVE
    try:
        return detect(filename)
    except DatasetValidationError as exc:
        raise _field_error(
            "file", exc.errors[0].reason.replace("or .parquet", ", .parquet or .zip")
        ) from exc


def _row_errors(errors: Iterable[Any]) -> list[dict[str, Any]]:
    """``environments.datasets.RowError``s in the API's shape."""
    out = []
    for err in errors:
        field = err.column or ("file" if err.row == 0 else "row")
        out.append({"row": err.row, "field": field, "reason": err.reason})
    return out


def store_dataset(
    *,
    team: Team,
    user: AbstractBaseUser | None,
    name: str,
    env: str,
    filename: str,
    chunks: Iterable[bytes],
    fmt: str | None = None,
) -> Dataset:
    """Validate and store an upload; return the new row.

    Raises ``DatasetRejected`` (bad field or rows), ``DatasetTooLarge`` or
    ``DatasetConflict`` (name taken); in every case no file is left behind.
    """

    name = validate_name(name)
    env = validate_env(env)
    fmt = detect_format(filename, fmt)
    if Dataset.objects.filter(team=team, name=name).exists():
        raise _name_taken(team, name)

    limit = max_dataset_bytes()
    directory = team_dir(team.pk)
    directory.mkdir(parents=True, exist_ok=True)
    dataset_id = uuid.uuid4()
    stored = "jsonl" if fmt == ARCHIVE else fmt
    final = directory / f"{dataset_id}.{stored}"
    # Same directory as the final file, so the rename is atomic; the suffix tells the
    # validator the format; the leading dot marks it as not (yet) a dataset.
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=".upload-", suffix=f".{fmt}")
    tmp = Path(tmp_name)
    upload = tmp
    renamed = False
    try:
        size = 0
        with os.fdopen(fd, "wb") as fh:
            # mkstemp makes the file 0600; GPU workers may run as another user of the group.
            os.fchmod(fh.fileno(), 0o640)
            for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise DatasetTooLarge(too_large_message(limit))
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())

        if fmt == ARCHIVE:
            tmp = upload.with_suffix(".jsonl")
            try:
                unpack_zip(upload, tmp, max_bytes=limit)
            except DatasetValidationError as exc:
                errors = _row_errors(exc.errors)
                raise DatasetRejected(errors[0]["reason"], errors) from exc
            os.chmod(tmp, 0o640)
        try:
            report = inspect_file(tmp, env, max_errors=MAX_REPORTED_ERRORS)
        except (OSError, ValueError) as exc:
            # pyarrow reports corrupt data pages (past a readable footer) as OSError or
            # ArrowInvalid (a ValueError) while iterating; that is a bad upload, not a 500.
            reason = f"could not read the file: {exc}"
            raise DatasetRejected(reason, [{"row": 0, "field": "file", "reason": reason}]) from exc
        if not report.ok:
            errors = _row_errors(report.errors)
            first = errors[0]
            where = f"row {first['row']}" if first["row"] else "the file"
            bad = f"{report.bad_rows} of {report.rows} rows are bad; " if first["row"] else ""
            raise DatasetRejected(
                f"the file does not fit env {env!r}: {bad}first problem at {where}, "
                f"{first['field']}: {first['reason']}",
                errors,
            )

        try:
            with transaction.atomic():
                dataset = Dataset.objects.create(
                    id=dataset_id,
                    team=team,
                    created_by=user,
                    name=name,
                    env=env,
                    format=stored,
                    path=str(final.relative_to(Path(settings.OPENTINKER_DATA_DIR))),
                    rows=report.rows,
                    columns=report.columns,
                    sha256=report.sha256,
                    size_bytes=report.size_bytes,
                )
                # Inside the transaction: a failed rename rolls the row back.
                os.replace(tmp, final)
                renamed = True
        except IntegrityError as exc:
            # Another upload took the name between the check above and now.
            raise _name_taken(team, name) from exc
    except BaseException:
        if renamed:
            final.unlink(missing_ok=True)
        raise
    finally:
        tmp.unlink(missing_ok=True)
        upload.unlink(missing_ok=True)
    return dataset


def _name_taken(team: Team, name: str) -> DatasetConflict:
    return DatasetConflict(
        f"team {team.slug!r} already has a dataset named {name!r}; delete it or pick another name",
        [{"field": "name", "reason": "already exists in this team"}],
    )


def jobs_reading(dataset: Dataset) -> list[Job]:
    """Unfinished jobs whose spec references ``dataset``."""
    return list(
        Job.objects.filter(team_id=dataset.team_id, spec__dataset=dataset.ref).exclude(
            state__in=FINAL_STATES
        )
    )


def delete_dataset(dataset: Dataset) -> None:
    """Delete the row and, once committed, its file. Refused while a job still needs it."""
    path = dataset.file_path()
    with transaction.atomic():
        # submit_job takes the same lock before it resolves a dataset: no job can start
        # referencing this dataset between the check and the delete.
        Quota.objects.select_for_update().get_or_create(team_id=dataset.team_id)
        busy = jobs_reading(dataset)
        if busy:
            ids = ", ".join(str(job.pk) for job in busy[:5])
            raise DatasetConflict(
                f"dataset {dataset.name!r} is used by {len(busy)} unfinished job(s) ({ids}); "
                "cancel them or wait until they finish"
            )
        dataset.delete()
        transaction.on_commit(lambda: path.unlink(missing_ok=True))


def find_team_dataset(team_id: int, ref: str) -> Dataset | None:
    """The team's dataset named by ``ref``: ``dataset:<uuid>``, a bare uuid, or a name."""
    text = ref.strip().removeprefix(DATASET_REF_PREFIX)
    try:
        dataset_id = uuid.UUID(text)
    except ValueError:
        return Dataset.objects.filter(team_id=team_id, name=text).first()
    return Dataset.objects.filter(team_id=team_id, pk=dataset_id).first()


def resolve_dataset_ref(ref: str) -> Path:
    """The file behind a stored job spec's ``dataset``: ``builtin:<name>`` (shipped with
    ``environments``) or ``dataset:<uuid>`` (an upload). Raises ``LookupError``."""
    if ref.startswith(BUILTIN_REF_PREFIX):
        try:
            return resolve(ref)
        except DatasetValidationError as exc:
            raise LookupError(exc.errors[0].reason) from exc
    if not ref.startswith(DATASET_REF_PREFIX):
        raise LookupError(f"not a dataset reference: {ref!r} (expected dataset:<id>)")
    try:
        dataset = Dataset.objects.get(pk=uuid.UUID(ref[len(DATASET_REF_PREFIX) :]))
    except (ValueError, Dataset.DoesNotExist):
        raise LookupError(f"dataset {ref!r} does not exist") from None
    path = dataset.file_path()
    if not path.is_file():
        raise LookupError(f"the file of dataset {ref!r} is missing at {path}")
    return path
