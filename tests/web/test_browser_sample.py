"""The job page of a real finished RL job in a real browser: eval results and the sample box.

A short RL job on the tiny model runs on a real Celery worker; Chromium (Playwright) opens its
page, reads the eval table, generates from the adapter through the htmx sample box (the page
is not reloaded: only the box is swapped; the tiny model's model worker, started by the same
Celery worker, answers), reads the "Use this model" snippet and saves ``job-detail.png`` for
the README when ``$OPENTINKER_SCREENSHOT_DIR`` is set.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.test import Client
from rest_framework.test import APIClient

from jobs.models import JobMetric, JobState
from tests.e2e.conftest import (  # noqa: F401  (fixtures)
    addition_dataset,
    shared_data_dir,
    tiny_model_dir,
    trainer,
)
from tests.e2e.test_managed_training import finished, rl_spec, submit
from tests.tinker_api.conftest import clean_tinker_keys, sdk_worker_env  # noqa: F401
from tests.web.test_browser import CHROMIUM, browser, shots  # noqa: F401  (fixtures)

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} is absent: run scripts/install_browser.sh (apt-get install chromium)",
    ),
    pytest.mark.timeout(180),
]


def test_it_shows_eval_results_and_samples_with_htmx_in_a_browser(
    browser: Any,  # noqa: F811
    shots: Path,  # noqa: F811
    live_server: Any,
    trainer: Any,  # noqa: F811
    addition_dataset: str,  # noqa: F811
    owner_client: APIClient,
    login: Callable[[Any], Client],
    owner: Any,
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
    job_id = submit(owner_client, spec, name="browser-rl")
    job = finished(job_id, 110)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])

    # The session of a signed-in owner, handed to the browser.
    session = login(owner).cookies[django_settings.SESSION_COOKIE_NAME].value
    base = live_server.url
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_cookies(
        [{"name": django_settings.SESSION_COOKIE_NAME, "value": session, "url": base}]
    )
    page = context.new_page()
    js_errors: list[str] = []
    page.on("pageerror", lambda exc: js_errors.append(str(exc)))
    page.goto(f"{base}/jobs/{job_id}/")

    table = page.locator("#eval-results table")
    assert table.locator("tbody tr").count() == 3
    accuracy = JobMetric.objects.get(job_id=job_id, name="eval/accuracy", step=2).value
    last = table.locator("tbody tr").nth(2)
    assert last.locator("td").nth(0).inner_text() == "2"
    assert last.locator("td").nth(1).inner_text() == f"{accuracy:.3f}"
    assert last.get_by_role("link", name="eval/step-000002.jsonl").count() == 1
    # Its transcript page, episode by episode.
    assert last.get_by_role("link", name="view").get_attribute("href") == (
        f"/jobs/{job_id}/eval/step-000002.jsonl"
    )

    # htmx swaps the box in place: a marker set on the window survives, so no page load.
    page.evaluate("window.notReloaded = true")
    page.locator("#id_prompt").fill("What is 76+24?")
    page.get_by_label("Prompt as").select_option("chat")
    page.get_by_label("Max tokens").fill("16")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Samples").fill("2")
    page.get_by_role("button", name="Generate").click()
    page.locator("#samples-h", has_text="2 samples").wait_for(timeout=30_000)
    assert page.evaluate("window.notReloaded === true")
    texts = page.locator(".sample-text").all_inner_texts()
    api = owner_client.post(
        f"/api/v1/jobs/{job_id}/sample",
        {
            "messages": [{"role": "user", "content": "What is 76+24?"}],
            "max_tokens": 16,
            "temperature": 0.0,
            "n": 2,
        },
        format="json",
    ).json()["samples"]
    # inner_text drops trailing whitespace the way a browser renders it.
    assert [t.rstrip() for t in texts] == [s["text"].rstrip() for s in api]
    # How to call this policy elsewhere: its job:<id> name on this server's OpenAI endpoint.
    snippet = page.locator("#use-model-python").inner_text()
    assert f'base_url="{base}/v1"' in snippet and f'model="job:{job_id}"' in snippet
    assert f"curl {base}/v1/chat/completions" in page.locator("#use-model-curl").inner_text()
    assert not js_errors, js_errors
    page.screenshot(path=str(shots / "job-detail.png"), full_page=True)
    context.close()
