"""The ``opentinker`` command line.

Exit codes (for scripts): 0 ok; 1 the job ended FAILED or CANCELLED; 2 usage or validation
error (bad spec, unknown override key, conflict, quota, a local file problem); 3 authentication
or permission; 4 not found; 5 server or network error; 6 --follow gave up after --timeout (the
job keeps running); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from . import __version__, config
from ._output import dump, err, handles_errors, job_line, keeps_running, out, print_table
from .client import Client, Job
from .errors import EXIT_JOB_FAILED, SpecError, UsageError
from .spec import apply_overrides, check_spec, load_yaml, shipped_schema

EPILOG = (
    "Exit codes: 0 ok; 1 job FAILED or CANCELLED; 2 usage or validation error; "
    "3 authentication; 4 not found; 5 server or network error; "
    "6 --follow gave up after --timeout (the job keeps running); 130 interrupted."
)

app = typer.Typer(
    name="opentinker",
    help="OpenTinker client: submit and follow training jobs, manage datasets and API keys.",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
datasets_app = typer.Typer(help="Upload, list and delete datasets.", no_args_is_help=True)
keys_app = typer.Typer(help="List, create, rotate and revoke API keys.", no_args_is_help=True)
app.add_typer(datasets_app, name="datasets")
app.add_typer(keys_app, name="keys")

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]


def _client(ctx: typer.Context) -> Client:
    opts = ctx.find_root().obj or {}
    return Client(opts.get("url"), opts.get("api_key"))


def _print_version(value: bool) -> None:
    if value:
        out.print(f"opentinker {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Option(help="Server URL (default: $OPENTINKER_URL or the login file).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(help="API key (default: $OPENTINKER_API_KEY or the login file).")
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    ctx.obj = {"url": url, "api_key": api_key}


def _ask(what: str, option: str, *, secret: bool = False) -> str:
    try:
        return str(typer.prompt(what[0].upper() + what[1:], hide_input=secret))
    except typer.Abort as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        # End of input: run from a script with nothing to read. The prompt has no newline.
        err.print()
        raise UsageError(f"no {what} given: pass {option}") from None


@app.command()
@handles_errors
def login(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option(help="Server URL.")] = None,
    api_key: Annotated[str | None, typer.Option(help="API key (otk_...).")] = None,
) -> None:
    """Check a server URL and API key, then save them (mode 0600) for later commands."""
    opts = ctx.find_root().obj or {}
    url = url or opts.get("url") or _ask("server URL", "--url")
    api_key = api_key or opts.get("api_key") or _ask("API key", "--api-key", secret=True)
    # Checked and stripped of stray whitespace first: what is saved is what was tried.
    settings = config.resolve(url, api_key)
    with Client(settings.url, settings.api_key) as client:
        me = client.me()
    path = config.save_file(settings)
    teams = ", ".join(t.slug for t in me.teams) or "no team"
    err.print(
        f"logged in to {settings.url} as {me.username} ({teams}); saved to {path}",
        highlight=False,
    )


@app.command()
@handles_errors
def whoami(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The user, teams and API key the client acts as."""
    with _client(ctx) as client:
        me = client.me()
        if as_json:
            dump({"url": client.url, **me.model_dump(mode="json")})
            return
        out.print(f"user   {me.username}", highlight=False)
        out.print(f"server {client.url}", highlight=False)
        for team in me.teams:
            out.print(f"team   {team.slug} ({team.role or 'member'})", highlight=False)
        if me.key:
            out.print(
                f"key    {me.key.prefix} '{me.key.name}' (team {me.key.team})", highlight=False
            )


def _follow(job: Job, as_json: bool, timeout: float | None) -> None:
    with keeps_running(job):
        job.wait(progress=not as_json, timeout=timeout)
    if as_json:
        dump(job)
    else:
        out.print(job_line(job), highlight=False)
        final = job.metrics().final()
        if final:
            out.print(
                "  " + "  ".join(f"{k}={v:.4g}" for k, v in sorted(final.items())),
                highlight=False,
            )
    if job.state != "SUCCEEDED":
        raise typer.Exit(EXIT_JOB_FAILED)


def _build_spec(spec_file: Path, overrides: list[str], schema: dict[str, Any]) -> dict[str, Any]:
    spec = load_yaml(spec_file)
    problems = check_spec(spec, schema)
    if problems:
        raise SpecError(
            f"{spec_file}: " + "; ".join(f"{p['field']}: {p['reason']}" for p in problems),
            problems,
        )
    return apply_overrides(spec, overrides, schema)


@app.command()
@handles_errors
def submit(
    ctx: typer.Context,
    spec_file: Annotated[Path, typer.Argument(help="JobSpec YAML file.", metavar="SPEC.yaml")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="key=value or a.b.c=value overrides (e.g. rollout.group_size=8)."),
    ] = None,
    name: Annotated[str, typer.Option(help="Job name.")] = "",
    team: Annotated[
        str | None, typer.Option(help="Team slug (session users in several teams).")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Wait for the end, with progress.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the final spec; send nothing.")
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            help="Give up following after this many seconds (exit 6; the job keeps running)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a job from a YAML spec with Hydra-style overrides; --follow waits for the end."""
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
        raise UsageError(f"--timeout must be a positive number of seconds, got {timeout}")
    if dry_run:
        # Offline: the schema shipped with the client, nothing sent.
        dump(_build_spec(spec_file, overrides or [], shipped_schema()))
        return
    with _client(ctx) as client:
        spec = _build_spec(spec_file, overrides or [], client.jobspec_schema())
        job = client.jobs.submit(spec, name=name or spec_file.stem, team=team)
        if not follow:
            if as_json:
                dump(job)
            else:
                out.print(job.id, highlight=False)
            return
        err.print(f"submitted {job.id}", highlight=False)
        _follow(job, as_json, timeout)


@app.command("jobs")
@handles_errors
def list_jobs(
    ctx: typer.Context,
    state: Annotated[
        list[str] | None, typer.Option(help="Only jobs in this state (repeatable).")
    ] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Recent jobs of your team, newest first."""
    with _client(ctx) as client:
        jobs = client.jobs.list(state=[s.upper() for s in state] if state else None, limit=limit)
        if as_json:
            dump(jobs)
            return
        table = Table("id", "state", "step", "method", "name", "created")
        for job in jobs:
            r = job.record
            total = r.total_steps
            table.add_row(
                job.id,
                r.state,
                f"{r.current_step or 0}/{total}" if total else str(r.current_step or 0),
                str(r.spec.get("method", "")),
                r.name,
                r.created.strftime("%Y-%m-%d %H:%M:%S"),
            )
        print_table(table)


@app.command()
@handles_errors
def status(ctx: typer.Context, job_id: str, as_json: JsonOpt = False) -> None:
    """One job's state, step and error (if any). Exit code 0 whatever the state."""
    with _client(ctx) as client:
        job = client.jobs.get(job_id)
        if as_json:
            dump(job)
        else:
            out.print(job_line(job), highlight=False)


@app.command()
@handles_errors
def logs(
    ctx: typer.Context,
    job_id: str,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """The job's event log (state changes, runner messages)."""
    with _client(ctx) as client:
        job = client.jobs.get(job_id)
        with keeps_running(job):
            for event in job.events(follow=follow):
                if as_json:
                    sys.stdout.write(event.model_dump_json() + "\n")
                    sys.stdout.flush()
                    continue
                change = f" {event.from_state}->{event.to_state}" if event.to_state else ""
                out.print(
                    f"{event.created:%H:%M:%S} {event.kind}{change} {event.message}".rstrip(),
                    highlight=False,
                )


@app.command()
@handles_errors
def metrics(
    ctx: typer.Context,
    job_id: str,
    name: Annotated[list[str] | None, typer.Option(help="Only this metric (repeatable).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Metric series of a job: the last value of each (--json: every point)."""
    with _client(ctx) as client:
        series = client.jobs.get(job_id).metrics(names=name)
        if as_json:
            dump(series)
            return
        table = Table("metric", "steps", "last step", "last value")
        for key, points in sorted(series.series.items()):
            if not points:
                # A metric asked for by --name that has no points yet.
                table.add_row(key, "0", "", "")
                continue
            table.add_row(key, str(len(points)), str(int(points[-1][0])), f"{points[-1][1]:.6g}")
        print_table(table)


@app.command()
@handles_errors
def cancel(ctx: typer.Context, job_id: str, as_json: JsonOpt = False) -> None:
    """Cancel a job: a queued one at once, a running one within a step. Safe to repeat."""
    with _client(ctx) as client:
        job = client.jobs.get(job_id)
        if job.record.state == "CANCELLED":
            err.print(f"job {job.id} was already cancelled", highlight=False)
        job.cancel()
        if as_json:
            dump(job)
        else:
            out.print(job_line(job), highlight=False)


@app.command()
@handles_errors
def download(
    ctx: typer.Context,
    job_id: str,
    checkpoint: Annotated[
        str | None, typer.Option(help="A checkpoint name, or 'latest' (its state.pt).")
    ] = None,
    artifact: Annotated[
        str | None, typer.Option(help="An artifact: adapter, model, summary.json, eval/...")
    ] = None,
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            help="Directory (exists, ends in /, or has no suffix) or file.",
        ),
    ] = ".",
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replace an existing file; write into an existing adapter/model directory.",
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Download a job's adapter (default when it has one), an artifact or a checkpoint.

    Nothing that exists is replaced without --force, and other files are never deleted."""
    if checkpoint and artifact:
        raise UsageError("give --checkpoint or --artifact, not both")
    plain = Path(output)
    if not (plain.suffix or plain.is_file() or plain.is_symlink()):
        # -o DIR: a name without a suffix is a directory, as for artifacts.
        output = output.rstrip("/" + os.sep) + os.sep
    with _client(ctx) as client:
        job = client.jobs.get(job_id)
        if artifact is None and checkpoint is None:
            names = {a.name for a in job.artifacts()}
            if "adapter" in names:
                artifact = "adapter"
            elif "model" in names:
                artifact = "model"
            else:
                checkpoint = "latest"
        if checkpoint is not None:
            name = None if checkpoint == "latest" else checkpoint
            path = job.download(name, output, overwrite=force)
        else:
            path = job.download_artifact(str(artifact), output, overwrite=force)
        if as_json:
            dump({"path": str(path)})
        else:
            out.print(str(path), highlight=False)


@datasets_app.command("upload")
@handles_errors
def datasets_upload(
    ctx: typer.Context,
    file: Annotated[
        Path,
        typer.Argument(help="A .jsonl or .parquet file, or a .zip of a .jsonl and its images."),
    ],
    env: Annotated[str, typer.Option(help="The env whose dataset schema the rows follow.")],
    name: Annotated[
        str | None, typer.Option(help="Dataset name (default: the file's stem).")
    ] = None,
    format: Annotated[
        str | None, typer.Option(help="jsonl or parquet (default: from the extension).")
    ] = None,
    team: Annotated[str | None, typer.Option(help="Team slug.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Upload a dataset; every row is checked against the env's schema by the server."""
    with _client(ctx) as client:
        dataset = client.datasets.upload(file, env=env, name=name, format=format, team=team)
        if as_json:
            dump(dataset)
        else:
            out.print(
                f"{dataset.ref}  {dataset.name}  {dataset.rows} rows  env {dataset.env}",
                highlight=False,
            )


@datasets_app.command("list")
@handles_errors
def datasets_list(
    ctx: typer.Context,
    env: Annotated[str | None, typer.Option(help="Only datasets for this env.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Your team's datasets."""
    with _client(ctx) as client:
        found = client.datasets.list(env=env)
        if as_json:
            dump(found)
            return
        table = Table("ref", "name", "env", "format", "rows")
        for d in found:
            table.add_row(d.ref, d.name, d.env, d.format, str(d.rows))
        print_table(table)


@datasets_app.command("delete")
@handles_errors
def datasets_delete(
    ctx: typer.Context,
    dataset: Annotated[str, typer.Argument(help="The dataset's name, id or ref (dataset:<id>).")],
    as_json: JsonOpt = False,
) -> None:
    """Delete a dataset of your team (a name two of your teams use needs the ref)."""
    with _client(ctx) as client:
        found = client.datasets.find(dataset)
        client.datasets.delete(str(found.id))
        if as_json:
            dump(found)
        else:
            out.print(f"deleted dataset {found.name} ({found.ref})", highlight=False)


@keys_app.command("list")
@handles_errors
def keys_list(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """API keys of your team (never their secrets)."""
    with _client(ctx) as client:
        found = client.keys.list()
        if as_json:
            dump(found)
            return
        table = Table("id", "name", "prefix", "team", "active", "expires")
        for k in found:
            expires = f"{k.expires_at:%Y-%m-%d %H:%M}" if k.expires_at else ""
            table.add_row(str(k.id), k.name, k.prefix, k.team, "yes" if k.active else "no", expires)
        print_table(table)


def _issued(key: Any, as_json: bool) -> None:
    if as_json:
        dump(key)
        return
    err.print(f"key {key.id} '{key.name}' for team {key.team}; store it now, it is shown once:")
    out.print(key.key, highlight=False)


@keys_app.command("create")
@handles_errors
def keys_create(
    ctx: typer.Context,
    name: str,
    expires_at: Annotated[str | None, typer.Option(help="ISO 8601 expiry time.")] = None,
    team: Annotated[str | None, typer.Option(help="Team slug.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a key; its secret is printed once."""
    with _client(ctx) as client:
        _issued(client.keys.create(name, expires_at=expires_at, team=team), as_json)


@keys_app.command("rotate")
@handles_errors
def keys_rotate(
    ctx: typer.Context,
    key_id: int,
    grace_hours: Annotated[
        float | None, typer.Option(help="Hours the old key keeps working.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Issue a successor key; the old one works for the grace period, then expires."""
    with _client(ctx) as client:
        _issued(client.keys.rotate(key_id, grace_hours=grace_hours), as_json)


@keys_app.command("revoke")
@handles_errors
def keys_revoke(ctx: typer.Context, key_id: int, as_json: JsonOpt = False) -> None:
    """Revoke a key at once."""
    with _client(ctx) as client:
        key = client.keys.revoke(key_id)
        if as_json:
            dump(key)
        else:
            out.print(f"revoked key {key.id} '{key.name}' ({key.prefix})", highlight=False)


def main() -> None:
    app(prog_name="opentinker")
