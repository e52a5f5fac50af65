"""A scripted HTTP server standing in for the API, for the client's fast tests: each
``"METHOD /path"`` gets the reply set for it (404 HTML otherwise, like Django's page for an
unknown URL), and every request is recorded with its raw, still percent-encoded path."""

from __future__ import annotations

import io
import json
import threading
import uuid
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

JOB_ID = "6f1f5bd2-3c52-4c43-9a57-0c1f9a3e2b11"
NOT_FOUND_PAGE = (
    "<!doctype html>\n<html>\n<h1>Not Found</h1>\n\n"
    "<p>The requested resource was not found on this server.</p>\n</html>\n"
)


@dataclass
class Reply:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)

    def encode(self) -> tuple[bytes, str]:
        if isinstance(self.body, bytes):
            return self.body, "application/octet-stream"
        if isinstance(self.body, str):
            return self.body.encode(), "text/html; charset=utf-8"
        if self.body is None:
            return b"", "application/json"
        return json.dumps(self.body).encode(), "application/json"


class FakeApi:
    def __init__(self) -> None:
        self.url = ""
        self.replies: dict[str, Reply | Callable[[], Reply]] = {}
        self.hits: list[str] = []
        self.bodies: list[bytes] = []

    def reply(self, key: str, status: int = 200, body: Any = None, **headers: str) -> None:
        self.replies[key] = Reply(
            status, body, {k.replace("_", "-"): v for k, v in headers.items()}
        )

    def count(self, key: str) -> int:
        return sum(1 for hit in self.hits if hit.split("?")[0] == key)

    @property
    def env(self) -> dict[str, str]:
        return {
            "OPENTINKER_URL": self.url,
            "OPENTINKER_API_KEY": "otk_testkey123",
            "OPENTINKER_RETRIES": "0",
        }

    def serve(self) -> Callable[[], None]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                key = f"{self.command} {self.path}"
                api.hits.append(key)
                length = int(self.headers.get("Content-Length") or 0)
                api.bodies.append(self.rfile.read(length) if length else b"")
                found = api.replies.get(key) or api.replies.get(key.split("?")[0])
                reply = found() if callable(found) else found
                reply = reply or Reply(404, NOT_FOUND_PAGE)
                data, content_type = reply.encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", content_type)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

            def handle_one_request(self) -> None:
                try:
                    super().handle_one_request()
                except (BrokenPipeError, ConnectionResetError):
                    # The client gave up waiting (a timeout under test) and went away.
                    self.close_connection = True

            def log_message(self, *args: Any) -> None:
                return None

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()

        def stop() -> None:
            server.shutdown()
            server.server_close()

        return stop


def job(state: str = "RUNNING", job_id: str = JOB_ID, **extra: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "team": "acme",
        "state": state,
        "created": "2024-05-01T12:00:00Z",
        "spec": {"method": "smoke", "smoke_steps": 5},
        **extra,
    }


def dataset(name: str, team: str = "acme") -> dict[str, Any]:
    pk = str(uuid.uuid4())
    return {
        "id": pk,
        "ref": f"dataset:{pk}",
        "team": team,
        "name": name,
        "env": "math",
        "format": "jsonl",
        "rows": 3,
    }


def zipped(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()
