"""Download answers for a job's files: byte ranges and HEAD on files, directories as zips,
rows streamed from the database.

A checkpoint's ``state.pt`` of a full fine-tune runs to gigabytes: a client whose connection
drops must be able to continue where it stopped (``Range``, RFC 9110 section 14), and a
client that only asks how large it is (``HEAD``) must not make the server read it. Files are
read in blocks while they are sent, never whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.utils.http import content_disposition_header, http_date
from rest_framework.request import Request

from . import artifacts

BLOCK_BYTES = 1 << 20
# One range only: several would need a multipart/byteranges body, which no download client
# of ours asks for; RFC 9110 lets a server answer those with the whole file instead.
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _read(path: Path, start: int, length: int) -> Iterator[bytes]:
    with path.open("rb") as fh:
        fh.seek(start)
        while length > 0:
            block = fh.read(min(BLOCK_BYTES, length))
            if not block:
                return
            length -= len(block)
            yield block


def _wanted_range(header: str, size: int) -> tuple[int, int] | bool | None:
    """``(start, end)`` inclusive for a satisfiable single range, ``None`` to send the whole
    file (no header, or one this server does not take), ``False`` when unsatisfiable."""
    match = _RANGE.match(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:
        # A suffix: the last N bytes.
        suffix = int(last)
        if suffix == 0 or size == 0:
            return False
        return max(0, size - suffix), size - 1
    start = int(first)
    if last and int(last) < start:
        return None  # syntactically invalid: ignored, as RFC 9110 says
    if start >= size:
        return False
    return start, min(int(last), size - 1) if last else size - 1


def file_response(
    request: HttpRequest | Request, path: Path, *, filename: str, content_type: str
) -> HttpResponseBase:
    """``path`` as an attachment: 200, or 206 for one satisfiable ``Range``, or 416.

    ``If-Range`` with a validator that no longer matches (the file was rewritten, e.g. a
    resumed run saved that checkpoint again) gets the whole new file, never a piece of it
    spliced onto the old one.
    """
    stat = path.stat()
    size = stat.st_size
    etag = f'"{stat.st_mtime_ns:x}-{size:x}"'
    last_modified = http_date(stat.st_mtime)
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": etag,
        "Last-Modified": last_modified,
        "Content-Disposition": content_disposition_header(True, filename),
    }
    wanted: tuple[int, int] | bool | None = None
    header = request.META.get("HTTP_RANGE", "")
    if_range = request.META.get("HTTP_IF_RANGE", "").strip()
    if header and (not if_range or if_range in (etag, last_modified)):
        wanted = _wanted_range(header, size)
    if wanted is False:
        answer = JsonResponse(
            {
                "detail": f"range not satisfiable: the file has {size} bytes",
                "range": header,
                "size": size,
            },
            status=416,
        )
        answer["Content-Range"] = f"bytes */{size}"
        answer["Accept-Ranges"] = "bytes"
        return answer
    start, end, status = 0, size - 1, 200
    if isinstance(wanted, tuple):
        (start, end), status = wanted, 206
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    length = max(0, end - start + 1)
    body: Iterable[bytes] = [] if request.method == "HEAD" else _read(path, start, length)
    response = StreamingHttpResponse(body, status=status, content_type=content_type)
    for name, value in headers.items():
        response[name] = value
    response["Content-Length"] = str(length)
    return response


def jsonl_response(rows: Iterable[dict[str, object]], *, filename: str) -> StreamingHttpResponse:
    """Rows as JSON Lines, encoded as they are sent: a job's metrics may be millions of rows,
    which must not sit in the web process's memory at once."""

    def lines() -> Iterator[bytes]:
        batch: list[str] = []
        for row in rows:
            batch.append(json.dumps(row))
            if len(batch) >= 1000:
                yield ("\n".join(batch) + "\n").encode()
                batch = []
        if batch:
            yield ("\n".join(batch) + "\n").encode()

    response = StreamingHttpResponse(lines(), content_type="application/jsonl")
    response["Content-Disposition"] = content_disposition_header(True, filename)
    return response


def zip_response(
    request: HttpRequest | Request,
    job_id: object,
    path: Path,
    filename: str,
    *,
    compress: bool = True,
) -> HttpResponseBase:
    """A directory as a zip, made once and then served as a file (``Range``, ``HEAD``,
    ``ETag``). A HEAD before any download answers with the headers alone rather than make
    the zip: its size is not known until it is made."""
    if request.method == "HEAD":
        made = artifacts.zipped_if_made(job_id, path, compress=compress)
        if made is None:
            response = StreamingHttpResponse([], content_type="application/zip")
            response["Content-Disposition"] = content_disposition_header(True, filename)
            response["Accept-Ranges"] = "bytes"
            return response
    else:
        made = artifacts.zipped(job_id, path, compress=compress)
    return file_response(request, made, filename=filename, content_type="application/zip")
