"""The API v1 router: one place that lists every endpoint under /api/v1/."""

from __future__ import annotations

from django.urls import path
from rest_framework.routers import DefaultRouter

from accounts.views import ApiKeyViewSet, MeView, TeamViewSet
from environments.views import EnvironmentViewSet
from jobs.views import BaseModelViewSet, DatasetViewSet, JobViewSet, QuotaView

# No trailing slash: the documented paths are /api/v1/jobs, /api/v1/jobs/{id}/cancel, ...
router = DefaultRouter(trailing_slash=False)
router.register("jobs", JobViewSet, basename="job")
router.register("keys", ApiKeyViewSet, basename="apikey")
router.register("teams", TeamViewSet, basename="team")
router.register("datasets", DatasetViewSet, basename="dataset")
router.register("base-models", BaseModelViewSet, basename="basemodel")
router.register("environments", EnvironmentViewSet, basename="environment")

urlpatterns = [
    path("quota", QuotaView.as_view(), name="quota"),
    path("me", MeView.as_view(), name="me"),
    *router.urls,
]
