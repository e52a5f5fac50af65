from __future__ import annotations

from django.urls import path

from .views import common, datasets, job_detail, jobs, keys, pool, teams, transcripts

app_name = "web"

urlpatterns = [
    path("", common.home, name="home"),
    path("jobs/", jobs.job_list, name="jobs"),
    path("jobs/new/", jobs.job_new, name="job_new"),
    path("jobs/new/yaml/", jobs.job_new_yaml, name="job_new_yaml"),
    path("jobs/<uuid:job_id>/", job_detail.job_detail, name="job_detail"),
    path("jobs/<uuid:job_id>/metrics.json", job_detail.job_metrics, name="job_metrics"),
    path("jobs/<uuid:job_id>/cancel/", jobs.job_cancel, name="job_cancel"),
    path("jobs/<uuid:job_id>/sample/", job_detail.job_sample, name="job_sample"),
    path(
        "jobs/<uuid:job_id>/eval/<str:name>",
        transcripts.job_transcript,
        name="job_transcript",
    ),
    path("keys/", keys.keys, name="keys"),
    path("keys/<int:pk>/rotate/", keys.key_rotate, name="key_rotate"),
    path("keys/<int:pk>/revoke/", keys.key_revoke, name="key_revoke"),
    path("team/", teams.team_page, name="team"),
    path("team/switch/", teams.switch_team, name="switch_team"),
    path("team/invite/", teams.team_invite, name="team_invite"),
    path("team/invites/<int:pk>/withdraw/", teams.invite_cancel, name="invite_cancel"),
    path("team/members/<int:pk>/remove/", teams.team_remove, name="team_remove"),
    path("team/members/<int:pk>/role/", teams.team_role, name="team_role"),
    path("datasets/", datasets.datasets, name="datasets"),
    path("datasets/<uuid:pk>/delete/", datasets.dataset_delete, name="dataset_delete"),
    path("pool/", pool.pool, name="pool"),
]
