"""The GPU pool for staff: nodes and who holds each GPU (from the Redis lock table, the
authority), live leases, and the queue in admission order."""

from __future__ import annotations

from typing import Any

from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from redis.exceptions import RedisError

from jobs.models import Job
from workers import conf
from workers.dispatcher import admission_order, queued_candidates
from workers.inventory import lock_table
from workers.locktable import is_job_id


@staff_member_required
def pool(request: HttpRequest) -> HttpResponse:
    error = ""
    nodes: list[dict[str, Any]] = []
    try:
        snap = lock_table().snapshot()
    except (RedisError, OSError) as exc:  # Redis down: the page says so instead of a 500
        snap = {"nodes": {}, "leases": []}
        error = f"lock table unavailable: {exc}"
    # Not every lease is a job's: a Tinker model worker holds "tinker:<base>:<id>".
    lease_jobs = {le["job_id"] for le in snap["leases"] if is_job_id(le["job_id"])}
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
    for pos, cand in enumerate(admission_order(queued_candidates(), now, conf.aging_seconds()), 1):
        queue.append({"pos": pos, "cand": cand})
    queued = {
        str(j.pk): j
        for j in Job.objects.filter(pk__in=[q["cand"].job_id for q in queue]).select_related("team")
    }
    for q in queue:
        q["job"] = queued.get(q["cand"].job_id)
    leases = []
    for le in snap["leases"]:
        members = le.get("members") or [[le["node"], le["gpus"]]]
        placed = "; ".join(f"{node}: {', '.join(map(str, gpus))}" for node, gpus in members)
        leases.append(
            {**le, "job": jobs.get(le["job_id"]), "gang": len(members) > 1, "placed": placed}
        )
    return render(
        request, "web/pool.html", {"nodes": nodes, "leases": leases, "queue": queue, "error": error}
    )
