"""The Python SDK: ``Client`` and its resources (jobs, datasets, keys, teams).

>>> client = Client("http://localhost:8000", "otk_...")
>>> job = client.jobs.submit({"method": "smoke", "smoke_steps": 3})
>>> job.wait(progress=True).state
'SUCCEEDED'
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Self
from urllib.parse import quote

import httpx

from . import config
from ._http import Transport
from .errors import JobFailed, NotFound, OpenTinkerError, UsageError
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
        self.record = JobRecord.model_validate(self._client._http.get(self._path))
        return self

    def cancel(self) -> Job:
        """Ask the server to cancel; a running job stops within a step. Safe to repeat."""
        body = self._client._http.post(f"{self._path}/cancel", idempotent=True)
        self.record = JobRecord.model_validate(body)
        return self

    def metrics(self, names: list[str] | None = None, since_step: int | None = None) -> Metrics:
        params: dict[str, Any] = {}
        if names:
            params["name"] = names
        if since_step is not None:
            params["since_step"] = since_step
        return Metrics.model_validate(
            self._client._http.get(f"{self._path}/metrics", params=params)
        )

    def events(self, follow: bool = False, poll: float = 1.0) -> Iterator[JobEvent]:
        """The event log, oldest first; with ``follow``, new events until the job ends."""
        http = self._client._http
        url = f"{self._path}/events"
        seen: set[int] = set()
        while True:
            # Read the state before the page, so the events of the final transition are in it.
            final = (not follow) or self.refresh().is_final
            page = http.page(url)
            for raw in page.get("results", []):
                event = JobEvent.model_validate(raw)
                if event.id not in seen:
                    seen.add(event.id)
                    yield event
            if page.get("next"):
                url = page["next"]
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
        when the step moves. With ``progress``, a bar shows the step, last reward and ETA."""
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
                    raise TimeoutError(f"job {self.id} still {self.record.state} after {timeout} s")
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
        body = self._client._http.get(f"{self._path}/checkpoints")
        return [Checkpoint.model_validate(c) for c in body]

    def artifacts(self) -> list[Artifact]:
        body = self._client._http.get(f"{self._path}/artifacts")
        return [Artifact.model_validate(a) for a in body]

    def download(self, checkpoint: Checkpoint | str | None = None, path: str | Path = ".") -> Path:
        """Save a checkpoint's training state (``state.pt``); the latest when none is named.

        ``path`` is a file, or a directory to put ``<job>-<checkpoint>-state.pt`` in.
        """
        if checkpoint is None:
            found = self.checkpoints()
            if not found:
                raise NotFound(404, f"job {self.id} has no checkpoints (yet)")
            checkpoint = found[-1]
        name = checkpoint.name if isinstance(checkpoint, Checkpoint) else checkpoint
        target = Path(path)
        if target.is_dir():
            target = target / f"{self.id}-{name}-state.pt"
        return self._client._download(f"{self._path}/checkpoints/{quote(name)}", target)

    def download_artifact(
        self, name: str = "adapter", path: str | Path = ".", *, extract: bool = True
    ) -> Path:
        """Save an artifact. A directory artifact (``adapter``, ``model``) comes as a zip; with
        ``extract`` it is unpacked into ``path/<name>`` and that directory is returned."""
        target = Path(path)
        zipped = name in ("adapter", "model")
        if target.is_dir() or not target.suffix:
            target.mkdir(parents=True, exist_ok=True)
            filename = f"{name}.zip" if zipped else name.replace("/", "-")
            file_target = target / filename
        else:
            file_target = target
        saved = self._client._download(f"{self._path}/artifacts/{name}", file_target)
        if not (zipped and extract):
            return saved
        out = saved.with_suffix("")
        if out.exists():
            shutil.rmtree(out)
        with zipfile.ZipFile(saved) as zf:
            for member in zf.namelist():
                # Never write outside the target directory, whatever the archive says.
                if member.startswith("/") or ".." in Path(member).parts:
                    raise OpenTinkerError(f"refusing unsafe path {member!r} in {saved.name}")
            zf.extractall(out)
        saved.unlink()
        return out


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
        record = JobRecord.model_validate(self._client._http.post(f"{API}/jobs", json=body))
        return Job(self._client, record)

    def get(self, job_id: str) -> Job:
        return Job(
            self._client, JobRecord.model_validate(self._client._http.get(f"{API}/jobs/{job_id}"))
        )

    def list(
        self, *, state: str | list[str] | None = None, name: str | None = None, limit: int = 50
    ) -> list[Job]:
        params: dict[str, Any] = {}
        if state:
            params["state"] = [state] if isinstance(state, str) else state
        if name:
            params["name"] = name
        out: list[Job] = []
        for raw in self._client._http.paginate(f"{API}/jobs", params=params):
            out.append(Job(self._client, JobRecord.model_validate(raw)))
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
        return Dataset.model_validate(body)

    def list(self, *, env: str | None = None) -> list[Dataset]:
        params = {"env": env} if env else None
        return [
            Dataset.model_validate(d)
            for d in self._client._http.paginate(f"{API}/datasets", params)
        ]

    def get(self, dataset_id: str) -> Dataset:
        return Dataset.model_validate(self._client._http.get(f"{API}/datasets/{dataset_id}"))

    def delete(self, dataset_id: str) -> None:
        self._client._http.request("DELETE", f"{API}/datasets/{dataset_id}")


class Keys:
    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self) -> list[ApiKey]:
        return [ApiKey.model_validate(k) for k in self._client._http.paginate(f"{API}/keys")]

    def create(
        self, name: str, *, expires_at: str | None = None, team: str | None = None
    ) -> IssuedApiKey:
        body: dict[str, Any] = {"name": name}
        if expires_at:
            body["expires_at"] = expires_at
        if team:
            body["team"] = team
        return IssuedApiKey.model_validate(self._client._http.post(f"{API}/keys", json=body))

    def rotate(self, key_id: int, *, grace_hours: float | None = None) -> IssuedApiKey:
        """A successor key; the old one keeps working for the grace period."""
        body: dict[str, Any] = {}
        if grace_hours is not None:
            body["grace_hours"] = grace_hours
        return IssuedApiKey.model_validate(
            self._client._http.post(f"{API}/keys/{key_id}/rotate", json=body)
        )

    def revoke(self, key_id: int) -> ApiKey:
        body = self._client._http.post(f"{API}/keys/{key_id}/revoke", idempotent=True)
        return ApiKey.model_validate(body)


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
        return Me.model_validate(self._http.get(f"{API}/me"))

    def teams(self) -> list[Team]:
        return [Team.model_validate(t) for t in self._http.paginate(f"{API}/teams")]

    def quota(self, team: str | None = None) -> Quota:
        params = {"team": team} if team else None
        return Quota.model_validate(self._http.get(f"{API}/quota", params=params))

    def base_models(self) -> list[BaseModelInfo]:
        return [BaseModelInfo.model_validate(m) for m in self._http.paginate(f"{API}/base-models")]

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

    def _download(self, path: str, target: Path) -> Path:
        """Stream to a temporary file beside ``target``, then rename: no torn files."""
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out, self._http.stream(path) as response:
                for chunk in response.iter_bytes(1 << 16):
                    out.write(chunk)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target
