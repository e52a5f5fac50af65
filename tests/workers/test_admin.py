"""The GPU lease admin: read-only, and shows whether Redis still holds each lease."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.test import Client

from jobs import services
from workers.locktable import GpuLockTable
from workers.models import GpuLeaseRecord


def test_it_lists_lease_records_with_their_live_state(
    transactional_db: None, clean_control_plane: Any, team: Any, owner: Any
) -> None:
    GpuLockTable(clean_control_plane).announce("n", [0, 1], ttl=60)
    held = services.submit_job(team=team, user=owner, spec={"method": "smoke"}, name="held")
    record = GpuLeaseRecord.objects.get(job=held)
    assert record.outcome == "held" and record.gpus == ["n:0"]

    root = get_user_model().objects.create_superuser("root", "root@example.org", "pw")
    client = Client()
    client.force_login(root)
    page = client.get("/admin/workers/gpuleaserecord/")
    assert page.status_code == 200
    assert b"icon-yes.svg" in page.content  # the lease is in Redis right now
    assert client.get(f"/admin/workers/gpuleaserecord/{record.pk}/change/").status_code == 200
    assert client.get("/admin/workers/gpuleaserecord/add/").status_code == 403
