"""The model workers' GPU time in the monthly GPU-hours budget: what a worker charges each team
(``ServingCharge``) adds up across flushes and workers, counts with the jobs' own charges, and
once it has spent the month it refuses what would run on the model workers and keeps the
team's queued jobs from starting, as a job's own time would."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import OperationalError
from django.utils import timezone

from jobs import quotas, services
from jobs.charge_services import charge_serving
from jobs.models import Job, JobState, ServingCharge
from jobs.quotas import BudgetSpent, check_month_budget, month_start
from tinker_api.worker import meter as meter_module
from tinker_api.worker.meter import Meter, by_rows, by_size, each
from tinker_api.worker.requests import Op

pytestmark = pytest.mark.django_db

SMOKE = {"method": "smoke"}


def test_charges_add_up_per_team_month_and_base_model(team, other_team):
    charge_serving("tiny", {team.pk: 30.0, other_team.pk: 5.0}, {team.pk: 2})
    charge_serving("tiny", {team.pk: 12.5}, {team.pk: 1, other_team.pk: 4})
    charge_serving("big", {team.pk: 100.0}, {})
    last_month = month_start() - timedelta(days=3)
    charge_serving("tiny", {team.pk: 1000.0}, {team.pk: 9}, now=last_month)

    rows = {
        (r.team_id, r.month, r.base_model): (r.gpu_seconds, r.requests)
        for r in ServingCharge.objects.all()
    }
    this, before = month_start().date(), month_start(last_month).date()
    assert rows == {
        (team.pk, this, "tiny"): (pytest.approx(42.5), 3),
        (other_team.pk, this, "tiny"): (pytest.approx(5.0), 4),
        (team.pk, this, "big"): (pytest.approx(100.0), 0),
        (team.pk, before, "tiny"): (pytest.approx(1000.0), 9),
    }
    assert services.gpu_seconds_this_month(team.pk) == pytest.approx(142.5)
    assert services.gpu_seconds_this_month(other_team.pk) == pytest.approx(5.0)
    usage = services.quota_usage(team)
    assert usage["serving_gpu_hours_this_month"] == pytest.approx(142.5 / 3600, abs=1e-4)
    assert usage["gpu_hours_this_month"] == pytest.approx(142.5 / 3600, abs=1e-4)


def test_a_spent_month_refuses_serving_and_keeps_queued_jobs_waiting(team, owner, other_team):
    team.quota.gpu_hours_per_month = 0.01  # 36 GPU-seconds
    team.quota.save()
    queued = services.submit_job(team=team, user=owner, spec=SMOKE, name="next")
    check_month_budget(team.pk)

    charge_serving("tiny", {team.pk: 40.0}, {team.pk: 1})
    now = timezone.now()
    with pytest.raises(BudgetSpent) as refused:
        check_month_budget(team.pk, now)
    assert "used 0.01 of its 0.01 GPU-hours this month (gpu_hours_per_month quota)" in str(
        refused.value
    )
    until_next_month = (month_start(now + timedelta(days=32)) - now).total_seconds()
    assert refused.value.seconds_left == pytest.approx(until_next_month, abs=1)
    check_month_budget(other_team.pk)

    assert not services.mark_starting(queued.pk, node="n", gpus=["n:0"], task_id="t")
    job = Job.objects.get(pk=queued.pk)
    assert job.state == JobState.QUEUED
    assert job.queue_note.startswith("the team has used 0.01 of its 0.01 GPU-hours this month")

    team.quota.gpu_hours_per_month = 1.0
    team.quota.save()
    check_month_budget(team.pk)
    assert services.mark_starting(queued.pk, node="n", gpus=["n:0"], task_id="t")


def op(team: int | None, *, n: int = 1, body: bytes | None = None) -> Op:
    fields = {"op": "chat", "rid": "r", "n": n, "mode": "chat"}
    if team is not None:
        fields["team"] = team
    return Op(fields, body)


# The flush closes stale connections first, as a long-lived worker must: outside a test's
# transaction.
@pytest.mark.django_db(transaction=True)
def test_a_batch_is_split_by_each_teams_share(team, other_team, settings):
    settings.OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS = 3600
    meter = Meter("tiny", gpus=2)
    a, b = team.pk, other_team.pk
    # Sampling by rows: 3 of a's, 1 of b's.
    meter.charge(by_rows([op(a, n=2), op(a), op(b)]), 1.0)
    # Forward/backward by bytes.
    meter.charge(by_size([op(a, body=b"x" * 300), op(b, body=b"x" * 100)]), 2.0)
    # A request of the service's own (closing models) keeps its share uncharged.
    meter.charge(each([op(a), op(None)]), 4.0)
    meter.count([op(a), op(a), op(b), op(None)])
    assert dict(meter.seconds) == {
        a: pytest.approx(2 * (0.75 + 1.5 + 2.0)),
        b: pytest.approx(2 * (0.25 + 0.5)),
    }

    meter.flush()  # not due yet: nothing written
    assert not ServingCharge.objects.exists()
    meter.flush(force=True)
    assert not meter.seconds and not meter.requests
    rows = {r.team_id: (r.gpu_seconds, r.requests) for r in ServingCharge.objects.all()}
    assert rows == {a: (pytest.approx(8.5), 2), b: (pytest.approx(1.5), 1)}


def charges() -> dict[tuple[int, object], tuple[float, int]]:
    return {
        (r.team_id, r.month): (pytest.approx(r.gpu_seconds), r.requests)
        for r in ServingCharge.objects.all()
    }


@pytest.mark.django_db(transaction=True)
def test_a_flush_the_database_cut_short_writes_each_teams_charge_once(
    team, other_team, monkeypatch
):
    meter = Meter("tiny", gpus=1)
    a, b = team.pk, other_team.pk
    meter.charge(each([op(a), op(b)]), 20.0)
    meter.count([op(a), op(b)])
    real = ServingCharge.objects.create
    made: list[int] = []

    def down_after_one(**fields):
        if made:
            raise OperationalError("server closed the connection unexpectedly")
        made.append(fields["team_id"])
        return real(**fields)

    monkeypatch.setattr(ServingCharge.objects, "create", down_after_one)
    meter.flush(force=True)
    this = month_start().date()
    assert charges() == {(made[0], this): (10.0, 1)}
    monkeypatch.setattr(ServingCharge.objects, "create", real)
    meter.flush(force=True)  # the database is back: the rest, and only the rest
    assert charges() == {(a, this): (10.0, 1), (b, this): (10.0, 1)}
    assert not meter.seconds and not meter.requests


@pytest.mark.django_db(transaction=True)
def test_time_charged_before_the_month_turned_is_written_to_that_month(team, monkeypatch):
    this = month_start()
    last = month_start(this - timedelta(days=3))
    monkeypatch.setattr(meter_module, "month_start", lambda now=None: last)
    meter = Meter("tiny", gpus=1)
    meter.charge(each([op(team.pk)]), 30.0)
    meter.count([op(team.pk)])
    # Not written before the month turned (the database was down then, or the flush not due).
    monkeypatch.setattr(meter_module, "month_start", lambda now=None: this)
    meter.charge(each([op(team.pk)]), 5.0)
    meter.flush(force=True)
    assert charges() == {
        (team.pk, last.date()): (30.0, 1),
        (team.pk, this.date()): (5.0, 0),
    }
    assert not meter.earlier


def test_the_check_reuses_a_teams_usage_for_a_moment_but_reads_its_limit_each_time(
    team, monkeypatch
):
    monkeypatch.setattr(quotas, "USAGE_REUSE_SECONDS", 0.5)
    team.quota.gpu_hours_per_month = 0.01
    team.quota.save()
    check_month_budget(team.pk)
    charge_serving("tiny", {team.pk: 60.0}, {team.pk: 1})
    # Counted before the charge landed, and reused: what a worker's flush period allows.
    check_month_budget(team.pk)
    team.quota.gpu_hours_per_month = 0.0
    team.quota.save()
    with pytest.raises(BudgetSpent):
        check_month_budget(team.pk)

    team.quota.gpu_hours_per_month = 0.01
    team.quota.save()
    time.sleep(0.6)
    with pytest.raises(BudgetSpent) as refused:
        check_month_budget(team.pk)
    assert refused.value.used_hours == pytest.approx(60 / 3600)


def test_the_reused_usage_does_not_grow_without_bound(team, other_team, monkeypatch):
    monkeypatch.setattr(quotas, "USAGE_REUSE_ENTRIES", 2)
    monkeypatch.setattr(quotas, "USAGE_REUSE_SECONDS", 0.0)
    for checked in (team.pk, other_team.pk, other_team.pk + 1, team.pk):
        check_month_budget(checked)
        assert len(quotas._recent_usage) <= 2
