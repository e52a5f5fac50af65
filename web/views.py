"""Server-rendered pages for teams.

Every object is fetched through a queryset filtered by the current team (``_team_job`` and
friends), so a job, key or dataset of another team answers 404 exactly like a missing one.
State changes go through ``jobs.services``, ``jobs.datasets`` and ``accounts.keys``; the views
only translate their exceptions into messages beside the fields.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.core.mail import send_mail
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseForbidden, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import patch_vary_headers
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST
from redis.exceptions import RedisError

from accounts.keys import KeyRefused, issue_key, revoke_key, rotate_key
from accounts.models import ApiKey, Membership, Team
from jobs import datasets as dataset_store
from jobs import services
from jobs.models import (
    FINAL_STATES,
    BaseModel,
    Dataset,
    Job,
    JobEvent,
    JobKind,
    JobMetric,
    JobState,
)
from jobs.spec import SpecError, check_base_model_limits, parse_spec

from .forms import (
    UPLOAD,
    DatasetForm,
    InviteForm,
    JobForm,
    KeyForm,
    RoleForm,
    SampleForm,
    YamlJobForm,
)
from .models import Invitation
from .spec_form import SEP
from .teams import current_team, is_owner, set_current_team, user_teams

# Metric names drawn first on the job page, in this order, when a job logs them.
PREFERRED_METRICS = ("reward", "accuracy", "loss", "kl")
MAX_CHARTS = 8
# The runner logs its evaluations as metrics named "eval/<what>" (workers.runners.loop);
# columns of the eval table in this order, then any other eval metric except the timing.
EVAL_PREFIX = "eval/"
EVAL_COLUMNS = ("accuracy", "reward", "episodes")
EVAL_HIDDEN = {"seconds"}


def _require_team(request: HttpRequest) -> Team:
    team = current_team(request)
    if team is None:
        raise Http404("you are not a member of any team yet")
    return team


def _team_job(request: HttpRequest, job_id: Any) -> Job:
    # Any team of the user, not only the current one: a link shared inside a team works
    # whichever team is selected; a job of a foreign team answers 404 like a missing one.
    return get_object_or_404(
        Job.objects.select_related("team", "created_by"),
        pk=job_id,
        team__in=user_teams(request.user),
    )


def _no_team(request: HttpRequest) -> HttpResponse:
    return render(request, "web/no_team.html")


# --- team switcher ----------------------------------------------------------------------------


@login_required
@require_POST
def switch_team(request: HttpRequest) -> HttpResponse:
    team = user_teams(request.user).filter(slug=request.POST.get("team", "")).first()
    if team is None:
        raise Http404("no such team")
    set_current_team(request, team)
    messages.info(request, f"Now working in team {team.name}.")
    target = request.POST.get("next") or reverse("web:jobs")
    if not target.startswith("/") or target.startswith("//"):
        target = reverse("web:jobs")
    return redirect(target)


# --- jobs -------------------------------------------------------------------------------------


def _filtered_jobs(request: HttpRequest, team: Team) -> QuerySet[Job]:
    jobs = Job.objects.filter(team=team).select_related("created_by").order_by("-created")
    state = request.GET.get("state", "")
    if state == "active":
        jobs = jobs.exclude(state__in=FINAL_STATES)
    elif state in JobState.values:
        jobs = jobs.filter(state=state)
    q = request.GET.get("q", "").strip()
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
        return _no_team(request)
    page = Paginator(_filtered_jobs(request, team), 25).get_page(request.GET.get("page"))
    live = any(j.state not in FINAL_STATES for j in page.object_list)
    context = {
        "page": page,
        "jobs": page.object_list,
        "live": live,
        "live_interval": settings.OPENTINKER_WEB_LIVE_SECONDS,
        "states": JobState.choices,
        "state": request.GET.get("state", ""),
        "q": request.GET.get("q", ""),
        "query": request.GET.urlencode(),
        "now": timezone.now(),
    }
    if request.htmx:  # type: ignore[attr-defined]
        response = render(request, "web/_job_rows.html", context)
    else:
        context["usage"] = _usage(team)
        response = render(request, "web/job_list.html", context)
    # The same URL answers a fragment to htmx: caches must tell the two apart.
    patch_vary_headers(response, ["HX-Request"])
    return response


def _submit(
    request: HttpRequest, team: Team, spec: dict[str, Any], name: str
) -> tuple[Job | None, list[dict[str, str]]]:
    """Submit through the services; errors come back as ``[{field, reason}]``."""
    try:
        parsed = parse_spec(spec)
        model = BaseModel.objects.filter(name=parsed.base_model).first()
        if model is not None:
            limits = check_base_model_limits(
                parsed, max_lora_rank=model.max_lora_rank, max_context=model.max_context
            )
            if limits:
                raise SpecError(limits)
        job = services.submit_job(team=team, user=request.user, spec=spec, name=name)
    except SpecError as exc:
        return None, exc.errors
    except services.GpuRequestTooLarge as exc:
        return None, [{"field": "gpus", "reason": str(exc)}]
    except services.QuotaExceeded as exc:
        return None, [{"field": "", "reason": str(exc)}]
    return job, []


@login_required
def job_new(request: HttpRequest) -> HttpResponse:
    team = current_team(request)
    if team is None:
        return _no_team(request)
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
                form.add_error("dataset_file", str(exc))
            else:
                spec["dataset"] = uploaded.ref
        elif data.get("dataset"):
            spec["dataset"] = data["dataset"]
        for key, reason in errors.items():
            form.add_error(key, reason)
        if form.is_valid():
            job, spec_errors = _submit(request, team, spec, data.get("name", ""))
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
    team = current_team(request)
    if team is None:
        return _no_team(request)
    form = YamlJobForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        job, errors = _submit(request, team, form.cleaned_data["spec"], form.cleaned_data["name"])
        if job is not None:
            messages.success(request, f"Job {job.name} submitted.")
            return redirect("web:job_detail", job_id=job.pk)
        for err in errors:
            where = f"{err['field']}: " if err.get("field") else ""
            form.add_error("spec_yaml", f"{where}{err['reason']}")
    return render(request, "web/job_new_yaml.html", {"yaml_form": form})


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
    try:
        from jobs import artifacts
    except ImportError:  # the artifacts module lands with the training runner
        return [], []
    base = f"/api/v1/jobs/{job.pk}"
    cps = [
        {**c, "download": f"{base}/checkpoints/{c['name']}"} for c in artifacts.checkpoints(job.pk)
    ]
    arts = [{**a, "download": f"{base}/artifacts/{a['name']}"} for a in artifacts.artifacts(job.pk)]
    return cps, arts


def _eval_results(job: Job, artifacts: list[dict[str, Any]]) -> dict[str, Any]:
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
    transcripts = {a["name"]: a for a in artifacts if a.get("kind") == "eval"}
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
    """What the sample box needs; it is offered once a finished job has exported an adapter."""
    from jobs import artifacts

    has_adapter = job.state in FINAL_STATES and artifacts.adapter_dir(job.pk) is not None
    return {
        "can_sample": has_adapter,
        "sample_form": form or SampleForm(),
        "samples": None,
        "sample_error": "",
    }


def _job_context(job: Job) -> dict[str, Any]:
    events = list(job.events.order_by("-created", "-id")[:30])
    checkpoints, artifacts = _artifacts(job)
    return {
        "job": job,
        "timeline": _timeline(job),
        "events": events,
        "live": job.state not in FINAL_STATES,
        "live_interval": settings.OPENTINKER_WEB_LIVE_SECONDS,
        "can_cancel": job.state not in FINAL_STATES and not job.cancel_requested,
        "checkpoints": checkpoints,
        "artifacts": artifacts,
        "metric_names": _metric_names(job),
        "evals": _eval_results(job, artifacts),
        "now": timezone.now(),
    }


@login_required
def job_detail(request: HttpRequest, job_id: Any) -> HttpResponse:
    job = _team_job(request, job_id)
    context = _job_context(job)
    if request.htmx:  # type: ignore[attr-defined]
        response = render(request, "web/_job_status.html", context)
    else:
        context["spec_json"] = json.dumps(job.spec, indent=2, sort_keys=True)
        context.update(_sample_context(job))
        response = render(request, "web/job_detail.html", context)
    patch_vary_headers(response, ["HX-Request"])
    return response


@login_required
@require_POST
def job_sample(request: HttpRequest, job_id: Any) -> HttpResponse:
    """Generate from a finished job's adapter with ``jobs.sampling`` (the API's service).

    htmx posts get only the sample box back; a plain form post (no JavaScript) gets the whole
    job page with the samples or the error in the box. Refusals answer 400 (bad parameters)
    or 409 (no adapter) to plain posts; htmx swaps only 2xx answers, so it gets 200 with the
    message in the box.
    """
    from jobs import sampling

    job = _team_job(request, job_id)
    form = SampleForm(request.POST)
    box = _sample_context(job, form)
    status = 200
    if not box["can_sample"]:
        box["sample_error"] = (
            f"Job {job.name} has no adapter to sample from yet: only a finished training "
            f"run that exported a LoRA adapter can be sampled (state {job.get_state_display()})."
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
            )
        except sampling.NoAdapter as exc:
            box["sample_error"] = f"Cannot sample: {exc}."
            status = 409
        except sampling.BadSampleRequest as exc:
            # The service names the chat "messages": in this form it is the prompt box.
            field = "prompt" if exc.field in ("prompt", "messages") else None
            form.add_error(field, exc.reason)
            status = 400
    if request.htmx:  # type: ignore[attr-defined]
        response = render(request, "web/_sample.html", {"job": job, **box})
    else:
        context = _job_context(job)
        context["spec_json"] = json.dumps(job.spec, indent=2, sort_keys=True)
        context.update(box)
        response = render(request, "web/job_detail.html", context, status=status)
    # Samples are one person's answer to one prompt: never from a cache.
    response["Cache-Control"] = "no-store"
    patch_vary_headers(response, ["HX-Request"])
    return response


@login_required
def job_metrics(request: HttpRequest, job_id: Any) -> JsonResponse:
    """``{"series": {name: [[step, value], ...]}, "final": bool}`` for the charts."""
    job = _team_job(request, job_id)
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


@login_required
def job_cancel(request: HttpRequest, job_id: Any) -> HttpResponse:
    """GET asks for confirmation (works without JavaScript); POST cancels."""
    job = _team_job(request, job_id)
    if request.method == "POST":
        try:
            services.cancel_job(job, by=request.user)
        except services.IllegalTransition as exc:
            messages.error(request, f"Cannot cancel: {exc}.")
        else:
            messages.success(request, f"Cancel of {job.name} requested.")
        return redirect("web:job_detail", job_id=job.pk)
    return render(request, "web/job_cancel.html", {"job": job})


# --- API keys -----------------------------------------------------------------------------------


def _can_manage_key(request: HttpRequest, key: ApiKey) -> bool:
    return key.created_by_id == request.user.pk or is_owner(key.team, request.user)


def _keys_page(
    request: HttpRequest,
    team: Team,
    *,
    form: KeyForm | None = None,
    secret: str | None = None,
    secret_key: ApiKey | None = None,
) -> HttpResponse:
    keys = ApiKey.objects.filter(team=team).select_related("created_by").order_by("-created")
    now = timezone.now()
    rows = [{"key": k, "live": k.is_live(now), "manage": _can_manage_key(request, k)} for k in keys]
    response = render(
        request,
        "web/keys.html",
        {"rows": rows, "form": form or KeyForm(), "secret": secret, "secret_key": secret_key},
    )
    if secret:
        # The plaintext exists only in this response: keep it out of every cache.
        response["Cache-Control"] = "no-store"
    return response


@login_required
@never_cache
def keys(request: HttpRequest) -> HttpResponse:
    team = current_team(request)
    if team is None:
        return _no_team(request)
    if request.method == "POST":
        form = KeyForm(request.POST)
        if form.is_valid():
            days = form.cleaned_data.get("expires_in_days")
            expires = timezone.now() + timedelta(days=days) if days else None
            try:
                key, secret = issue_key(team, request.user, form.cleaned_data["name"], expires)
            except (KeyRefused, ValueError) as exc:
                form.add_error(None, str(exc))
            else:
                return _keys_page(request, team, secret=secret, secret_key=key)
        return _keys_page(request, team, form=form)
    return _keys_page(request, team)


def _team_key(request: HttpRequest, pk: int) -> ApiKey:
    team = _require_team(request)
    key = get_object_or_404(ApiKey.objects.select_related("team"), pk=pk, team=team)
    return key


@login_required
@require_POST
@never_cache
def key_rotate(request: HttpRequest, pk: int) -> HttpResponse:
    key = _team_key(request, pk)
    if not _can_manage_key(request, key):
        return HttpResponseForbidden("only the key's creator or a team owner may rotate it")
    try:
        new, secret = rotate_key(key, user=request.user)
    except KeyRefused as exc:
        messages.error(request, str(exc))
        return redirect("web:keys")
    grace = settings.OPENTINKER_KEY_ROTATION_GRACE_HOURS
    messages.info(request, f"Rotated. The old key keeps working for {grace} h.")
    return _keys_page(request, key.team, secret=secret, secret_key=new)


@login_required
@require_POST
def key_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    key = _team_key(request, pk)
    if not _can_manage_key(request, key):
        return HttpResponseForbidden("only the key's creator or a team owner may revoke it")
    if revoke_key(key):
        messages.success(request, f"Key {key.name} ({key.display_prefix}) revoked.")
    else:
        messages.info(request, "That key was already revoked.")
    return redirect("web:keys")


# --- team ---------------------------------------------------------------------------------------


def _usage(team: Team) -> list[dict[str, Any]]:
    used = services.quota_usage(team)
    quota = team.quota
    bars = [
        ("GPUs in use", used["gpus_in_use"], quota.max_gpus, ""),
        ("Queued jobs", used["queued_jobs"], quota.max_queued_jobs, ""),
        ("GPU-hours this month", used["gpu_hours_this_month"], quota.gpu_hours_per_month, " h"),
    ]
    out = []
    for label, value, limit, unit in bars:
        pct = 100.0 if limit <= 0 else min(100.0, 100.0 * float(value) / float(limit))
        out.append(
            {
                "label": label,
                "value": value,
                "limit": limit,
                "unit": unit,
                "percent": round(pct, 1),
                "high": pct >= 90,
            }
        )
    return out


@login_required
def team_page(request: HttpRequest) -> HttpResponse:
    team = current_team(request)
    if team is None:
        return _no_team(request)
    owner = is_owner(team, request.user)
    members = team.memberships.select_related("user").order_by("user__username")
    invites = Invitation.objects.filter(team=team, accepted__isnull=True) if owner else []
    return render(
        request,
        "web/team.html",
        {
            "team": team,
            "members": members,
            "is_owner": owner,
            "invite_form": InviteForm(),
            "invites": invites,
            "usage": _usage(team),
            "roles": Membership.Role.choices,
        },
    )


@login_required
@require_POST
def team_invite(request: HttpRequest) -> HttpResponse:
    team = _require_team(request)
    if not is_owner(team, request.user):
        return HttpResponseForbidden("only team owners may invite")
    form = InviteForm(request.POST)
    if not form.is_valid():
        for field, errs in form.errors.items():
            messages.error(request, f"{field}: {' '.join(errs)}")
        return redirect("web:team")
    email = form.cleaned_data["email"].lower()
    role = form.cleaned_data["role"]
    from allauth.account.models import EmailAddress

    verified = (
        EmailAddress.objects.filter(email__iexact=email, verified=True)
        .select_related("user")
        .first()
    )
    link = request.build_absolute_uri(reverse("web:jobs"))
    if verified is not None:
        _, created = Membership.objects.get_or_create(
            user=verified.user, team=team, defaults={"role": role}
        )
        if created:
            send_mail(
                f"[OpenTinker] You were added to team {team.name}",
                f"{request.user} added you to team {team.name}. Open {link} to start.",
                None,
                [email],
            )
            messages.success(request, f"{verified.user} joined {team.name}.")
        else:
            messages.info(request, f"{verified.user} is already a member.")
        return redirect("web:team")
    with transaction.atomic():
        Invitation.objects.update_or_create(
            team=team,
            email=email,
            defaults={"role": role, "invited_by": request.user, "accepted": None},
        )
    signup = request.build_absolute_uri(reverse("account_signup"))
    send_mail(
        f"[OpenTinker] Invitation to team {team.name}",
        f"{request.user} invited you to team {team.name} on OpenTinker.\n"
        f"Sign up (or add this address to your account) and verify it: {signup}",
        None,
        [email],
    )
    messages.success(request, f"Invitation sent to {email}.")
    return redirect("web:team")


def _last_owner(team: Team, membership: Membership) -> bool:
    return (
        membership.role == Membership.Role.OWNER
        and team.memberships.filter(role=Membership.Role.OWNER).count() == 1
    )


@login_required
@require_POST
def team_remove(request: HttpRequest, pk: int) -> HttpResponse:
    team = _require_team(request)
    membership = get_object_or_404(Membership, pk=pk, team=team)
    leaving = membership.user_id == request.user.pk
    if not leaving and not is_owner(team, request.user):
        return HttpResponseForbidden("only team owners may remove members")
    if _last_owner(team, membership):
        messages.error(request, "A team needs an owner: make someone else owner first.")
        return redirect("web:team")
    membership.delete()
    messages.success(request, f"{membership.user} left {team.name}.")
    return redirect("web:jobs" if leaving else "web:team")


@login_required
@require_POST
def team_role(request: HttpRequest, pk: int) -> HttpResponse:
    team = _require_team(request)
    if not is_owner(team, request.user):
        return HttpResponseForbidden("only team owners may change roles")
    membership = get_object_or_404(Membership, pk=pk, team=team)
    form = RoleForm(request.POST)
    if form.is_valid():
        role = form.cleaned_data["role"]
        if role != Membership.Role.OWNER and _last_owner(team, membership):
            messages.error(request, "A team needs an owner: make someone else owner first.")
        else:
            Membership.objects.filter(pk=membership.pk).update(role=role)
            messages.success(request, f"{membership.user} is now {role}.")
    return redirect("web:team")


@login_required
@require_POST
def invite_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    team = _require_team(request)
    if not is_owner(team, request.user):
        return HttpResponseForbidden("only team owners may withdraw invitations")
    get_object_or_404(Invitation, pk=pk, team=team).delete()
    return redirect("web:team")


# --- datasets -----------------------------------------------------------------------------------


@login_required
def datasets(request: HttpRequest) -> HttpResponse:
    team = current_team(request)
    if team is None:
        return _no_team(request)
    form = DatasetForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        upload = form.cleaned_data["file"]
        try:
            ds = dataset_store.store_dataset(
                team=team,
                user=request.user,
                name=form.cleaned_data["name"],
                env=form.cleaned_data["env"],
                filename=upload.name,
                chunks=upload.chunks(),
            )
        except dataset_store.DatasetRejected as exc:
            form.add_error(
                "name" if isinstance(exc, dataset_store.DatasetConflict) else "file", str(exc)
            )
        else:
            messages.success(request, f"Dataset {ds.name} stored: {ds.rows} rows.")
            return redirect("web:datasets")
    rows = Dataset.objects.filter(team=team).select_related("created_by").order_by("name")
    return render(request, "web/datasets.html", {"form": form, "datasets": rows})


@login_required
@require_POST
def dataset_delete(request: HttpRequest, pk: Any) -> HttpResponse:
    team = _require_team(request)
    ds = get_object_or_404(Dataset, pk=pk, team=team)
    try:
        dataset_store.delete_dataset(ds)
    except dataset_store.DatasetRejected as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Dataset {ds.name} deleted.")
    return redirect("web:datasets")


# --- GPU pool (staff) ---------------------------------------------------------------------------


@staff_member_required
def pool(request: HttpRequest) -> HttpResponse:
    from workers import conf
    from workers.dispatcher import _queued_candidates, admission_order
    from workers.inventory import lock_table

    error = ""
    nodes: list[dict[str, Any]] = []
    try:
        snap = lock_table().snapshot()
    except (RedisError, OSError) as exc:  # Redis down: the page says so instead of a 500
        snap = {"nodes": {}, "leases": []}
        error = f"lock table unavailable: {exc}"
    lease_jobs = {le["job_id"] for le in snap["leases"]}
    jobs = {str(j.pk): j for j in Job.objects.filter(pk__in=lease_jobs).select_related("team")}
    for name, info in sorted(snap["nodes"].items()):
        gpus = []
        for g in info.get("gpus", []):
            holder = info.get("held", {}).get(g)
            gpus.append({"index": g, "job_id": holder, "job": jobs.get(holder or "")})
        nodes.append(
            {
                "name": name,
                "alive": info.get("alive"),
                "kind": info.get("kind", ""),
                "gpus": gpus,
                "free": len(info.get("free", [])),
            }
        )
    now = timezone.now()
    queue = []
    for pos, cand in enumerate(admission_order(_queued_candidates(), now, conf.aging_seconds()), 1):
        queue.append({"pos": pos, "cand": cand})
    queued = {
        str(j.pk): j
        for j in Job.objects.filter(pk__in=[q["cand"].job_id for q in queue]).select_related("team")
    }
    for q in queue:
        q["job"] = queued.get(q["cand"].job_id)
    leases = [{**le, "job": jobs.get(le["job_id"])} for le in snap["leases"]]
    return render(
        request, "web/pool.html", {"nodes": nodes, "leases": leases, "queue": queue, "error": error}
    )


def home(request: HttpRequest) -> HttpResponse:
    if request.user.is_authenticated:
        return redirect("web:jobs")
    return redirect("account_login")
