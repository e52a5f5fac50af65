"""A job's evaluation transcripts, episode by episode, with the images the policy saw.

The runner writes one JSON line per evaluated episode (``eval/step-NNNNNN.jsonl``, or an eval
job's ``eval/transcripts.jsonl``): the conversation of each turn, the action, the reward and
what the environment noted. Messages are text or lists of parts; an image part holds its
picture as a data URI, which the page shows as it is, after checking that it is a base64 PNG
or JPEG (anything else is shown as text, never put in a ``src``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from jobs import artifacts

from .common import team_job

PER_PAGE = 20
# A data URI safe to put in an <img src>: an image type and base64 characters only.
_IMAGE_URI = re.compile(r"^data:image/(png|jpeg);base64,[A-Za-z0-9+/]+=*$")


def _parts(message: dict[str, Any]) -> list[dict[str, str]]:
    """A message's content as ``{"text"}`` and ``{"image"}`` parts, in order."""
    content = message.get("content", "")
    if isinstance(content, str):
        return [{"text": content}]
    out: list[dict[str, str]] = []
    for part in content if isinstance(content, list) else []:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "text":
            out.append({"text": str(part.get("text", ""))})
        elif part.get("type") in ("image", "image_url"):
            uri = part.get("image") or part.get("image_url") or ""
            # OpenAI's shape nests the URI ({"url": ...}); some environments give it bare.
            if isinstance(uri, dict):
                uri = uri.get("url", "")
            if isinstance(uri, str) and _IMAGE_URI.match(uri):
                out.append({"image": uri})
            else:
                out.append({"text": "[an image that is not a base64 PNG or JPEG]"})
    return out


def _dicts(value: Any) -> list[dict[str, Any]]:
    """The mappings of a list; anything else is no list at all. A transcript is written by
    the runner from what an environment returned, so its shape is checked, not trusted."""
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _episode(index: int, line: str) -> dict[str, Any]:
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return {"index": index, "broken": "this line is not valid JSON"}
    if not isinstance(data, dict):
        return {"index": index, "broken": "this line is not a JSON object"}
    turns = []
    for turn in _dicts(data.get("turns")):
        messages = [
            {"role": str(m.get("role", "")), "parts": _parts(m)}
            for m in _dicts(turn.get("observation"))
        ]
        turns.append(
            {
                "messages": messages,
                "action": str(turn.get("action", "")),
                "reward": turn.get("reward"),
            }
        )
    return {
        "index": index,
        "reward": data.get("reward"),
        "error": data.get("error"),
        "info": data.get("info") or {},
        "turns": turns,
    }


@login_required
def job_transcript(request: HttpRequest, job_id: Any, name: str) -> HttpResponse:
    """``eval/<name>.jsonl`` of a job of the user's teams, ``PER_PAGE`` episodes a page."""
    job = team_job(request, job_id)
    path = artifacts.artifact_path(job.pk, f"eval/{name}")
    if path is None:
        raise Http404("no such transcript")
    try:
        page = max(1, int(request.GET.get("page", "1")))
    except ValueError:
        page = 1
    first = (page - 1) * PER_PAGE
    episodes = []
    total = 0
    # Pages count episodes, not lines: a blank line must not shift the pages past the links.
    # Bytes that are not UTF-8 (a model's output cut mid-character) show as U+FFFD.
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            if first <= total < first + PER_PAGE:
                episodes.append(_episode(total + 1, line))
            total += 1
    return render(
        request,
        "web/transcript.html",
        {
            "job": job,
            "name": name,
            "episodes": episodes,
            "page": page,
            "total": total,
            "previous": page - 1 if page > 1 else None,
            "next": page + 1 if first + PER_PAGE < total else None,
        },
    )
