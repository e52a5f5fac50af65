"""The team's datasets: upload (validated against an environment's columns) and delete."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from jobs import datasets as dataset_store
from jobs.models import Dataset
from web.forms import DatasetForm
from web.teams import page_team

from .common import acted_on, no_team


@login_required
def datasets(request: HttpRequest) -> HttpResponse:
    team = page_team(request)
    if team is None:
        return no_team(request)
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
    ds = acted_on(request, Dataset.objects.all(), pk)
    try:
        dataset_store.delete_dataset(ds)
    except dataset_store.DatasetRejected as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Dataset {ds.name} deleted.")
    return redirect("web:datasets")
