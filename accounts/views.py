"""API v1: teams and API keys, scoped to the caller's teams."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from . import keys
from .exceptions import Conflict
from .models import ApiKey, Membership, Team
from .scoping import resolve_team, team_ids_for
from .serializers import (
    ApiKeyCreateSerializer,
    ApiKeyRotateSerializer,
    ApiKeySerializer,
    IssuedApiKeySerializer,
    MeSerializer,
    TeamSerializer,
)


class TeamViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Teams the caller belongs to (with an API key: the key's team)."""

    serializer_class = TeamSerializer
    lookup_field = "slug"
    # What a SlugField holds: anything else (a NUL, which PostgreSQL cannot even compare)
    # names no team and is answered 404 before any query.
    lookup_value_regex = r"[-a-zA-Z0-9_]+"

    def get_queryset(self) -> QuerySet[Team]:
        return Team.objects.filter(pk__in=team_ids_for(self.request))


class ApiKeyViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    viewsets.GenericViewSet,
):
    """API keys of the caller's teams. The secret is returned once, on create and rotate."""

    serializer_class = ApiKeySerializer

    def get_queryset(self) -> QuerySet[ApiKey]:
        return ApiKey.objects.filter(team_id__in=team_ids_for(self.request)).select_related(
            "team", "created_by"
        )

    def _check_can_manage(self, key: ApiKey) -> None:
        if key.created_by_id == self.request.user.pk:
            return
        owner = Membership.objects.filter(
            user=self.request.user, team_id=key.team_id, role=Membership.Role.OWNER
        ).exists()
        if not owner:
            raise PermissionDenied("Only the key's creator or a team owner can do this.")

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: IssuedApiKeySerializer})
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        data = ApiKeyCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        team = resolve_team(request, data.validated_data.get("team"))
        key, plaintext = keys.issue_key(
            team,
            request.user,
            data.validated_data["name"],
            expires_at=data.validated_data.get("expires_at"),
        )
        body = IssuedApiKeySerializer(key, context={"plaintext": plaintext, "request": request})
        return Response(body.data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ApiKeyRotateSerializer, responses={201: IssuedApiKeySerializer})
    @action(detail=True, methods=["post"])
    def rotate(self, request: Request, pk: str | None = None) -> Response:
        """Issue a successor key; the old one keeps working for the grace period."""
        key = self.get_object()
        self._check_can_manage(key)
        data = ApiKeyRotateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        grace_hours = data.validated_data.get("grace_hours")
        try:
            new, plaintext = keys.rotate_key(
                key,
                user=request.user,
                grace=None if grace_hours is None else timedelta(hours=grace_hours),
                expires_at=data.validated_data.get("expires_at"),
            )
        except keys.KeyRefused as exc:
            raise Conflict(str(exc)) from exc
        body = IssuedApiKeySerializer(new, context={"plaintext": plaintext, "request": request})
        return Response(body.data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: ApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Revoke at once: the next request with this key is refused. Idempotent."""
        key = self.get_object()
        self._check_can_manage(key)
        keys.revoke_key(key)
        return Response(ApiKeySerializer(key, context={"request": request}).data)


class MeView(APIView):
    """Who the caller is: the user, their teams and, with key auth, the key in use.

    What ``opentinker whoami`` shows; with an API key only the key's team is listed, since
    that is all the key can act for.
    """

    @extend_schema(responses={200: MeSerializer})
    def get(self, request: Request) -> Response:
        key = request.auth if isinstance(request.auth, ApiKey) else None
        teams = Team.objects.filter(pk__in=team_ids_for(request)).order_by("slug")
        context = {"request": request}
        return Response(
            {
                "username": request.user.get_username(),
                "teams": TeamSerializer(teams, many=True, context=context).data,
                "key": None if key is None else ApiKeySerializer(key, context=context).data,
            }
        )
