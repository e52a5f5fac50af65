"""What the CLI prints: results on stdout, messages on stderr, errors as one clear message
with their documented exit code."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from .client import Job
from .errors import EXIT_INTERRUPTED, ApiError, OpenTinkerError

# No markup: what is printed quotes job names, server messages and paths, and a "[/x]" in
# one of them would otherwise be a rich MarkupError instead of text.
out = Console(soft_wrap=True, markup=False)
err = Console(stderr=True, soft_wrap=True, markup=False)

P = ParamSpec("P")
R = TypeVar("R")

# Columns a script reads back whole (to pass to the next command).
WHOLE_COLUMNS = ("id", "ref", "prefix")


def handles_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Report a client error as one clear message and its documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except OpenTinkerError as exc:
            report(exc)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("interrupted", highlight=False)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper


def report(exc: OpenTinkerError) -> None:
    lines = exc.lines() if isinstance(exc, ApiError) else str(exc).splitlines() or [""]
    err.print(Text.assemble(("error:", "red"), " ", lines[0]), highlight=False)
    for line in lines[1:]:
        err.print(line, highlight=False)


@contextmanager
def keeps_running(job: Job) -> Iterator[None]:
    """Ctrl-C while following stops the following, not the job: say so, exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        err.print(
            f"interrupted; job {job.id} keeps running (opentinker cancel {job.id} to stop it)",
            highlight=False,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None


def print_table(table: Table) -> None:
    """Ids are never shortened; off a terminal the table gets its natural width, since rich
    would squeeze it into 80 columns and cut the ids a script reads."""
    for column in table.columns:
        if column.header in WHOLE_COLUMNS:
            column.no_wrap = True
            column.min_width = max((len(str(c)) for c in column.cells), default=0)
    if out.is_terminal:
        out.print(table)
        return
    # Console.print caps its width at the console's: a console as wide as the table.
    width = Measurement.get(out, out.options.update_width(1 << 16), table).maximum
    wide = Console(file=out.file, width=max(width, out.width), soft_wrap=True, markup=False)
    wide.print(table)


def dump(value: Any) -> None:
    def plain(v: Any) -> Any:
        if isinstance(v, Job):
            return v.record.model_dump(mode="json")
        if isinstance(v, BaseModel):
            return v.model_dump(mode="json")
        if isinstance(v, list):
            return [plain(i) for i in v]
        if isinstance(v, dict):
            return {k: plain(i) for k, i in v.items()}
        return v

    sys.stdout.write(json.dumps(plain(value), indent=2, default=str) + "\n")
    sys.stdout.flush()


def job_line(job: Job) -> str:
    r = job.record
    total = r.total_steps
    step = f"{r.current_step or 0}/{total}" if total else str(r.current_step or 0)
    extra = f"  {r.error_code}: {r.error_message}" if r.error_code else ""
    if r.state == "QUEUED" and r.queue_note:
        extra = f"  ({r.queue_note})"
    return f"{job.id}  {r.state:<9}  step {step}  {r.spec.get('method', '')}  {r.name}{extra}"
