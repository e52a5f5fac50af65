"""The pages in a real browser: Playwright driving Debian's Chromium against ``live_server``,
with a real Celery worker running smoke jobs.

One scenario walks a new user through sign-up and verification, an API key, a job submitted
from the form that is watched to RUNNING and SUCCEEDED with its chart drawn, a cancelled job,
and a second user who cannot open the first user's job. Screenshots of the main pages go to
``$OPENTINKER_SCREENSHOT_DIR`` when it is set (``docs/screenshots`` for the README).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core import mail

CHROMIUM = Path(os.environ.get("OPENTINKER_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]
PASSWORD = "a-Long-pass-99"
# Seconds the page may take to show a state the worker reached (polling plus worker start).
STATE_TIMEOUT_MS = 60_000

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} is absent: run scripts/install_browser.sh (apt-get install chromium)",
    ),
    pytest.mark.timeout(240),
]


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    # Playwright's sync API keeps an event loop in this thread; the ORM calls made by the test
    # itself are still synchronous and safe.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield browser
        browser.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = os.environ.get("OPENTINKER_SCREENSHOT_DIR")
    path = Path(target) if target else tmp_path / "screenshots"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _sign_up(page: Any, base: str, username: str, email: str) -> None:
    page.goto(f"{base}/accounts/signup/")
    page.get_by_label("Email").fill(email)
    page.get_by_label("Username").fill(username)
    page.locator("#id_password1").fill(PASSWORD)
    page.locator("#id_password2").fill(PASSWORD)
    page.get_by_role("button", name="Sign Up").click()
    page.wait_for_url(re.compile(r"/accounts/confirm-email/"))
    message = next(m for m in reversed(mail.outbox) if email in m.to)
    link = re.search(r"https?://[^\s]+/accounts/confirm-email/[^\s]+", message.body)
    assert link, message.body
    page.goto(link.group(0))
    page.get_by_role("button", name="Confirm").click()
    page.wait_for_url(re.compile(r"/jobs/$"))


def _chart_pixels(page: Any, metric: str) -> int:
    """Pixels of the series colour on the metric's canvas: zero when nothing was drawn."""
    return int(
        page.evaluate(
            """(metric) => {
                const fig = document.querySelector(`figure.chart[data-metric="${metric}"]`);
                const canvas = fig && fig.querySelector("canvas");
                if (!canvas) return 0;
                const hex = fig.getAttribute("data-color");
                const rgb = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
                const ctx = canvas.getContext("2d");
                const {data} = ctx.getImageData(0, 0, canvas.width, canvas.height);
                let n = 0;
                for (let i = 0; i < data.length; i += 4) {
                    if (Math.abs(data[i] - rgb[0]) < 24 && Math.abs(data[i + 1] - rgb[1]) < 24
                        && Math.abs(data[i + 2] - rgb[2]) < 24 && data[i + 3] > 200) n++;
                }
                return n;
            }""",
            metric,
        )
    )


def _sign_in(context: Any, base: str, username: str) -> Any:
    page = context.new_page()
    page.goto(f"{base}/accounts/login/")
    page.locator("#id_login").fill(username)
    page.locator("#id_password").fill(PASSWORD)
    page.get_by_role("button", name="Sign In").click()
    page.wait_for_url(re.compile(r"/jobs/$"))
    return page


def test_it_signs_up_submits_watches_cancels_and_isolates_in_a_browser(
    browser: Any,
    live_server: Any,
    celery_worker: Any,
    tiny_base_model: Any,
    settings: Any,
    shots: Path,
    django_user_model: Any,
) -> None:
    from accounts.models import ApiKey, Team
    from jobs.models import Job, JobState

    settings.OPENTINKER_WEB_LIVE_SECONDS = 1
    base = live_server.url
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
    page = context.new_page()
    js_errors: list[str] = []
    page.on("pageerror", lambda exc: js_errors.append(str(exc)))

    page.goto(f"{base}/accounts/login/")
    page.screenshot(path=str(shots / "sign-in.png"))

    # Sign up and verify: the confirmation link comes from the mail outbox.
    _sign_up(page, base, "alice", "alice@example.com")
    team = Team.objects.get(memberships__user__username="alice")

    # An API key: shown once, copied with the button, and it authenticates.
    page.get_by_role("link", name="API keys").click()
    page.get_by_label("Name").fill("laptop")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#secret-value").input_value()
    assert ApiKey.objects.for_key(secret).team == team
    page.get_by_role("button", name="Copy").click()
    page.get_by_text("Copied to the clipboard.").wait_for()
    assert page.evaluate("navigator.clipboard.readText()") == secret
    page.screenshot(path=str(shots / "api-keys.png"), full_page=True)
    page.reload()
    assert secret not in page.content()

    # A smoke job from the form, watched to RUNNING and SUCCEEDED with its chart drawn.
    page.get_by_role("link", name="New job").click()
    page.screenshot(path=str(shots / "new-job.png"), full_page=True)
    # The form follows the method (training sections appear for rl), and a refused value
    # comes back beside its field.
    assert page.get_by_role("group", name="LoRA").is_hidden()
    page.get_by_label("Method").select_option("rl")
    page.get_by_label("Environment").select_option("math")
    page.get_by_label("Dataset", exact=True).select_option("builtin:arith_train")
    page.get_by_label("Rank").fill("999")
    page.get_by_role("button", name="Submit job").click()
    page.locator("#id_lora__rank_errors", has_text="max_lora_rank").wait_for()
    page.locator("#id_lora__rank_errors").scroll_into_view_if_needed()
    page.screenshot(path=str(shots / "new-job-errors.png"))
    page.get_by_role("link", name="New job").click()
    page.get_by_label("Name", exact=True).fill("browser-smoke")
    page.get_by_label("Smoke steps").fill("8")
    page.get_by_label("Smoke step seconds").fill("0.6")
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url(re.compile(r"/jobs/[0-9a-f-]{36}/$"))
    job = Job.objects.get(name="browser-smoke")
    assert job.team == team
    page.locator("#job-state", has_text="Running").wait_for(timeout=STATE_TIMEOUT_MS)
    page.locator("#job-state", has_text="Succeeded").wait_for(timeout=STATE_TIMEOUT_MS)
    page.locator("#charts[data-done=true]").wait_for(timeout=15_000)
    points = page.locator('figure.chart[data-metric="eigenvalue_error"]').get_attribute(
        "data-points"
    )
    assert points == "8"
    drawn = page.evaluate(
        """() => Object.fromEntries(Object.entries(window.openTinkerCharts).map(
            ([name, c]) => [name,
                [c.plot.data[0].length, c.plot.scales.x.min, c.plot.scales.x.max]]))"""
    )
    assert all(v[0] == 8 and v[1] == 1 and v[2] == 8 for v in drawn.values()), (drawn, js_errors)
    assert not js_errors
    assert _chart_pixels(page, "eigenvalue_error") > 50
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    # job-detail.png (eval results, samples) comes from the RL job of test_browser_sample.
    page.screenshot(path=str(shots / "job-detail-smoke.png"), full_page=True)

    # A long job from YAML, cancelled through the confirmation page while it runs.
    page.goto(f"{base}/jobs/new/yaml/")
    page.get_by_label("Name").fill("browser-long")
    page.get_by_label("Job spec (YAML or JSON)").fill(
        "method: smoke\nsmoke_steps: 200\nsmoke_step_seconds: 0.5\n"
    )
    page.get_by_role("button", name="Submit job").click()
    page.locator("#job-state", has_text="Running").wait_for(timeout=STATE_TIMEOUT_MS)
    page.get_by_role("link", name="Cancel job…").click()
    page.get_by_role("button", name="Yes, cancel the job").click()
    page.locator("#job-state", has_text="Cancelled").wait_for(timeout=STATE_TIMEOUT_MS)
    long_job = Job.objects.get(name="browser-long")
    assert long_job.state == JobState.CANCELLED

    page.goto(f"{base}/jobs/")
    page.screenshot(path=str(shots / "jobs.png"), full_page=True)
    page.goto(f"{base}/team/")
    page.screenshot(path=str(shots / "team.png"), full_page=True)

    # A second user, signed in elsewhere, gets 404 for the first user's job.
    bob = django_user_model.objects.create_user("bob", "bob@example.com", PASSWORD)
    from allauth.account.models import EmailAddress

    EmailAddress.objects.create(user=bob, email=bob.email, verified=True, primary=True)
    other = browser.new_context(viewport={"width": 390, "height": 844})
    bob_page = _sign_in(other, base, "bob")
    response = bob_page.goto(f"{base}/jobs/{job.pk}/")
    assert response is not None and response.status == 404
    assert "browser-smoke" not in bob_page.content()
    metrics = bob_page.goto(f"{base}/jobs/{job.pk}/metrics.json")
    assert metrics is not None and metrics.status == 404
    other.close()

    # A narrow screen and the staff pool page, for the README.
    staff = django_user_model.objects.create_user(
        "root", "root@example.com", PASSWORD, is_staff=True
    )
    EmailAddress.objects.create(user=staff, email=staff.email, verified=True, primary=True)
    from accounts.models import Membership

    Membership.objects.create(user=staff, team=team, role="member")
    phone = browser.new_context(viewport={"width": 390, "height": 844})
    phone_page = _sign_in(phone, base, "root")
    phone_page.screenshot(path=str(shots / "jobs-narrow.png"), full_page=True)
    scroll_width = phone_page.evaluate("document.documentElement.scrollWidth")
    assert scroll_width <= 390, f"the jobs page scrolls sideways on a phone ({scroll_width}px)"
    phone.close()
    staff_ctx = browser.new_context(viewport={"width": 1280, "height": 800})
    staff_page = _sign_in(staff_ctx, base, "root")
    staff_page.goto(f"{base}/pool/")
    staff_page.locator('[data-node="testnode"]').wait_for()
    staff_page.screenshot(path=str(shots / "gpu-pool.png"), full_page=True)
    staff_ctx.close()
    context.close()
