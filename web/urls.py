from __future__ import annotations

from django.urls import path

from . import views

app_name = "web"

urlpatterns = [
    path("", views.home, name="home"),
    path("jobs/", views.job_list, name="jobs"),
    path("jobs/new/", views.job_new, name="job_new"),
    path("jobs/new/yaml/", views.job_new_yaml, name="job_new_yaml"),
    path("jobs/<uuid:job_id>/", views.job_detail, name="job_detail"),
    path("jobs/<uuid:job_id>/metrics.json", views.job_metrics, name="job_metrics"),
    path("jobs/<uuid:job_id>/cancel/", views.job_cancel, name="job_cancel"),
    path("jobs/<uuid:job_id>/sample/", views.job_sample, name="job_sample"),
    path("keys/", views.keys, name="keys"),
    path("keys/<int:pk>/rotate/", views.key_rotate, name="key_rotate"),
    path("keys/<int:pk>/revoke/", views.key_revoke, name="key_revoke"),
    path("team/", views.team_page, name="team"),
    path("team/switch/", views.switch_team, name="switch_team"),
    path("team/invite/", views.team_invite, name="team_invite"),
    path("team/invites/<int:pk>/withdraw/", views.invite_cancel, name="invite_cancel"),
    path("team/members/<int:pk>/remove/", views.team_remove, name="team_remove"),
    path("team/members/<int:pk>/role/", views.team_role, name="team_role"),
    path("datasets/", views.datasets, name="datasets"),
    path("datasets/<uuid:pk>/delete/", views.dataset_delete, name="dataset_delete"),
    path("pool/", views.pool, name="pool"),
]
