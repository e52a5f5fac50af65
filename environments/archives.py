"""Dataset uploads as a zip: one JSONL file of rows plus the image files its rows name.

This is how geometry3k-style data usually travels (a diagram per problem, as a file). The
archive is turned into the one stored format that carries images, JSONL with each image
inline as base64: every string of a row's ``images`` list that names a file of the archive
(relative to the JSONL file's folder, or to the archive's root) becomes that file's base64.
A string that names no file is left as it is, for the environment's schema to judge (it may
already be base64 or a data URI). Nothing is extracted to disk: members are read by name,
so a member called ``../x`` or ``/etc/passwd`` cannot land anywhere, and the bytes read are
capped, so a small archive cannot inflate without bound.
"""

from __future__ import annotations

import base64
import json
import posixpath
import zipfile
from pathlib import Path
from typing import Any

from environments.datasets import DatasetValidationError, RowError

IMAGE_COLUMN = "images"


def _file_error(reason: str) -> DatasetValidationError:
    return DatasetValidationError([RowError(0, None, reason)])


def _data_member(archive: zipfile.ZipFile) -> zipfile.ZipInfo:
    candidates = [
        info
        for info in archive.infolist()
        if not info.is_dir()
        and info.filename.lower().endswith((".jsonl", ".ndjson"))
        and not posixpath.basename(info.filename).startswith(".")
        and "__MACOSX" not in info.filename
    ]
    if len(candidates) != 1:
        found = ", ".join(sorted(i.filename for i in candidates)) or "none"
        raise _file_error(
            f"a zip upload holds exactly one .jsonl file of rows (beside its images); found {found}"
        )
    return candidates[0]


class _Budget:
    """Bytes an archive may still give out once decompressed."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def read(self, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
        if info.file_size > self.left:
            raise _file_error(
                f"the archive unpacks to more than the dataset limit ({info.filename!r})"
            )
        try:
            with archive.open(info) as fh:
                data = fh.read(self.left + 1)
        except (zipfile.BadZipFile, OSError, RuntimeError) as exc:
            # RuntimeError: an encrypted member.
            raise _file_error(f"{info.filename!r} could not be read: {exc}") from None
        if len(data) > self.left:
            raise _file_error(
                f"the archive unpacks to more than the dataset limit ({info.filename!r})"
            )
        self.left -= len(data)
        return data


def _inline(
    row: dict[str, Any],
    number: int,
    base: str,
    archive: zipfile.ZipFile,
    names: set[str],
    budget: _Budget,
) -> dict[str, Any]:
    images = row.get(IMAGE_COLUMN)
    if not isinstance(images, list):
        return row
    inlined: list[Any] = []
    for item in images:
        if not isinstance(item, str):
            inlined.append(item)
            continue
        member = next(
            (
                name
                for name in (posixpath.normpath(posixpath.join(base, item)), item)
                if name in names
            ),
            None,
        )
        if member is None:
            inlined.append(item)
            continue
        info = archive.getinfo(member)
        if info.is_dir():
            raise DatasetValidationError(
                [RowError(number, IMAGE_COLUMN, f"{item!r} is a folder of the archive")]
            )
        inlined.append(base64.b64encode(budget.read(archive, info)).decode("ascii"))
    return {**row, IMAGE_COLUMN: inlined}


def unpack_zip(source: str | Path, target: str | Path, *, max_bytes: int) -> None:
    """Write the rows of the zip at `source` to the JSONL file `target`, images inline.

    Raises DatasetValidationError (row 0 for the archive as a whole) when the archive cannot
    be read, holds no or several JSONL files, or unpacks to more than `max_bytes`.
    """
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError) as exc:
        raise _file_error(f"not a readable zip archive: {exc}") from None
    budget = _Budget(max_bytes)
    with archive, open(target, "w", encoding="utf-8") as out:
        data = _data_member(archive)
        base = posixpath.dirname(data.filename)
        names = set(archive.namelist())
        try:
            lines = budget.read(archive, data).decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise _file_error(f"{data.filename!r} could not be read: {exc}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                out.write("\n")
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                # Kept as it is: the row check (datasets.iter_rows) reports the bad line by its
                # number, as it does for a plain JSONL file (not JSON, nested too deeply, a
                # number of thousands of digits).
                out.write(line + "\n")
                continue
            if isinstance(row, dict):
                row = _inline(row, number, base, archive, names, budget)
            out.write(json.dumps(row) + "\n")
