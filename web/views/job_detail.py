"""One job's page: its timeline, events, charts, checkpoints, evaluations and sample box."""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_POST

from jobs import artifacts, sampling
from jobs.models import FINAL_STATES, BaseModel, Job, JobEvent, JobKind, JobMetric, JobState
from jobs.quotas import BudgetSpent
from web.forms import SampleForm

from .common import team_job

# Metric names drawn first on the job page, in this order, when a job logs them.
PREFERRED_METRICS = ("reward", "accuracy", "loss", "kl")
MAX_CHARTS = 8
# The runner logs its evaluations as metrics named "eval/<what>" (workers.runners.evaluation);
# columns of the eval table in this order, then any other eval metric except the timing.
EVAL_PREFIX = "eval/"
EVAL_COLUMNS = ("accuracy", "reward", "episodes")
EVAL_HIDDEN = {"seconds"}


def _timeline(job: Job) -> list[dict[str, Any]]:
    """The states the job went through, with when; states still ahead are listed as pending."""
    reached: dict[str, Any] = {}
    for ev in job.events.filter(kind=JobEvent.Kind.STATE).order_by("created", "id"):
        reached[ev.to_state] = ev.created
    path = [JobState.QUEUED, JobState.STARTING, JobState.RUNNING]
    final = job.state if job.state in FINAL_STATES else JobState.SUCCEEDED
    steps = []
    for state in [*path, final]:
        steps.append(
            {
                "state": state,
                "label": JobState(state).label,
                "at": reached.get(state),
                "done": state in reached,
                "current": state == job.state,
            }
        )
    return steps


def _metric_names(job: Job) -> list[str]:
    names = list(
        JobMetric.objects.filter(job=job).values_list("name", flat=True).distinct().order_by("name")
    )

    def rank(name: str) -> tuple[int, str]:
        low = name.lower()
        for i, word in enumerate(PREFERRED_METRICS):
            if word in low:
                return i, name
        return len(PREFERRED_METRICS), name

    return sorted(names, key=rank)[:MAX_CHARTS]


def _artifacts(job: Job) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    base = f"/api/v1/jobs/{job.pk}"
    cps = [
        {**c, "download": f"{base}/checkpoints/{c['name']}"} for c in artifacts.checkpoints(job.pk)
    ]
    arts = [{**a, "download": f"{base}/artifacts/{a['name']}"} for a in artifacts.artifacts(job.pk)]
    return cps, arts


def _eval_results(job: Job, found: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's evaluations as ``{"columns": [...], "rows": [{step, values, transcript}]}``.

    A training run evaluates at step 0 and every ``eval_every`` steps and leaves
    ``eval/step-NNNNNN.jsonl`` beside each; an eval job logs once at step 0 and leaves
    ``eval/transcripts.jsonl``. Links point only at transcripts the artifact list holds.
    """
    by_step: dict[int, dict[str, float]] = {}
    seen: set[str] = set()
    rows = JobMetric.objects.filter(job=job, name__startswith=EVAL_PREFIX).order_by("step")
    for name, step, value in rows.values_list("name", "step", "value"):
        short = name[len(EVAL_PREFIX) :]
        if short in EVAL_HIDDEN:
            continue
        seen.add(short)
        by_step.setdefault(step, {})[short] = value
    columns = [c for c in EVAL_COLUMNS if c in seen] + sorted(seen - set(EVAL_COLUMNS))
    transcripts = {a["name"]: a for a in found if a.get("kind") == "eval"}
    out = []
    for step, values in sorted(by_step.items()):
        name = (
            "eval/transcripts.jsonl" if job.kind == JobKind.EVAL else f"eval/step-{step:06d}.jsonl"
        )
        out.append(
            {
                "step": step,
                "values": [values.get(c) for c in columns],
                "transcript": transcripts.get(name),
            }
        )
    return {"columns": columns, "rows": out}


def _sample_context(job: Job, form: SampleForm | None = None) -> dict[str, Any]:
    """What the sample box needs; it is offered once a finished job has exported its final
    weights (an adapter, or a full model)."""
    exported = job.state in FINAL_STATES and artifacts.final_policy(job.pk) is not None
    images = _takes_images(job)
    return {
        "can_sample": exported,
        "sample_form": form or SampleForm(images=images),
        "samples": None,
        "sample_error": "",
        # The picture field is offered where the base model has a vision tower.
        "sample_images": images,
    }


def _takes_images(job: Job) -> bool:
    base = BaseModel.objects.filter(name=str((job.spec or {}).get("base_model") or "")).first()
    return bool(base is not None and base.takes_images())


def _use_model(request: HttpRequest, job: Job, can_sample: bool) -> dict[str, str] | None:
    """How to call the job's policy on the OpenAI endpoint, for a job with final weights.

    The name is ``job:<id>`` (the job's own name may be shared with a later run, or with a
    base model); the base URL is this server's, as the browser reached it.
    """
    if not can_sample:
        return None
    return {"model": f"job:{job.pk}", "base_url": request.build_absolute_uri("/v1")}


def _full_page(request: HttpRequest, job: Job, box: dict[str, Any]) -> dict[str, Any]:
    context = _job_context(job)
    context["spec_json"] = json.dumps(job.spec, indent=2, sort_keys=True)
    context.update(box)
    context["use_model"] = _use_model(request, job, box["can_sample"])
    return context


def _job_context(job: Job) -> dict[str, Any]:
    events = list(job.events.order_by("-created", "-id")[:30])
    checkpoints, found = _artifacts(job)
    return {
        "job": job,
        "timeline": _timeline(job),
        "events": events,
        "live": job.state not in FINAL_STATES,
        "live_interval": settings.OPENTINKER_WEB_LIVE_SECONDS,
        "can_cancel": job.state not in FINAL_STATES and not job.cancel_requested,
        "checkpoints": checkpoints,
        "artifacts": found,
        "metric_names": _metric_names(job),
        "evals": _eval_results(job, found),
        "now": timezone.now(),
    }


@login_required
def job_detail(request: HttpRequest, job_id: Any) -> HttpResponse:
    job = team_job(request, job_id)
    context = _job_context(job)
    if request.htmx:  # type: ignore[attr-defined]
        response = render(request, "web/_job_status.html", context)
    else:
        response = render(
            request, "web/job_detail.html", _full_page(request, job, _sample_context(job))
        )
    patch_vary_headers(response, ["HX-Request"])
    return response


@login_required
@require_POST
def job_sample(request: HttpRequest, job_id: Any) -> HttpResponse:
    """Generate from a finished job's adapter with ``jobs.sampling`` (the API's service: the
    model worker of the job's base model answers, this process loads no model).

    htmx posts get only the sample box back; a plain form post (no JavaScript) gets the whole
    job page with the samples or the error in the box. Refusals answer 400 (bad parameters),
    409 (no adapter), 429 (the team's requests or the queue are full) or 503 (no model worker
    answered) to plain posts; htmx swaps only 2xx answers, so it gets 200 with the message in
    the box.
    """
    job = team_job(request, job_id)
    form = SampleForm(request.POST, request.FILES, images=_takes_images(job))
    box = _sample_context(job, form)
    status = 200
    if not box["can_sample"]:
        box["sample_error"] = (
            f"Job {job.name} has no weights to sample from yet: only a finished training "
            f"run that exported its adapter or model can be sampled "
            f"(state {job.get_state_display()})."
        )
        status = 409
    elif not form.is_valid():
        status = 400
    else:
        data = form.cleaned_data
        chat = data["mode"] == SampleForm.CHAT
        try:
            box["samples"] = sampling.sample_from_job(
                job,
                prompt=None if chat else data["prompt"],
                messages=[{"role": "user", "content": data["prompt"]}] if chat else None,
                max_tokens=data["max_tokens"],
                temperature=data["temperature"],
                n=data["n"],
                seed=data.get("seed"),
                image=data.get("image"),
            )
        except sampling.NoAdapter as exc:
            box["sample_error"] = f"Cannot sample: {exc}."
            status = 409
        except sampling.BadSampleRequest as exc:
            # The service names the chat "messages": in this form it is the prompt box.
            field = "prompt" if exc.field in ("prompt", "messages") else None
            if exc.field == "image" and box["sample_images"]:
                field = "image"
            form.add_error(field, exc.reason)
            status = 400
        except sampling.SamplerBusy as exc:
            box["sample_error"] = f"Busy, try again in a moment: {exc}."
            status = 429
        except sampling.SamplerUnavailable as exc:
            box["sample_error"] = f"No model worker answered: {exc}."
            status = 503
        except BudgetSpent as exc:
            box["sample_error"] = f"Cannot sample: {exc}."
            status = 403
    if request.htmx:  # type: ignore[attr-defined]
        response = render(request, "web/_sample.html", {"job": job, **box})
    else:
        context = _full_page(request, job, box)
        response = render(request, "web/job_detail.html", context, status=status)
    # Samples are one person's answer to one prompt: never from a cache.
    response["Cache-Control"] = "no-store"
    patch_vary_headers(response, ["HX-Request"])
    return response


@login_required
def job_metrics(request: HttpRequest, job_id: Any) -> JsonResponse:
    """``{"series": {name: [[step, value], ...]}, "final": bool}`` for the charts."""
    job = team_job(request, job_id)
    series: dict[str, list[list[float]]] = {}
    rows = JobMetric.objects.filter(job=job).order_by("name", "step")
    for name, step, value in rows.values_list("name", "step", "value"):
        series.setdefault(name, []).append([step, value])
    return JsonResponse(
        {
            "series": series,
            "order": _metric_names(job),
            "final": job.state in FINAL_STATES,
            "state": job.state,
        }
    )
