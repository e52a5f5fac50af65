"""The Python SDK: ``Client`` and its resources (jobs, datasets, keys, teams).

>>> client = Client("http://localhost:8000", "otk_...")
>>> job = client.jobs.submit({"method": "smoke", "smoke_steps": 3})
>>> job.wait(progress=True).state
'SUCCEEDED'
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Self, TypeVar
from urllib.parse import quote

import httpx
import pydantic

from . import _files, config
from ._http import Transport, fetch_resuming, next_query
from .errors import (
    Conflict,
    JobFailed,
    NotFound,
    OpenTinkerError,
    UnexpectedResponse,
    UsageError,
    WaitTimeout,
)
from .models import (
    ApiKey,
    Artifact,
    BaseModelInfo,
    Checkpoint,
    Dataset,
    IssuedApiKey,
    JobEvent,
    JobRecord,
    Me,
    Metrics,
    Quota,
    Team,
)
from .spec import Schema, schema_from_openapi, shipped_schema

API = "/api/v1"

M = TypeVar("M", bound=pydantic.BaseModel)


def _parse(model: type[M], raw: Any) -> M:
    """The server's JSON as ``model``; another shape is the server's fault, said in one line."""
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise UnexpectedResponse(
            f"unexpected response from the server (a {model.__name__} with {where}: {first['msg']})"
        ) from None


def _parse_list(model: type[M], raw: Any) -> list[M]:
    if not isinstance(raw, list):
        raise UnexpectedResponse(
            f"unexpected response from the server (expected a list of {model.__name__}, "
            f"got {type(raw).__name__})"
        )
    return [_parse(model, item) for item in raw]


def _segment(value: str, what: str, *, slashes: bool = False) -> str:
    """``value`` quoted for one URL path segment (or several, for artifact names such as
    ``eval/step-2.jsonl``); a ``.`` or ``..`` would be resolved away and reach another URL."""
    parts = value.split("/") if slashes else [value]
    if any(part in ("", ".", "..") for part in parts):
        raise UsageError(f"not a valid {what}: {value!r}")
    return "/".join(quote(part, safe="") for part in parts)


def _job_id(value: str) -> str:
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise UsageError(f"not a job id: {value!r} (a job id is a UUID)") from None


class Job:
    """A handle on one job: its last fetched ``record`` plus the calls that act on it."""

    def __init__(self, client: Client, record: JobRecord) -> None:
        self._client = client
        self.record = record

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.state}>"

    def __getattr__(self, name: str) -> Any:
        # Fields of the record read as attributes of the job: job.state, job.current_step, ...
        if name.startswith("_") or name == "record":
            raise AttributeError(name)
        return getattr(self.record, name)

    @property
    def id(self) -> str:
        return str(self.record.id)

    @property
    def _path(self) -> str:
        return f"{API}/jobs/{self.id}"

    def refresh(self) -> Job:
        self.record = _parse(JobRecord, self._client._http.get(self._path))
        return self

    def cancel(self) -> Job:
        """Ask the server to cancel; a running job stops within a step. Safe to repeat: a job
        already CANCELLED is returned as it is; one that ended otherwise raises ``Conflict``."""
        try:
            body = self._client._http.post(f"{self._path}/cancel", idempotent=True)
        except Conflict as exc:
            self.refresh()
            if self.record.state == "CANCELLED":
                return self
            if self.record.is_final:
                raise Conflict(
                    exc.status,
                    f"job {self.id} already ended {self.record.state}; nothing to cancel",
                    exc.errors,
                    exc.body,
                ) from None
            raise
        self.record = _parse(JobRecord, body)
        return self

    def metrics(self, names: list[str] | None = None, since_step: int | None = None) -> Metrics:
        params: dict[str, Any] = {}
        if names:
            params["name"] = names
        if since_step is not None:
            params["since_step"] = since_step
        return _parse(Metrics, self._client._http.get(f"{self._path}/metrics", params=params))

    def events(self, follow: bool = False, poll: float = 1.0) -> Iterator[JobEvent]:
        """The event log, oldest first; with ``follow``, new events until the job ends."""
        http = self._client._http
        url = f"{self._path}/events"
        query: Any = None
        seen: set[int] = set()
        links: set[str] = set()
        while True:
            # Read the state before the page, so the events of the final transition are in it.
            final = (not follow) or self.refresh().is_final
            page = http.page(url, query)
            for raw in page["results"]:
                event = _parse(JobEvent, raw)
                if event.id not in seen:
                    seen.add(event.id)
                    yield event
            if page.get("next"):
                query = next_query(page["next"], url, links)
                continue
            if final:
                return
            time.sleep(poll)

    def wait(
        self,
        *,
        progress: bool = False,
        timeout: float | None = None,
        poll: float = 0.5,
        max_poll: float = 5.0,
        raise_on_failure: bool = False,
    ) -> Job:
        """Poll until the job ends. The interval grows while nothing changes and drops back
        when the step moves. With ``progress``, a bar shows the step, last reward and ETA.

        After ``timeout`` seconds, raises ``WaitTimeout``; the job keeps running.
        """
        if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
            raise UsageError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = poll
        bar = None
        if progress:
            from .progress import JobProgress

            bar = JobProgress(self.id, self.record.total_steps).__enter__()
        last_step: int | None = None
        reward: float | None = None
        metric_step = 0
        try:
            while True:
                self.refresh()
                step = self.record.current_step
                if bar is not None:
                    # The heartbeat's step can lag; the metrics show the last finished step.
                    fresh = self.metrics(since_step=metric_step + 1)
                    for name, points in fresh.series.items():
                        if points:
                            metric_step = max(metric_step, int(points[-1][0]))
                        if name == "reward/mean" and points:
                            reward = points[-1][1]
                    step = max(step or 0, metric_step) or None
                    bar.update(step=step, state=self.record.state, reward=reward)
                if self.record.is_final:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout(self.record, float(timeout or 0))
                interval = poll if step != last_step else min(interval * 1.5, max_poll)
                last_step = step
                time.sleep(interval)
        finally:
            if bar is not None:
                bar.__exit__(None, None, None)
        if raise_on_failure and self.record.state != "SUCCEEDED":
            raise JobFailed(self.record)
        return self

    def checkpoints(self) -> list[Checkpoint]:
        return _parse_list(Checkpoint, self._client._http.get(f"{self._path}/checkpoints"))

    def artifacts(self) -> list[Artifact]:
        return _parse_list(Artifact, self._client._http.get(f"{self._path}/artifacts"))

    def download(
        self,
        checkpoint: Checkpoint | str | None = None,
        path: str | Path = ".",
        *,
        overwrite: bool = False,
    ) -> Path:
        """Save a checkpoint's training state (``state.pt``); the latest when none is named.

        ``path`` is a file, or a directory (one that exists, or any path ending in ``/``) to
        put ``<job>-<checkpoint>-state.pt`` in. An existing file is replaced only with
        ``overwrite``.
        """
        if checkpoint is None:
            found = self.checkpoints()
            if not found:
                raise NotFound(404, f"job {self.id} has no checkpoints (yet)")
            checkpoint = found[-1]
        name = checkpoint.name if isinstance(checkpoint, Checkpoint) else checkpoint
        url = f"{self._path}/checkpoints/{_segment(name, 'checkpoint name')}"
        target = Path(path)
        if _files.names_directory(path):
            target = target / f"{self.id}-{name}-state.pt"
        return self._client._download(url, target, overwrite=overwrite)

    def download_artifact(
        self,
        name: str = "adapter",
        path: str | Path = ".",
        *,
        extract: bool = True,
        overwrite: bool = False,
    ) -> Path:
        """Save an artifact. A directory artifact (``adapter``, ``model``) comes as a zip; with
        ``extract`` it is unpacked into ``path/<name>`` and that directory is returned.

        ``path`` is a directory when it exists, ends in ``/`` or has no suffix. What exists is
        kept unless ``overwrite``: then a file is replaced, and an unpacked directory gets the
        new files written into it (files of other names in it are left alone).
        """
        url = f"{self._path}/artifacts/{_segment(name, 'artifact name', slashes=True)}"
        zipped = name in ("adapter", "model")
        target = Path(path)
        if _files.names_directory(path) or not target.suffix:
            target = target / (f"{name}.zip" if zipped else name.replace("/", "-"))
        if not (zipped and extract):
            return self._client._download(url, target, overwrite=overwrite)
        out = target.with_suffix("")
        _files.check_directory_free(out, overwrite)
        with _files.scratch_file(out.parent) as archive:
            self._client._fetch(url, archive)
            archive.seek(0)
            return _files.unpack(archive, out, overwrite=overwrite, label=f"{name} of {self.id}")


class Jobs:
    def __init__(self, client: Client) -> None:
        self._client = client

    def submit(
        self,
        spec: dict[str, Any],
        *,
        name: str = "",
        kind: str = "train",
        team: str | None = None,
    ) -> Job:
        """Submit a JobSpec; invalid specs raise ``ValidationError`` naming each field.

        Not retried on a lost connection (it could create the job twice).
        """
        body: dict[str, Any] = {"spec": spec, "name": name, "kind": kind}
        if team:
            body["team"] = team
        record = _parse(JobRecord, self._client._http.post(f"{API}/jobs", json=body))
        return Job(self._client, record)

    def get(self, job_id: str) -> Job:
        """One job by id (a UUID; anything else is refused before a request is sent)."""
        raw = self._client._http.get(f"{API}/jobs/{_job_id(job_id)}")
        return Job(self._client, _parse(JobRecord, raw))

    def list(
        self, *, state: str | list[str] | None = None, name: str | None = None, limit: int = 50
    ) -> list[Job]:
        if limit < 1:
            raise UsageError(f"limit must be at least 1, got {limit}")
        params: dict[str, Any] = {}
        if state:
            params["state"] = [state] if isinstance(state, str) else state
        if name:
            params["name"] = name
        out: list[Job] = []
        for raw in self._client._http.paginate(f"{API}/jobs", params=params):
            out.append(Job(self._client, _parse(JobRecord, raw)))
            if len(out) >= limit:
                break
        return out


class Datasets:
    def __init__(self, client: Client) -> None:
        self._client = client

    def upload(
        self,
        file: str | Path,
        *,
        env: str,
        name: str | None = None,
        format: str | None = None,
        team: str | None = None,
    ) -> Dataset:
        """Upload a .jsonl or .parquet file, or a .zip of a .jsonl and its images; the server
        checks every row against ``env``."""
        path = Path(file)
        data = {"name": name or path.stem, "env": env}
        if format:
            data["format"] = format
        if team:
            data["team"] = team
        try:
            handle: IO[bytes] = path.open("rb")
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
        with handle:
            body = self._client._http.post(
                f"{API}/datasets", data=data, files={"file": (path.name, handle)}
            )
        return _parse(Dataset, body)

    def list(self, *, env: str | None = None, name: str | None = None) -> list[Dataset]:
        """Datasets of your teams; ``name`` keeps those whose name contains it."""
        params = {k: v for k, v in (("env", env), ("name", name)) if v} or None
        return [_parse(Dataset, d) for d in self._client._http.paginate(f"{API}/datasets", params)]

    def get(self, dataset_id: str) -> Dataset:
        """A dataset by id or ref (``dataset:<id>``)."""
        return _parse(Dataset, self._client._http.get(self._url(dataset_id)))

    def find(self, name_or_ref: str) -> Dataset:
        """A dataset by id, ref or exact name; a name two teams use is refused as ambiguous."""
        if self._is_ref(name_or_ref):
            return self.get(name_or_ref)
        found = [d for d in self.list(name=name_or_ref) if d.name == name_or_ref]
        if not found:
            raise NotFound(404, f"no dataset named {name_or_ref!r}")
        if len(found) > 1:
            refs = ", ".join(f"{d.ref} (team {d.team})" for d in found)
            raise UsageError(f"several datasets are named {name_or_ref!r}: {refs}; give a ref")
        return found[0]

    def delete(self, dataset_id: str) -> None:
        """Delete a dataset by id or ref (``dataset:<id>``)."""
        self._client._http.request("DELETE", self._url(dataset_id))

    @staticmethod
    def _is_ref(value: str) -> bool:
        try:
            uuid.UUID(value.removeprefix("dataset:"))
        except ValueError:
            return False
        return True

    def _url(self, dataset_id: str) -> str:
        bare = dataset_id.removeprefix("dataset:")
        return f"{API}/datasets/{_segment(bare, 'dataset id')}"


class Keys:
    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self) -> list[ApiKey]:
        return [_parse(ApiKey, k) for k in self._client._http.paginate(f"{API}/keys")]

    def create(
        self, name: str, *, expires_at: str | None = None, team: str | None = None
    ) -> IssuedApiKey:
        body: dict[str, Any] = {"name": name}
        if expires_at:
            body["expires_at"] = expires_at
        if team:
            body["team"] = team
        return _parse(IssuedApiKey, self._client._http.post(f"{API}/keys", json=body))

    def rotate(self, key_id: int, *, grace_hours: float | None = None) -> IssuedApiKey:
        """A successor key; the old one keeps working for the grace period."""
        body: dict[str, Any] = {}
        if grace_hours is not None:
            if not (math.isfinite(grace_hours) and grace_hours >= 0):
                raise UsageError(f"grace hours must be a finite number >= 0, got {grace_hours}")
            body["grace_hours"] = grace_hours
        return _parse(
            IssuedApiKey, self._client._http.post(f"{API}/keys/{int(key_id)}/rotate", json=body)
        )

    def revoke(self, key_id: int) -> ApiKey:
        body = self._client._http.post(f"{API}/keys/{int(key_id)}/revoke", idempotent=True)
        return _parse(ApiKey, body)


class Client:
    """A connection to one OpenTinker server.

    ``url`` and ``api_key`` default to ``OPENTINKER_URL`` / ``OPENTINKER_API_KEY``, then to
    the file ``opentinker login`` writes. ``retries`` (default ``OPENTINKER_RETRIES`` or 4)
    bounds the retries of an idempotent call on a network failure.
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        retries: int | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        settings = config.resolve(url, api_key)
        if retries is None:
            retries = config.retries()
        assert settings.url and settings.api_key
        self.settings = settings
        self.url = settings.url
        self._http = Transport(
            settings.url, settings.api_key, timeout=timeout, retries=retries, transport=transport
        )
        self.jobs = Jobs(self)
        self.datasets = Datasets(self)
        self.keys = Keys(self)
        self._schema: Schema | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def me(self) -> Me:
        return _parse(Me, self._http.get(f"{API}/me"))

    def teams(self) -> list[Team]:
        return [_parse(Team, t) for t in self._http.paginate(f"{API}/teams")]

    def quota(self, team: str | None = None) -> Quota:
        params = {"team": team} if team else None
        return _parse(Quota, self._http.get(f"{API}/quota", params=params))

    def base_models(self) -> list[BaseModelInfo]:
        return [_parse(BaseModelInfo, m) for m in self._http.paginate(f"{API}/base-models")]

    def jobspec_schema(self) -> Schema:
        """The server's JobSpec schema if its OpenAPI document has one, else the shipped copy."""
        if self._schema is None:
            schema = None
            try:
                document = self._http.get("/api/schema/", params={"format": "json"})
                if isinstance(document, dict):
                    schema = schema_from_openapi(document)
            except OpenTinkerError:
                schema = None
            self._schema = schema or shipped_schema()
        return self._schema

    def _fetch(self, path: str, out: IO[bytes]) -> None:
        fetch_resuming(self._http, path, out)

    def _download(self, path: str, target: Path, *, overwrite: bool = False) -> Path:
        """Stream to a temporary file beside ``target``, then rename: no torn files."""
        with _files.new_file(target, overwrite=overwrite) as out:
            self._fetch(path, out)
        return target
