"""The jobs list and the two ways to submit a job (the form and a YAML spec), and cancel."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.utils.cache import patch_vary_headers

from accounts.models import Team
from jobs import datasets as dataset_store
from jobs import services
from jobs.models import FINAL_STATES, Dataset, Job, JobState
from web import actions
from web.forms import UPLOAD, JobFilterForm, JobForm, YamlJobForm
from web.spec_form import SEP
from web.teams import current_team, page_team

from .common import no_team, team_job, usage_bars


def _filtered_jobs(filters: JobFilterForm, team: Team) -> QuerySet[Job]:
    jobs = Job.objects.filter(team=team).select_related("created_by").order_by("-created")
    if not filters.is_valid():
        # A filter that cannot be applied lists nothing rather than every job unfiltered.
        return jobs.none()
    state = filters.cleaned_data["state"]
    if state == JobFilterForm.ACTIVE:
        jobs = jobs.exclude(state__in=FINAL_STATES)
    elif state:
        jobs = jobs.filter(state=state)
    q = filters.cleaned_data["q"]
    if q:
        jobs = jobs.filter(
            Q(name__icontains=q)
            | Q(created_by__username__icontains=q)
            | Q(spec__base_model__icontains=q)
            | Q(spec__env__icontains=q)
        )
    return jobs


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    team = current_team(request)
    if team is None:
        return no_team(request)
    filters = JobFilterForm(request.GET)
    page = Paginator(_filtered_jobs(filters, team), 25).get_page(request.GET.get("page"))
    live = any(j.state not in FINAL_STATES for j in page.object_list)
    context = {
        "page": page,
        "jobs": page.object_list,
        "live": live,
        "live_interval": settings.OPENTINKER_WEB_LIVE_SECONDS,
        "filters": filters,
        "states": JobState.choices,
        "state": request.GET.get("state", ""),
        "q": request.GET.get("q", ""),
        "query": request.GET.urlencode(),
        "now": timezone.now(),
    }
    status = 200 if filters.is_valid() else 400
    if request.htmx:  # type: ignore[attr-defined]
        response = render(request, "web/_job_rows.html", context, status=status)
    else:
        context["usage"] = usage_bars(team)
        response = render(request, "web/job_list.html", context, status=status)
    # The same URL answers a fragment to htmx: caches must tell the two apart.
    patch_vary_headers(response, ["HX-Request"])
    return response


@login_required
def job_new(request: HttpRequest) -> HttpResponse:
    team = page_team(request)
    if team is None:
        return no_team(request)
    form = JobForm(request.POST or None, request.FILES or None, team=team)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        errors: dict[str, str] = {}
        spec = form.spec_fields.to_spec(data, errors)
        spec["method"] = data["method"]
        if data["base_model"] != form.spec_fields.defaults.get("base_model"):
            spec["base_model"] = data["base_model"]
        if data.get("env"):
            spec["env"] = data["env"]
        uploaded: Dataset | None = None
        if data.get("dataset") == UPLOAD and not errors:
            try:
                uploaded = dataset_store.store_dataset(
                    team=team,
                    user=request.user,
                    name=data["dataset_name"],
                    env=data["env"],
                    filename=data["dataset_file"].name,
                    chunks=data["dataset_file"].chunks(),
                )
            except dataset_store.DatasetRejected as exc:
                # A taken name is the name field's to fix (an earlier submission that was
                # refused may have stored the file under it already); the rest, the file's.
                taken = any(e.get("field") == "name" for e in exc.errors)
                form.add_error("dataset_name" if taken else "dataset_file", str(exc))
            else:
                spec["dataset"] = uploaded.ref
        elif data.get("dataset"):
            spec["dataset"] = data["dataset"]
        for key, reason in errors.items():
            form.add_error(key, reason)
        if form.is_valid():
            job, spec_errors = actions.submit(team, request.user, spec, data.get("name", ""))
            if job is not None:
                messages.success(request, f"Job {job.name} submitted.")
                return redirect("web:job_detail", job_id=job.pk)
            _attach_errors(form, spec_errors)
            if uploaded is not None:
                messages.info(request, f"Dataset {uploaded.name} was stored; pick it next time.")
    return render(request, "web/job_new.html", {"form": form, "yaml_form": YamlJobForm()})


def _attach_errors(form: Any, errors: list[dict[str, str]]) -> None:
    """Put each spec error beside its field; errors of unknown fields go on top."""
    for err in errors:
        key = (err.get("field") or "").replace(".", SEP)
        if key and key in form.fields:
            form.add_error(key, err["reason"])
        else:
            label = f"{err['field']}: " if err.get("field") else ""
            form.add_error(None, f"{label}{err['reason']}")


@login_required
def job_new_yaml(request: HttpRequest) -> HttpResponse:
    team = page_team(request)
    if team is None:
        return no_team(request)
    form = YamlJobForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        job, errors = actions.submit(
            team, request.user, form.cleaned_data["spec"], form.cleaned_data["name"]
        )
        if job is not None:
            messages.success(request, f"Job {job.name} submitted.")
            return redirect("web:job_detail", job_id=job.pk)
        for err in errors:
            where = f"{err['field']}: " if err.get("field") else ""
            form.add_error("spec_yaml", f"{where}{err['reason']}")
    return render(request, "web/job_new_yaml.html", {"yaml_form": form})


@login_required
def job_cancel(request: HttpRequest, job_id: Any) -> HttpResponse:
    """GET asks for confirmation (works without JavaScript); POST cancels."""
    job = team_job(request, job_id)
    if request.method == "POST":
        try:
            services.cancel_job(job, by=request.user)
        except services.IllegalTransition as exc:
            messages.error(request, f"Cannot cancel: {exc}.")
        else:
            messages.success(request, f"Cancel of {job.name} requested.")
        return redirect("web:job_detail", job_id=job.pk)
    # A link to this page outlives the job's run (an old tab, a shared link): asking
    # "cancel?" about a job that has ended, or is already stopping, would mislead.
    if job.is_final:
        messages.info(
            request,
            f"Job {job.name} has already ended ({job.get_state_display()}): "
            "there is nothing to cancel.",
        )
        return redirect("web:job_detail", job_id=job.pk)
    if job.cancel_requested:
        messages.info(request, f"Cancel of {job.name} was already requested.")
        return redirect("web:job_detail", job_id=job.pk)
    return render(request, "web/job_cancel.html", {"job": job})
