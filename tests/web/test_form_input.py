"""Hostile input to the web forms is a form error beside its field: never a hung process, a
500 page or a row stored half-checked."""

from __future__ import annotations

import io
import json
import random
import zipfile
from collections.abc import Callable
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse

from accounts.models import Team
from jobs.models import Dataset, Job
from tests.fixtures.accounts import leftovers
from tests.web.test_job_pages import _form_defaults
from training import geometry

pytestmark = pytest.mark.django_db

LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(9)
)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "spec_yaml",
    [
        "method: smoke\na: &a [*a]\n",
        "method: smoke\n" + LAUGHS,
        "base: &b {method: smoke}\n<<: *b\n",
    ],
    ids=["cycle", "billion-laughs", "merge-key"],
)
def test_it_refuses_yaml_aliases_in_a_spec(
    login: Callable[[Any], Client], gpu_inventory_unknown: None, team: Team, owner: Any, spec_yaml
) -> None:
    response = login(owner).post(reverse("web:job_new_yaml"), {"spec_yaml": spec_yaml})
    assert response.status_code == 200
    [error] = response.context["yaml_form"].errors["spec_yaml"]
    assert "aliases" in error
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    "spec_yaml, field",
    [
        ('method: rl\nenv: bandit\nenv_config: {"\\ud800": 1}\n', "env_config"),
        ('method: rl\nenv: bandit\nenv_config: {n_arms: "\\udfff"}\n', "env_config.n_arms"),
        ("method: smoke\nsmoke_steps: " + "9" * 5000 + "\n", "spec_yaml"),
        ("method: rl\nenv: bandit\nenv_config: {n_arms: .nan}\n", "env_config.n_arms"),
    ],
    ids=["surrogate-key", "surrogate-value", "huge-int", "nan"],
)
def test_it_reports_unstorable_yaml_values_as_form_errors(
    login: Callable[[Any], Client],
    gpu_inventory_unknown: None,
    team: Team,
    owner: Any,
    spec_yaml: str,
    field: str,
) -> None:
    response = login(owner).post(reverse("web:job_new_yaml"), {"spec_yaml": spec_yaml})
    assert response.status_code == 200
    errors = response.context["yaml_form"].errors["spec_yaml"]
    assert field in errors[0] or field == "spec_yaml", errors
    assert not Job.objects.exists()


def test_it_reports_deeply_nested_json_in_a_form_field(
    login: Callable[[Any], Client], gpu_inventory_unknown: None, team: Team, owner: Any
) -> None:
    client = login(owner)
    data = _form_defaults(client) | {
        "name": "deep",
        "method": "rl",
        "env": "bandit",
        "env_config": "[" * 50_000 + "]" * 50_000,
    }
    response = client.post(reverse("web:job_new"), data)
    assert response.status_code == 200
    assert "nested too deeply" in response.context["form"].errors["env_config"][0]
    assert not Job.objects.exists()


def _deep_zip() -> bytes:
    row = '{"images": ["0.png"], "problem": ' + "[" * 100_000 + "]" * 100_000 + "}"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        good = json.dumps({"images": ["0.png"], "problem": "Find x.", "answer": "3"})
        archive.writestr("geo/train.jsonl", good + "\n" + row + "\n")
        archive.writestr("geo/0.png", geometry.shape_picture(random.Random(3))[0])
    return buffer.getvalue()


def test_it_reports_a_deeply_nested_row_of_a_zipped_upload(
    login: Callable[[Any], Client], team: Team, owner: Any, data_dir: Any
) -> None:
    upload = SimpleUploadedFile("geo.zip", _deep_zip(), content_type="application/zip")
    response = login(owner).post(
        reverse("web:datasets"), {"name": "geo", "env": "geometry", "file": upload}
    )
    assert response.status_code == 200
    assert "nested too deeply" in response.context["form"].errors["file"][0]
    assert not Dataset.objects.exists() and leftovers(data_dir) == []
