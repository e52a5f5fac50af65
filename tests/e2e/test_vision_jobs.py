"""Managed jobs of a vision-language policy: RL and SFT on the `geometry` env with the tiny
vision-language model (models/tiny-vl), through the REST API and a real Celery worker.

The job renders each problem's diagram through the model's image processor, samples and
trains with the images in every forward, evaluates itself on the held-out split, leaves
transcripts whose images the web page shows, and exports an adapter that peft loads onto the
Qwen2.5-VL model.
"""

from __future__ import annotations

import base64
import io
import json
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse
from django.utils.html import escape
from rest_framework.test import APIClient

from environments import images
from jobs.models import JobState
from tests.e2e.test_managed_training import finished, series, steps_of, submit
from tests.tinker_api.conftest import clean_tinker_keys, sdk_worker_env  # noqa: F401
from training.model import TINY_VL_MODEL

BUILTIN_GEOMETRY = Path(__file__).resolve().parents[2] / "environments/data/geometry_train.jsonl"

pytestmark = [pytest.mark.timeout(300), pytest.mark.django_db(transaction=True)]


def geometry_spec(method: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "method": method,
        "base_model": "tiny-vl",
        "env": "geometry",
        "dataset": "builtin:geometry_train",
        "seed": 2,
        "lora": {"rank": 8, "alpha": 16},
        "checkpoint_every": 0,
    }
    spec.update(overrides)
    return spec


def test_it_trains_a_vision_policy_with_rl_and_shows_its_transcripts_with_images(
    vl_trainer: Any,
    owner_client: APIClient,
    owner: Any,
    owner_key: tuple[Any, str],
    clean_tinker_keys: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sdk_worker_env(monkeypatch)
    worker = vl_trainer()
    spec = geometry_spec(
        "rl",
        steps=2,
        rollout={"group_size": 4, "prompts_per_step": 4, "max_tokens": 12},
        optimizer={"lr": 1e-3},
        eval_every=2,
        eval_examples=8,
    )
    job_id = submit(owner_client, spec, "geo-rl")
    job = finished(job_id, 240)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
    metrics = series(owner_client, job_id)
    assert steps_of(metrics["reward/mean"]) == [1, 2]
    assert steps_of(metrics["eval/accuracy"]) == [0, 2]
    assert all(value > 0 for _, value in metrics["tokens_per_s"])

    artifacts = {a["name"]: a for a in owner_client.get(f"/api/v1/jobs/{job_id}/artifacts").json()}
    lines = b"".join(
        owner_client.get(artifacts["eval/step-000002.jsonl"]["download"]).streaming_content
    ).splitlines()
    assert len(lines) == 8
    first = json.loads(lines[0])["turns"][0]["observation"]
    shown = images.images_in(first)
    assert len(shown) == 1 and shown[0].startswith(b"\x89PNG")
    browser = Client()
    browser.force_login(owner)
    page = browser.get(reverse("web:job_transcript", args=[job_id, "step-000002.jsonl"]))
    assert page.status_code == 200
    assert page.content.decode().count('<img class="transcript-image"') == 8

    download = owner_client.get(artifacts["adapter"]["download"])
    adapter_dir = Path(worker.log_path).parent / "adapter"
    with zipfile.ZipFile(io.BytesIO(b"".join(download.streaming_content))) as zf:
        zf.extractall(adapter_dir)
    from peft import PeftModel

    from training.model import load_base

    base, _ = load_base(TINY_VL_MODEL)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    adapted = [n for n, p in model.named_parameters() if "lora_B" in n]
    assert adapted and not [n for n in adapted if ".visual." in n]

    # The job page offers a picture field and shows how to send one to /v1.
    detail = browser.get(reverse("web:job_detail", args=[job_id])).content.decode()
    assert 'id="use-model-image"' in detail and 'name="image"' in detail
    # The policy looked at with a picture: the sample endpoint, the page's sample box (the
    # picture uploaded) and /v1 (an image_url part after the text) answer alike, greedily.
    png, question = shown[0], images.text_of(first[-1])
    sample = owner_client.post(
        f"/api/v1/jobs/{job_id}/sample",
        {
            "messages": [{"role": "user", "content": question}],
            "image": base64.b64encode(png).decode(),
            "max_tokens": 8,
            "temperature": 0.0,
        },
        format="json",
    )
    assert sample.status_code == 200, sample.content
    (answer,) = [s["text"] for s in sample.json()["samples"]]
    boxed = browser.post(
        reverse("web:job_sample", args=[job_id]),
        {
            "prompt": question,
            "mode": "chat",
            "max_tokens": "8",
            "temperature": "0",
            "n": "1",
            "image": SimpleUploadedFile("diagram.png", png, content_type="image/png"),
        },
        HTTP_HX_REQUEST="true",
    )
    assert boxed.status_code == 200
    assert re.findall(
        r'<pre class="mono sample-text">(.*?)</pre>', boxed.content.decode(), re.S
    ) == [str(escape(answer))]
    chat = Client(HTTP_AUTHORIZATION=f"Bearer {owner_key[1]}").post(
        "/v1/chat/completions",
        json.dumps(
            {
                "model": f"job:{job_id}",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": question},
                            {"type": "image_url", "image_url": {"url": images.data_uri(png)}},
                        ],
                    }
                ],
                "max_tokens": 8,
                "temperature": 0,
            }
        ),
        content_type="application/json",
    )
    assert chat.status_code == 200, chat.content
    assert chat.json()["choices"][0]["message"]["content"] == answer
    raw = owner_client.post(
        f"/api/v1/jobs/{job_id}/sample",
        {"prompt": question, "image": base64.b64encode(png).decode()},
        format="json",
    )
    assert raw.status_code == 400 and "image" in raw.json()


def test_it_trains_a_vision_policy_with_sft_on_a_geo3k_zip_upload(
    vl_trainer: Any, owner_client: APIClient
) -> None:
    # geo3k's shape as a zip: sixteen rows in a JSONL file, each naming its diagram, a file
    # beside it; a batch of sixteen sees the same pictures every step, so the loss must fall.
    rows = [json.loads(line) for line in BUILTIN_GEOMETRY.read_text().splitlines()[:16]]
    members = {}
    for i, row in enumerate(rows):
        members[f"geo3k/img/{i}.png"] = base64.b64decode(row["images"][0])
        row["images"] = [f"img/{i}.png"]
    members["geo3k/train.jsonl"] = "".join(json.dumps(r) + "\n" for r in rows).encode()
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    response = owner_client.post(
        "/api/v1/datasets",
        {
            "file": SimpleUploadedFile("geo3k.zip", archive.getvalue()),
            "name": "geo16",
            "env": "geometry",
        },
        format="multipart",
    )
    assert response.status_code == 201, response.content
    worker = vl_trainer()
    spec = geometry_spec(
        "sft",
        dataset=str(response.json()["id"]),
        steps=8,
        batch_size=16,
        optimizer={"lr": 2e-3},
        # Recomputed activations give the same gradients (tests/training/test_recompute.py).
        activation_checkpointing=True,
    )
    job_id = submit(owner_client, spec, "geo-sft")
    job = finished(job_id, 240)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
    loss = series(owner_client, job_id)["loss"]
    assert steps_of(loss) == list(range(1, 9))
    assert loss[-1][1] < 0.8 * loss[0][1], loss


def test_it_refuses_an_image_env_on_a_text_only_base_model(
    vl_trainer: Any, owner_client: APIClient
) -> None:
    spec = geometry_spec("rl", base_model="tiny", steps=1)
    response = owner_client.post("/api/v1/jobs", {"name": "x", "spec": spec}, format="json")
    assert response.status_code == 400
    body = json.dumps(response.json())
    assert "base_model" in body and "text-only" in body and "tiny-vl" in body
