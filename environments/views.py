"""``GET /api/v1/environments``: the registered environments, their settings and dataset columns.

A JobSpec names an environment (``env``), its settings (``env_config``) and, for dataset
environments, a dataset whose rows must carry the listed columns. This is where a user finds
all three without reading the source.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, viewsets
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response

from environments.registry import ContractError, env_names, get_env


class DatasetColumnSerializer(serializers.Serializer):
    name = serializers.CharField()
    type = serializers.CharField(help_text="JSON type(s) the column's values must have.")
    description = serializers.CharField()
    required = serializers.BooleanField(help_text="False: a row may leave the column out.")


class EnvironmentSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="The value of `env` in a JobSpec.")
    data_source = serializers.ChoiceField(
        choices=["dataset", "generator"],
        help_text="`dataset` environments need `dataset`; `generator` ones refuse it.",
    )
    interaction = serializers.ChoiceField(choices=["single_turn", "multi_turn"])
    description = serializers.CharField()
    dataset_columns = DatasetColumnSerializer(
        many=True, allow_null=True, help_text="Required columns (null for generators)."
    )
    config_schema = serializers.JSONField(
        help_text="JSON Schema of `env_config`: every setting with its type, default and meaning."
    )
    choices = serializers.DictField(
        child=serializers.ListField(child=serializers.CharField()),
        help_text="Allowed values of settings that the environment's library defines, e.g. "
        "the reasoning-gym generators for `dataset` (empty when none).",
    )


class EnvironmentViewSet(viewsets.ViewSet):
    """The environments a job may train or evaluate on."""

    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9_.-]+"

    @extend_schema(responses=EnvironmentSerializer(many=True))
    def list(self, request: Request) -> Response:
        return Response([get_env(name).describe() for name in env_names()])

    @extend_schema(responses=EnvironmentSerializer)
    def retrieve(self, request: Request, name: str | None = None) -> Response:
        try:
            spec = get_env(str(name))
        except ContractError as exc:
            raise NotFound(exc.reason) from None
        return Response(spec.describe())

    def get_serializer(self, *args: Any, **kwargs: Any) -> EnvironmentSerializer:
        return EnvironmentSerializer(*args, **kwargs)
