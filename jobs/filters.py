from __future__ import annotations

import django_filters

from .models import Dataset, DatasetFormat, Job, JobKind, JobState


class JobFilter(django_filters.FilterSet):
    state = django_filters.MultipleChoiceFilter(choices=JobState.choices)
    kind = django_filters.ChoiceFilter(choices=JobKind.choices)
    name = django_filters.CharFilter(lookup_expr="icontains")
    creator = django_filters.CharFilter(
        field_name="created_by__username", help_text="Username of the job's creator."
    )
    team = django_filters.CharFilter(
        field_name="team__slug", help_text="Slug of one of the caller's teams."
    )

    class Meta:
        model = Job
        fields = ["state", "kind", "name", "creator", "team"]


class DatasetFilter(django_filters.FilterSet):
    env = django_filters.CharFilter()
    format = django_filters.ChoiceFilter(choices=DatasetFormat.choices)
    name = django_filters.CharFilter(lookup_expr="icontains")
    team = django_filters.CharFilter(
        field_name="team__slug", help_text="Slug of one of the caller's teams."
    )

    class Meta:
        model = Dataset
        fields = ["env", "format", "name", "team"]
