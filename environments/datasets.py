"""Dataset files (JSONL or Parquet) and their per-environment schema validation.

The upload API reuses `inspect_file`: it reads the whole file once, checks every row against
the environment's schema and reports the first bad rows by row number (1-based, the line
number for JSONL), column and reason, together with the row count and SHA-256 of the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.registry import ContractError, get_env
from environments.schema import DatasetSchema

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN_PREFIX = "builtin:"
FORMATS = ("jsonl", "parquet")


@dataclass(frozen=True)
class RowError:
    row: int
    """1-based row number (the line number in a JSONL file); 0 for file-level problems."""
    column: str | None
    reason: str

    def __str__(self) -> str:
        where = f"row {self.row}" if self.row else "file"
        return (
            f"{where}, column {self.column!r}: {self.reason}"
            if self.column
            else f"{where}: {self.reason}"
        )


class DatasetValidationError(ValueError):
    def __init__(self, errors: list[RowError], *, rows_checked: int = 0, bad_rows: int = 0) -> None:
        self.errors = errors
        self.rows_checked = rows_checked
        self.bad_rows = bad_rows or len({e.row for e in errors})
        head = "; ".join(str(e) for e in errors[:5])
        more = f" (and more: {self.bad_rows} bad rows)" if self.bad_rows > 5 else ""
        super().__init__(f"invalid dataset: {head}{more}")

    def as_list(self) -> list[dict[str, Any]]:
        return [{"row": e.row, "column": e.column, "reason": e.reason} for e in self.errors]


@dataclass
class DatasetReport:
    rows: int
    columns: list[str]
    sha256: str
    size_bytes: int
    errors: list[RowError] = field(default_factory=list)
    bad_rows: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


def detect_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise DatasetValidationError(
        [RowError(0, None, f"unknown file type {suffix!r}; use .jsonl or .parquet")]
    )


def iter_rows(
    path: str | Path, fmt: str | None = None
) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """Yield (row number, row) or (row number, RowError) for rows that cannot be decoded."""
    fmt = fmt or detect_format(path)
    if fmt == "jsonl":
        with open(path, "rb") as fh:
            for number, raw in enumerate(fh, start=1):
                line = raw.strip()
                if not line:
                    continue
                try:
                    value = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    yield number, RowError(number, None, f"not valid JSON: {exc}")
                    continue
                except RecursionError:
                    yield number, RowError(number, None, "not valid JSON: nested too deeply")
                    continue
                except ValueError:
                    # Python refuses to convert integers this long (a denial-of-service guard);
                    # its message names interpreter settings, not the row's problem.
                    reason = "not valid JSON: a number has more than 4300 digits"
                    yield number, RowError(number, None, reason)
                    continue
                if not isinstance(value, dict):
                    yield (
                        number,
                        RowError(
                            number, None, f"expected a JSON object, got {type(value).__name__}"
                        ),
                    )
                    continue
                yield number, value
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path)
        except Exception as exc:
            yield 0, RowError(0, None, f"not a readable Parquet file: {exc}")
            return
        number = 0
        for batch in table.iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                number += 1
                yield number, row
    else:
        raise ValueError(f"unknown dataset format {fmt!r}; expected one of {FORMATS}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def unstorable(value: Any) -> str | None:
    """Why a cell cannot be stored and read back as the same text or number, or None.

    NaN and Infinity are not JSON (Python writes and reads them anyway) and no answer
    compares equal to them; a lone surrogate (``"\\ud800"`` in JSON) is not a character and
    the tokenizer refuses it when the row is used. Iterative: a cell may be deeply nested.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            name = "NaN" if math.isnan(item) else "Infinity" if item > 0 else "-Infinity"
            return f"{name} is not allowed: numbers must be finite"
        if isinstance(item, str) and _SURROGATE.search(item):
            return "surrogate characters are not allowed (a lone \\ud800-\\udfff escape)"
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def check_row(number: int, row: dict[str, Any], schema: DatasetSchema) -> list[RowError]:
    errors: list[RowError] = []
    for name, value in row.items():
        if unstorable(name):
            # The name itself cannot be echoed back in a JSON answer.
            errors.append(RowError(number, None, f"a column name: {unstorable(name)}"))
        elif "\x00" in name:
            # Column names are stored in PostgreSQL's jsonb, which holds no NUL.
            errors.append(RowError(number, None, "a column name: null characters are not allowed"))
        elif reason := unstorable(value):
            errors.append(RowError(number, name, reason))
    if errors:
        return errors
    for col in schema.columns:
        if col.name not in row or row[col.name] is None:
            if col.required:
                errors.append(RowError(number, col.name, "missing"))
            continue
        value = row[col.name]
        # bool is an int subclass, but True is not an answer.
        if isinstance(value, bool) or not isinstance(value, col.types):
            errors.append(
                RowError(
                    number, col.name, f"expected {col.type_names()}, got {type(value).__name__}"
                )
            )
            continue
        if col.non_empty and isinstance(value, str) and not value.strip():
            errors.append(RowError(number, col.name, "empty"))
            continue
        reason = col.check(value) if col.check is not None else None
        if reason:
            errors.append(RowError(number, col.name, reason))
    return errors


def scan(
    rows: Iterator[tuple[int, dict[str, Any] | RowError]],
    schema: DatasetSchema,
    max_errors: int = 10,
) -> tuple[list[dict[str, Any]], list[RowError], int]:
    """Check every row; keep the good ones, the first `max_errors` errors, and the bad-row count."""
    good: list[dict[str, Any]] = []
    errors: list[RowError] = []
    bad_rows = 0
    for number, row in rows:
        row_errors = [row] if isinstance(row, RowError) else check_row(number, row, schema)
        if row_errors:
            bad_rows += 1
            room = max_errors - len(errors)
            errors.extend(row_errors[: max(room, 0)])
        else:
            good.append(row)  # type: ignore[arg-type]
    return good, errors, bad_rows


def _schema_for(env_name: str) -> DatasetSchema:
    spec = get_env(env_name)
    if spec.schema is None:
        raise ContractError(
            "dataset", f"env {env_name!r} is a generator environment and takes no dataset"
        )
    return spec.schema


def load_rows(path: str | Path, env_name: str, *, max_errors: int = 10) -> list[dict[str, Any]]:
    """Read and validate a dataset file for `env_name`; raise DatasetValidationError if bad."""
    schema = _schema_for(env_name)
    good, errors, bad = scan(iter_rows(path), schema, max_errors)
    if not errors and not good:
        errors = [RowError(0, None, "the dataset has no rows")]
    if errors:
        raise DatasetValidationError(errors, rows_checked=len(good) + bad, bad_rows=bad)
    return good


def inspect_file(path: str | Path, env_name: str, *, max_errors: int = 10) -> DatasetReport:
    """Validate an uploaded file: row count, columns, checksum and the first errors."""
    schema = _schema_for(env_name)
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    try:
        rows = iter_rows(path)
        good, errors, bad = scan(rows, schema, max_errors)
    except DatasetValidationError as exc:
        good, errors, bad = [], exc.errors, 0
    columns = sorted({key for row in good[:100] for key in row})
    if not errors and not good:
        errors = [RowError(0, None, "the dataset has no rows")]
    return DatasetReport(
        rows=len(good) + bad,
        columns=columns,
        sha256=digest.hexdigest(),
        size_bytes=size,
        errors=errors,
        bad_rows=bad,
    )


def builtin_names() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.jsonl"))


def resolve(ref: str | Path) -> Path:
    """`builtin:arith_train` -> the shipped file; anything else is a path that must exist."""
    text = str(ref)
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX) :]
        path = DATA_DIR / f"{name}.jsonl"
        if not path.is_file():
            raise DatasetValidationError(
                [RowError(0, None, f"unknown built-in dataset {name!r}; known: {builtin_names()}")]
            )
        return path
    path = Path(text)
    if not path.is_file():
        raise DatasetValidationError([RowError(0, None, f"dataset file {text!r} does not exist")])
    return path
