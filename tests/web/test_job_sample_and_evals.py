"""The job page's eval results and sample box, against a real finished RL job.

One short RL job on the tiny model runs on a real Celery worker (steps 0-2 evaluated, a PEFT
adapter exported); the page must show its eval metrics per step with links to the transcripts
the runner wrote, and the sample box must generate exactly what the REST API's sample endpoint
generates (both answered by the model worker of the tiny base model, which the same Celery
worker starts: this process loads no model), with htmx (fragment) and without JavaScript (full
page, CSRF enforced), refuse bad parameters beside the fields, and hide the job from other
teams.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from accounts.models import Team
from jobs.models import Job, JobMetric, JobState
from tests.e2e.conftest import (  # noqa: F401  (fixtures)
    addition_dataset,
    shared_data_dir,
    tiny_model_dir,
    trainer,
)
from tests.e2e.test_managed_training import finished, rl_spec, submit
from tests.tinker_api.conftest import clean_tinker_keys, sdk_worker_env  # noqa: F401

HTMX = {"HTTP_HX_REQUEST": "true"}


def _samples(html: str) -> list[str]:
    """The generated texts, as the page shows them (HTML-escaped)."""
    return re.findall(r'<pre class="mono sample-text">(.*?)</pre>', html, flags=re.DOTALL)


def _escape(text: str) -> str:
    from django.utils.html import escape

    return str(escape(text))


@pytest.mark.timeout(150)
@pytest.mark.django_db(transaction=True)
def test_it_shows_eval_results_and_samples_from_a_finished_rl_job(
    trainer: Any,  # noqa: F811
    addition_dataset: str,  # noqa: F811
    owner_client: APIClient,
    login: Callable[[Any], Client],
    owner: Any,
    outsider: Any,
    other_team: Team,
    clean_tinker_keys: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sdk_worker_env(monkeypatch)
    worker = trainer()
    spec = rl_spec(
        addition_dataset,
        steps=2,
        eval_every=1,
        eval_examples=4,
        checkpoint_every=2,
        rollout={"group_size": 2, "prompts_per_step": 2, "max_tokens": 16},
    )
    job_id = submit(owner_client, spec, name="web-evals")
    job = finished(job_id, 110)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])

    client = login(owner)
    url = reverse("web:job_detail", args=[job_id])
    page = client.get(url)
    assert page.status_code == 200
    html = page.content.decode()

    # Eval table: one row per evaluated step with the logged values and its transcript.
    evals = page.context["evals"]
    assert evals["columns"][:3] == ["accuracy", "reward", "episodes"]
    assert "seconds" not in evals["columns"]
    assert [r["step"] for r in evals["rows"]] == [0, 1, 2]
    rows = JobMetric.objects.filter(job_id=job_id, name__startswith="eval/")
    logged = {(m.step, m.name): m.value for m in rows}
    for row in evals["rows"]:
        for column, value in zip(evals["columns"], row["values"], strict=True):
            assert value == logged[(row["step"], f"eval/{column}")]
        name = f"eval/step-{row['step']:06d}.jsonl"
        assert row["transcript"]["name"] == name
        assert f'href="/api/v1/jobs/{job_id}/artifacts/{name}"' in html
    acc = logged[(2, "eval/accuracy")]
    assert f"{acc:.3f}" in html
    # The link downloads with the browser's session: 4 episodes, as evaluated.
    download = client.get(f"/api/v1/jobs/{job_id}/artifacts/eval/step-000002.jsonl")
    assert download.status_code == 200
    lines = b"".join(download.streaming_content).splitlines()
    assert len(lines) == logged[(2, "eval/episodes")] == 4
    assert all("reward" in json.loads(line) for line in lines)

    # The sample box is offered; htmx gets the box back, as the API would answer.
    assert page.context["can_sample"] and 'id="sample-box"' in html
    # A text-only base model: no picture field, no picture in the snippet.
    assert 'name="image"' not in html and 'id="use-model-image"' not in html
    sample_url = reverse("web:job_sample", args=[job_id])
    params = {
        "prompt": "12+34=",
        "mode": "raw",
        "max_tokens": "8",
        "temperature": "1.0",
        "n": "3",
        "seed": "7",
    }
    fragment = client.post(sample_url, params, **HTMX)
    assert fragment.status_code == 200
    body = fragment.content.decode()
    assert body.lstrip().startswith('<section id="sample-box"') and "<html" not in body
    api = owner_client.post(
        f"/api/v1/jobs/{job_id}/sample",
        {"prompt": "12+34=", "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7},
        format="json",
    )
    assert api.status_code == 200, api.content
    expected = [_escape(s["text"]) for s in api.json()["samples"]]
    assert _samples(body) == expected and len(expected) == 3
    assert "3 samples" in body

    # Without JavaScript: a plain form post with the page's CSRF token gets the whole page.
    # Chat mode sends the prompt as one user message, as the API's `messages` does.
    chat = {"prompt": "What is 76+24?", "mode": "chat", "max_tokens": "16", "temperature": "0"}
    chat |= {"n": "2"}
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(owner)
    assert strict.post(sample_url, chat).status_code == 403
    page_html = strict.get(url).content.decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page_html)
    assert token
    full = strict.post(sample_url, chat | {"csrfmiddlewaretoken": token.group(1)})
    assert full.status_code == 200
    full_html = full.content.decode()
    assert "<html" in full_html and 'id="eval-results"' in full_html
    api_chat = owner_client.post(
        f"/api/v1/jobs/{job_id}/sample",
        {
            "messages": [{"role": "user", "content": "What is 76+24?"}],
            "max_tokens": 16,
            "temperature": 0.0,
            "n": 2,
        },
        format="json",
    ).json()["samples"]
    assert _samples(full_html) == [_escape(s["text"]) for s in api_chat]

    # Bad parameters come back beside their fields, with nothing generated.
    bad = client.post(sample_url, params | {"n": "9"})
    assert bad.status_code == 400
    assert "n" in bad.context["sample_form"].errors and _samples(bad.content.decode()) == []
    too_long = client.post(sample_url, chat | {"prompt": "1" * 5000, "max_tokens": "256"})
    assert too_long.status_code == 400
    # The model worker measured the prompt with the base model's tokenizer.
    assert "maximum context length is 1024" in too_long.context["sample_form"].errors["prompt"][0]
    assert 'id="id_prompt_errors"' in too_long.content.decode()
    in_box = client.post(sample_url, params | {"temperature": "-1"}, **HTMX)
    assert in_box.status_code == 200 and 'id="id_temperature_errors"' in in_box.content.decode()

    # Another team's member cannot see the page nor sample from the adapter.
    outsider_web = login(outsider)
    assert outsider_web.get(url).status_code == 404
    assert outsider_web.post(sample_url, params).status_code == 404
    assert outsider_web.post(sample_url, params, **HTMX).status_code == 404


@pytest.mark.django_db
def test_it_says_clearly_when_a_job_has_no_adapter_to_sample(
    login: Callable[[Any], Client],
    submit: Callable[..., Any],
    data_dir: Any,
    team: Team,
    owner: Any,
    outsider: Any,
    other_team: Team,
) -> None:
    job = submit(team, owner, name="queued-smoke")
    client = login(owner)
    page = client.get(reverse("web:job_detail", args=[job.pk]))
    assert not page.context["can_sample"]
    html = page.content.decode()
    assert "Sampling opens when the job has finished" in html
    assert 'name="prompt"' not in html
    assert "No evaluations yet" in html

    sample_url = reverse("web:job_sample", args=[job.pk])
    params = {"prompt": "1+1=", "max_tokens": "4", "temperature": "0", "n": "1"}
    refused = client.post(sample_url, params)
    assert refused.status_code == 409
    assert "has no weights to sample from yet" in refused.content.decode()
    boxed = client.post(sample_url, params, HTTP_HX_REQUEST="true")
    assert boxed.status_code == 200 and 'id="sample-error"' in boxed.content.decode()
    assert client.get(sample_url).status_code == 405
    assert login(outsider).post(sample_url, params).status_code == 404


@pytest.mark.django_db
def test_it_links_an_eval_jobs_transcript_and_skips_missing_ones(
    login: Callable[[Any], Client],
    submit: Callable[..., Any],
    data_dir: Any,
    team: Team,
    owner: Any,
) -> None:
    from jobs import artifacts
    from jobs.models import Job, JobKind

    # An eval job logs once at step 0 and leaves eval/transcripts.jsonl (workers.runners.loop).
    job = submit(team, owner, name="an-eval")
    Job.objects.filter(pk=job.pk).update(kind=JobKind.EVAL, state=JobState.SUCCEEDED)
    for name, value in (("eval/reward", 0.25), ("eval/seconds", 3.0), ("eval/accuracy", 0.5)):
        JobMetric.objects.create(job=job, step=0, name=name, value=value)
    (artifacts.workdir(job.pk) / "eval").mkdir(parents=True)
    (artifacts.workdir(job.pk) / "eval" / "transcripts.jsonl").write_text('{"reward": 1}\n')
    # A training run whose step-4 transcript is gone still shows its numbers, without a link.
    train = submit(team, owner, name="a-train")
    JobMetric.objects.create(job=train, step=4, name="eval/reward", value=0.75)
    (artifacts.workdir(train.pk) / "eval").mkdir(parents=True)
    (artifacts.workdir(train.pk) / "eval" / "step-000002.jsonl").write_text('{"reward": 1}\n')

    client = login(owner)
    page = client.get(reverse("web:job_detail", args=[job.pk]))
    evals = page.context["evals"]
    assert evals["columns"] == ["accuracy", "reward"]
    assert [(r["step"], r["values"]) for r in evals["rows"]] == [(0, [0.5, 0.25])]
    assert evals["rows"][0]["transcript"]["name"] == "eval/transcripts.jsonl"
    html = page.content.decode()
    assert f'href="/api/v1/jobs/{job.pk}/artifacts/eval/transcripts.jsonl"' in html
    # A finished eval job trains nothing: no sample form, and it says why.
    assert "left no weights to sample from" in html and 'name="prompt"' not in html

    rows = client.get(reverse("web:job_detail", args=[train.pk])).context["evals"]["rows"]
    assert [(r["step"], r["values"], r["transcript"]) for r in rows] == [(4, [0.75], None)]


def _finish_with_adapter(job: Any) -> None:
    """What a finished LoRA run leaves: the job SUCCEEDED and its exported adapter's files."""
    from jobs import artifacts
    from jobs.models import Job

    Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED)
    adapter = artifacts.workdir(job.pk) / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / artifacts.ADAPTER_WEIGHTS).write_bytes(b"")


@pytest.mark.django_db
def test_it_shows_how_to_call_a_finished_jobs_policy_on_the_openai_endpoint(
    login: Callable[[Any], Client],
    submit: Callable[..., Any],
    data_dir: Any,
    team: Team,
    owner: Any,
) -> None:
    import html as html_lib

    done = submit(team, owner, name="with-adapter")
    _finish_with_adapter(done)
    queued = submit(team, owner, name="still-queued")
    client = login(owner)

    page = client.get(reverse("web:job_detail", args=[done.pk]))
    assert page.context["use_model"] == {
        "model": f"job:{done.pk}",
        "base_url": "http://testserver/v1",
    }
    text = html_lib.unescape(page.content.decode())
    assert 'id="use-model"' in text
    curl = re.search(r'<pre[^>]*id="use-model-curl"[^>]*>(.*?)</pre>', text, flags=re.DOTALL)
    assert curl
    assert curl.group(1).startswith("curl http://testserver/v1/chat/completions")
    assert f'"model": "job:{done.pk}"' in curl.group(1)
    assert "Authorization: Bearer $OTK" in curl.group(1)
    python = re.search(r'<pre[^>]*id="use-model-python"[^>]*>(.*?)</pre>', text, flags=re.DOTALL)
    assert python
    assert 'OpenAI(base_url="http://testserver/v1"' in python.group(1)
    assert f'model="job:{done.pk}"' in python.group(1)
    # The snippet is Python that parses (a template slip would show as a syntax error).
    compile(python.group(1), "snippet.py", "exec")

    # A run that trained every weight left a model instead: it is served all the same.
    from jobs import artifacts

    full = submit(team, owner, name="with-model")
    Job.objects.filter(pk=full.pk).update(state=JobState.SUCCEEDED)
    model = artifacts.workdir(full.pk) / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    full_page = client.get(reverse("web:job_detail", args=[full.pk]))
    assert full_page.context["can_sample"]
    assert full_page.context["use_model"]["model"] == f"job:{full.pk}"

    # No adapter, no snippet: nothing could answer it yet.
    waiting = client.get(reverse("web:job_detail", args=[queued.pk]))
    assert waiting.context["use_model"] is None
    assert 'id="use-model"' not in waiting.content.decode()
    # The job page's live refresh (htmx) returns the status fragment only.
    fragment = client.get(reverse("web:job_detail", args=[done.pk]), HTTP_HX_REQUEST="true")
    assert 'id="use-model"' not in fragment.content.decode()


@pytest.mark.django_db(transaction=True)
def test_it_answers_429_when_the_teams_requests_are_all_in_flight(
    login: Callable[[Any], Client],
    submit: Callable[..., Any],
    data_dir: Any,
    team: Team,
    owner: Any,
    owner_client: APIClient,
    tiny_base_model: Any,
    clean_control_plane: Any,
    settings: Any,
) -> None:
    """The sample endpoint shares the team's limit of requests in flight with /v1/ (both run on
    the model workers): with every place taken it refuses at once, queueing nothing."""
    from tinker_api import events, futures

    settings.OPENTINKER_OPENAI_TEAM_CONCURRENCY = 1
    job = submit(team, owner, name="busy")
    _finish_with_adapter(job)
    assert events.take_slot(team.pk, "req-someone-else", 1, 60)
    try:
        queued = futures.queued_samples("tiny")
        api = owner_client.post(f"/api/v1/jobs/{job.pk}/sample", {"prompt": "1+1="}, format="json")
        assert api.status_code == 429, api.content
        assert api["Retry-After"] == "1"
        assert "OPENTINKER_OPENAI_TEAM_CONCURRENCY" in api.json()["detail"]
        box = login(owner).post(
            reverse("web:job_sample", args=[job.pk]),
            {"prompt": "1+1=", "mode": "raw", "max_tokens": "4", "temperature": "0", "n": "1"},
        )
        assert box.status_code == 429
        assert "Busy, try again in a moment" in box.content.decode()
        assert futures.queued_samples("tiny") == queued
    finally:
        events.release_slot(team.pk, "req-someone-else")


@pytest.mark.django_db(transaction=True)
def test_it_refuses_samples_once_the_teams_gpu_hours_are_spent(
    login: Callable[[Any], Client],
    submit: Callable[..., Any],
    data_dir: Any,
    team: Team,
    owner: Any,
    owner_client: APIClient,
    tiny_base_model: Any,
    clean_control_plane: Any,
) -> None:
    """The model workers' time on the team's requests counts against its month: once spent,
    the sample endpoint and the box refuse (403, naming the quota), queueing nothing."""
    from jobs.charge_services import charge_serving
    from tinker_api import futures

    team.quota.gpu_hours_per_month = 0.01
    team.quota.save()
    job = submit(team, owner, name="spent")
    _finish_with_adapter(job)
    charge_serving("tiny", {team.pk: 60.0}, {team.pk: 3})
    queued = futures.queued_samples("tiny")
    api = owner_client.post(f"/api/v1/jobs/{job.pk}/sample", {"prompt": "1+1="}, format="json")
    assert api.status_code == 403, api.content
    assert api.json()["quota"] == "gpu_hours_per_month" and api.json()["limit"] == 0.01
    assert "used 0.02 of its 0.01 GPU-hours this month" in api.json()["detail"]
    box = login(owner).post(
        reverse("web:job_sample", args=[job.pk]),
        {"prompt": "1+1=", "mode": "raw", "max_tokens": "4", "temperature": "0", "n": "1"},
    )
    assert box.status_code == 403
    assert "Cannot sample: the team has used 0.02 of its 0.01 GPU-hours" in box.content.decode()
    assert futures.queued_samples("tiny") == queued


@pytest.mark.django_db(transaction=True)
def test_it_tells_a_rate_limited_client_the_real_wait(
    submit: Callable[..., Any],
    data_dir: Any,
    team: Team,
    owner: Any,
    owner_client: APIClient,
    tiny_base_model: Any,
    clean_control_plane: Any,
    clean_tinker_keys: None,  # noqa: F811
) -> None:
    """A team over its requests per minute waits until the minute ends: Retry-After says so in
    whole seconds (rounded up), as the message does, instead of a fixed 1 s."""
    import time

    from tinker_api import events

    team.quota.openai_requests_per_minute = 1
    team.quota.save()
    job = submit(team, owner, name="rate-limited")
    _finish_with_adapter(job)
    _ok, _requests, _tokens, left = events.take_rate(team.pk, 1, 0)
    if left < 5:  # the minute would end before the request: use up the next one instead
        time.sleep(left + 0.1)
        events.take_rate(team.pk, 1, 0)
    api = owner_client.post(f"/api/v1/jobs/{job.pk}/sample", {"prompt": "1+1="}, format="json")
    assert api.status_code == 429, api.content
    said = re.search(r"retry in (\d+) s", api.json()["detail"])
    assert said is not None, api.json()
    # The message rounds the wait to the nearest second, the header up.
    assert int(api["Retry-After"]) in (int(said.group(1)), int(said.group(1)) + 1)
    assert int(api["Retry-After"]) > 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "1+1=", "foo": 1}, "foo"),
        ({"prompt": "1+1=", "max_token": 4}, "max_token"),
        ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages"),
    ],
)
def test_it_refuses_sample_fields_it_does_not_know(
    submit: Callable[..., Any],
    data_dir: Any,
    team: Team,
    owner: Any,
    owner_client: APIClient,
    body: dict[str, Any],
    field: str,
) -> None:
    job = submit(team, owner, name="typo")
    _finish_with_adapter(job)
    api = owner_client.post(f"/api/v1/jobs/{job.pk}/sample", body, format="json")
    assert api.status_code == 400, api.content
    assert "unknown field" in json.dumps(api.json()[field])


@pytest.mark.django_db(transaction=True)
def test_it_answers_503_when_no_model_worker_answers(
    login: Callable[[Any], Client],
    submit: Callable[..., Any],
    data_dir: Any,
    team: Team,
    owner: Any,
    owner_client: APIClient,
    tiny_base_model: Any,
    clean_control_plane: Any,
    clean_tinker_keys: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No node has announced a GPU block, so no model worker can start: the request waits for
    one as long as the service allows (shortened here), then says so, and is cancelled so
    that a worker starting later does not generate it."""
    from tinker_api import events, futures
    from tinker_api.services import job_samples

    monkeypatch.setattr(job_samples, "SILENCE_SECONDS", 1.5)
    job = submit(team, owner, name="nobody-serves")
    _finish_with_adapter(job)
    api = owner_client.post(f"/api/v1/jobs/{job.pk}/sample", {"prompt": "1+1="}, format="json")
    assert api.status_code == 503, api.content
    assert api.json() == {"detail": "no model worker answered in time"}
    box = login(owner).post(
        reverse("web:job_sample", args=[job.pk]),
        {"prompt": "1+1=", "mode": "raw", "max_tokens": "4", "temperature": "0", "n": "1"},
    )
    assert box.status_code == 503
    assert "No model worker answered" in box.content.decode()
    # Both requests still sit in the base model's stream, cancelled for the worker to skip,
    # and neither holds a place of the team's any more.
    entries = clean_control_plane.xrange(futures.stream_key("tiny"))
    rids = [json.loads(fields[b"op"])["rid"] for _ident, fields in entries]
    assert len(rids) == 2 and events.cancelled(rids) == set(rids)
    assert events.take_slot(team.pk, "req-probe", 1, 5)
    events.release_slot(team.pk, "req-probe")


def test_it_refuses_a_picture_the_base_model_cannot_see_or_that_is_no_picture(
    submit: Callable[..., Any],
    data_dir: Any,
    team: Team,
    owner: Any,
    owner_client: APIClient,
    login: Callable[[Any], Client],
) -> None:
    import base64

    from django.core.files.uploadedfile import SimpleUploadedFile

    job = submit(team, owner, name="text-only")
    _finish_with_adapter(job)
    png = b"\x89PNG\r\n\x1a\n" + b"0" * 32
    chat = [{"role": "user", "content": "what is this?"}]
    url = f"/api/v1/jobs/{job.pk}/sample"
    for body, field, words in (
        ({"messages": chat, "image": base64.b64encode(png).decode()}, "image", "takes no images"),
        ({"prompt": "x", "image": base64.b64encode(png).decode()}, "image", "goes with a chat"),
        ({"messages": chat, "image": base64.b64encode(b"GIF89a").decode()}, "image", "PNG or JPEG"),
        ({"messages": chat, "image": "data:text/plain;base64,aGk="}, "image", "data:image/"),
        ({"messages": chat, "image": "@@"}, "image", "base64"),
    ):
        api = owner_client.post(url, body, format="json")
        assert api.status_code == 400, api.content
        assert words in json.dumps(api.json()[field]), api.json()
    page = login(owner)
    assert 'name="image"' not in page.get(reverse("web:job_detail", args=[job.pk])).content.decode()
    box = page.post(
        reverse("web:job_sample", args=[job.pk]),
        {
            "prompt": "hi",
            "mode": "raw",
            "max_tokens": "4",
            "temperature": "1",
            "n": "1",
            "image": SimpleUploadedFile("a.png", png, content_type="image/png"),
        },
    )
    assert box.status_code == 400
    assert "takes no pictures" in box.content.decode()
