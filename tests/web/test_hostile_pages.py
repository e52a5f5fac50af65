"""Hostile query strings, spec files and transcripts: a clear error or a page, never a 500,
and never a spec other than the one the user sent."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse

from accounts.models import Quota, Team
from jobs import artifacts
from jobs.models import Job
from web.forms import MAX_SPEC_BYTES

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "query, field",
    [
        ({"q": "a" * 60_000}, "Search"),
        ({"q": "run\x00"}, "Search"),
        ({"state": "EXPLODED"}, "State"),
    ],
    ids=["over-long-search", "nul-in-search", "unknown-state"],
)
def test_it_answers_400_naming_the_bad_filter_of_the_jobs_list(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
    query: dict[str, str],
    field: str,
) -> None:
    submit(team, owner, "visible-run")
    client = login(owner)
    client.raise_request_exception = False
    response = client.get(reverse("web:jobs"), query)
    assert response.status_code == 400
    page = response.content.decode()
    assert 'id="filter-errors"' in page and f">{field}</a>:" in page
    # An unusable filter lists nothing rather than every job as if unfiltered.
    assert "visible-run" not in page
    fragment = client.get(reverse("web:jobs"), query, HTTP_HX_REQUEST="true")
    assert fragment.status_code == 400


def test_it_keeps_the_filters_in_the_page_links(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
) -> None:
    Quota.objects.update_or_create(team=team, defaults={"max_queued_jobs": 30})
    for i in range(26):
        submit(team, owner, f"run & co {i}")
    page = login(owner).get(reverse("web:jobs"), {"q": "run & co", "state": "QUEUED"})
    assert page.status_code == 200
    [link] = re.findall(r'href="\?([^"]*)">Next<', page.content.decode())
    assert parse_qs(html.unescape(link)) == {"q": ["run & co"], "state": ["QUEUED"], "page": ["2"]}


def _post_spec_file(client: Client, content: bytes) -> Any:
    upload = SimpleUploadedFile("spec.yaml", content, content_type="application/x-yaml")
    return client.post(reverse("web:job_new_yaml"), {"spec_yaml": "", "spec_file": upload})


@pytest.mark.parametrize(
    ("content", "words"),
    [
        # Cut at the limit, this file parses as a valid smoke spec with smoke_steps: 7 lost.
        (b"method: smoke\n" + b"#" * MAX_SPEC_BYTES + b"\nsmoke_steps: 7\n", "larger than"),
        (b"method: smoke\nname: caf\xe9\n", "not UTF-8"),
    ],
    ids=["over-the-limit", "not-utf8"],
)
def test_it_refuses_a_spec_file_it_cannot_read_whole(
    login: Callable[[Any], Client],
    gpu_inventory_unknown: None,
    team: Team,
    owner: Any,
    content: bytes,
    words: str,
) -> None:
    response = _post_spec_file(login(owner), content)
    assert response.status_code == 200
    [error] = response.context["yaml_form"].errors["spec_file"]
    assert words in error
    assert not Job.objects.exists()


def test_it_says_a_deeply_nested_yaml_spec_is_too_deep(
    login: Callable[[Any], Client], gpu_inventory_unknown: None, team: Team, owner: Any
) -> None:
    spec_yaml = "method: smoke\nx: " + "[" * 5000 + "]" * 5000 + "\n"
    response = login(owner).post(reverse("web:job_new_yaml"), {"spec_yaml": spec_yaml})
    assert response.status_code == 200
    [error] = response.context["yaml_form"].errors["spec_yaml"]
    assert "nested deeper" in error
    assert not Job.objects.exists()


def _write_transcript(job: Job, content: bytes) -> str:
    path = artifacts.workdir(job.pk) / "eval" / "transcripts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return reverse("web:job_transcript", args=[job.pk, "transcripts.jsonl"])


def test_it_shows_transcript_lines_of_any_shape_without_failing(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
    settings: Any,
    tmp_path: Path,
) -> None:
    settings.OPENTINKER_DATA_DIR = tmp_path
    job = submit(team, owner, "odd-env")
    odd = {
        "reward": 1.0,
        "turns": [
            "not a turn",
            {
                "observation": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": "data:x"}]},
                    "not a message",
                ],
                "action": "the caf\ufffd answer",
            },
            {"observation": {"role": "user"}, "action": "second"},
        ],
    }
    lines = [b"5", b"[1, 2]", json.dumps(odd).encode(), b'{"reward": 0, "turns": "x"}', b"\xff\xfe"]
    url = _write_transcript(job, b"\n".join(lines) + b"\n")
    response = login(owner).get(url)
    assert response.status_code == 200
    page = response.content.decode()
    assert "Episode 1: this line is not a JSON object" in page
    assert "Episode 2: this line is not a JSON object" in page
    assert "[an image that is not a base64 PNG or JPEG]" in page
    assert "the caf\ufffd answer" in page and "second" in page
    assert "Episode 5: this line is not valid JSON" in page


def test_it_pages_transcripts_by_episode_whatever_blank_lines_they_hold(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
    settings: Any,
    tmp_path: Path,
) -> None:
    settings.OPENTINKER_DATA_DIR = tmp_path
    job = submit(team, owner, "gappy")
    episodes = [json.dumps({"reward": 1, "info": {"n": f"episode-{i}"}}) for i in range(25)]
    url = _write_transcript(job, "\n\n".join(episodes).encode() + b"\n")
    client = login(owner)
    first = client.get(url).content.decode()
    assert "episode-19" in first and "episode-20" not in first and "?page=2" in first
    second = client.get(url, {"page": "2"}).content.decode()
    assert "episode-20" in second and "episode-24" in second and "?page=3" not in second


def test_a_spec_file_alone_submits_and_a_file_with_typed_text_is_refused(
    login: Callable[[Any], Client], gpu_inventory_unknown: None, team: Team, owner: Any
) -> None:
    client = login(owner)
    alone = _post_spec_file(client, b"method: smoke\nsmoke_steps: 3\n")
    assert alone.status_code == 302, alone.context and alone.context["yaml_form"].errors
    assert Job.objects.get().spec["smoke_steps"] == 3
    upload = SimpleUploadedFile("spec.yaml", b"method: smoke\n", content_type="application/x-yaml")
    both = client.post(
        reverse("web:job_new_yaml"),
        {"spec_yaml": "method: smoke\nsmoke_steps: 9\n", "spec_file": upload},
    )
    assert both.status_code == 200
    assert "not both" in both.context["yaml_form"].errors["spec_file"][0]
    neither = client.post(reverse("web:job_new_yaml"), {"spec_yaml": ""})
    assert neither.status_code == 200 and neither.context["yaml_form"].errors["spec_yaml"]
    assert Job.objects.count() == 1
