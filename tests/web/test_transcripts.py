"""A job's evaluation transcripts as a page: messages, the images the policy saw, answers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import Team
from environments import images
from jobs import artifacts
from jobs.models import Job
from training import geometry

pytestmark = pytest.mark.django_db


def _write(job: Job, name: str, episodes: list[dict[str, Any]]) -> Path:
    path = artifacts.workdir(job.pk) / "eval" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return path


def _episode(content: Any, action: str = "\\boxed{58}", reward: float = 1.0) -> dict[str, Any]:
    return {
        "reward": reward,
        "error": None,
        "turns": [
            {
                "observation": [{"role": "user", "content": content}],
                "action": action,
                "reward": reward,
                "metrics": {},
            }
        ],
        "info": {"answer": "58"},
    }


def test_it_shows_each_episode_with_its_images_and_answer(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    other_team: Team,
    owner: Any,
    outsider: Any,
    settings: Any,
    tmp_path: Path,
) -> None:
    settings.OPENTINKER_DATA_DIR = tmp_path
    job = submit(team, owner, "geo")
    png = geometry.problem(0).image
    uri = images.data_uri(png)
    _write(
        job,
        "step-000002.jsonl",
        [
            _episode([images.image_part(png), images.text_part("Find <b>x</b>.")]),
            _episode([{"type": "image", "image": "data:text/html;base64,PHNjcmlwdD4="}], "no", 0.0),
            _episode("plain <script>text</script>"),
        ],
    )
    url = reverse("web:job_transcript", args=[job.pk, "step-000002.jsonl"])
    response = login(owner).get(url)
    assert response.status_code == 200
    page = response.content.decode()
    assert f'<img class="transcript-image" src="{uri}"' in page
    assert "Find &lt;b&gt;x&lt;/b&gt;." in page
    assert "data:text/html" not in page
    assert "not a base64 PNG or JPEG" in page
    assert "&lt;script&gt;" in page and "<script>text" not in page
    assert "3 episodes" in page

    assert login(outsider).get(url).status_code == 404
    missing = reverse("web:job_transcript", args=[job.pk, "..%2Fsummary.json"])
    assert login(owner).get(missing).status_code == 404


def test_it_pages_long_transcripts(
    login: Callable[[Any], Client],
    submit: Callable[..., Job],
    team: Team,
    owner: Any,
    settings: Any,
    tmp_path: Path,
) -> None:
    settings.OPENTINKER_DATA_DIR = tmp_path
    job = submit(team, owner, "long")
    _write(job, "transcripts.jsonl", [_episode(f"question {i}") for i in range(45)])
    url = reverse("web:job_transcript", args=[job.pk, "transcripts.jsonl"])
    client = login(owner)
    first = client.get(url).content.decode()
    assert "question 0" in first and "question 19" in first and "question 20" not in first
    last = client.get(url + "?page=3").content.decode()
    assert "question 40" in last and "question 44" in last and "Next" not in last
