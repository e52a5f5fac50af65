"""submit_job beyond the spec's own rules: the base-model registry, the environment registry's
2x2 contract, and the dataset reference (the team's, by name or id, or a built-in one)."""

from __future__ import annotations

import dataclasses

import pytest

from environments import registry
from environments.registry import get_env, register
from environments.schema import Column, DatasetSchema
from jobs import services
from jobs.models import BaseModel, Job
from jobs.spec import SpecError

pytestmark = pytest.mark.django_db


def submit(team, user, **spec):
    return services.submit_job(team=team, user=user, spec=spec, name="j")


def refused(team, user, **spec) -> dict[str, str]:
    before = Job.objects.count()
    with pytest.raises(SpecError) as exc:
        submit(team, user, **spec)
    assert Job.objects.count() == before
    return {e["field"]: e["reason"] for e in exc.value.errors}


def test_it_registers_the_tiny_model_in_a_migration():
    tiny = BaseModel.objects.get(name="tiny")
    assert tiny.enabled and tiny.path == "models/tiny-chat"
    assert (tiny.max_lora_rank, tiny.max_context) == (64, 1024)


def test_it_resolves_a_relative_model_path_against_the_project_root(settings, tmp_path):
    tiny = BaseModel.objects.get(name="tiny")
    assert tiny.resolved_path() == settings.BASE_DIR / "models" / "tiny-chat"
    settings.BASE_DIR = tmp_path
    assert tiny.resolved_path() == tmp_path / "models" / "tiny-chat"
    tiny.path = "/srv/models/qwen"
    assert str(tiny.resolved_path()) == "/srv/models/qwen"


def test_it_accepts_a_training_job_on_the_team_dataset_and_stores_its_reference(
    team, owner, make_dataset
):
    dataset = make_dataset()
    by_name = submit(team, owner, method="rl", env="math", dataset="arith")
    by_id = submit(team, owner, method="sft", env="math", dataset=str(dataset.pk))
    assert by_name.spec["dataset"] == by_id.spec["dataset"] == f"dataset:{dataset.pk}"
    assert by_name.spec["base_model"] == "tiny"


def test_it_accepts_a_dataset_validated_for_an_env_with_the_same_columns(team, owner, make_dataset):
    make_dataset(env="math")
    job = submit(team, owner, method="rl", env="math_code", dataset="arith")
    assert job.spec["env"] == "math_code"


def test_it_accepts_built_in_datasets_and_generator_envs(team, owner):
    job = submit(team, owner, method="rl", env="math", dataset="builtin:arith_train")
    assert job.spec["dataset"] == "builtin:arith_train"
    job = submit(team, owner, method="rl", env="bandit")
    assert job.spec["dataset"] is None


@pytest.mark.parametrize(
    "spec, field, words",
    [
        ({"method": "rl", "env": "math"}, "dataset", "reads a dataset"),
        ({"method": "rl", "env": "bandit", "dataset": "arith"}, "dataset", "generator"),
        (
            {"method": "rl", "env": "gomoku", "dataset": "builtin:arith_train"},
            "dataset",
            "generator",
        ),
        ({"method": "rl", "env": "chess"}, "env", "unknown environment"),
        ({"method": "rl", "env": "math", "dataset": "nope"}, "dataset", "has no dataset 'nope'"),
        ({"method": "rl", "env": "math", "dataset": "builtin:nope"}, "dataset", "unknown built-in"),
        ({"method": "rl"}, "env", "required"),
        ({"method": "smoke", "dataset": "arith"}, "dataset", "give `env`"),
        ({"method": "smoke", "env": "math"}, "dataset", "reads a dataset"),
    ],
)
def test_it_names_the_field_that_breaks_the_contract(team, owner, spec, field, words):
    errors = refused(team, owner, **spec)
    assert field in errors and words in errors[field], errors


def test_it_does_not_find_another_teams_dataset(team, other_team, owner, outsider, make_dataset):
    theirs = make_dataset(name="secret", team=other_team, user=outsider)
    for ref in ["secret", str(theirs.pk), theirs.ref]:
        errors = refused(team, owner, method="rl", env="math", dataset=ref)
        assert "has no dataset" in errors["dataset"]


def test_it_refuses_a_dataset_validated_for_an_env_with_other_columns(
    team, owner, make_dataset, monkeypatch
):
    make_dataset(env="math")
    # A dataset env whose columns differ from math's (no such env is built in yet),
    # registered through the registry's public register().
    prompts = dataclasses.replace(
        get_env("math_code"), name="prompts", schema=DatasetSchema((Column("prompt", (str,)),))
    )
    monkeypatch.setitem(registry._REGISTRY, "prompts", prompts)  # removed again afterwards
    register(prompts)
    errors = refused(team, owner, method="rl", env="prompts", dataset="arith")
    assert "validated for env 'math'" in errors["dataset"]


def test_it_checks_the_base_model_is_registered_and_enabled(team, owner):
    errors = refused(team, owner, method="rl", env="bandit", base_model="gpt-9")
    assert "not a registered base model" in errors["base_model"]
    assert "available: tiny" in errors["base_model"]
    BaseModel.objects.update(enabled=False)
    errors = refused(team, owner, method="rl", env="bandit")
    assert (
        "'tiny' is disabled" in errors["base_model"] and "available: none" in errors["base_model"]
    )
    # Both problems at once are both reported.
    errors = refused(team, owner, method="rl", env="math", base_model="gpt-9")
    assert set(errors) == {"base_model", "dataset"}


def test_it_runs_smoke_jobs_without_a_model_unless_one_is_named(team, owner):
    BaseModel.objects.all().delete()
    job = submit(team, owner, method="smoke")
    assert job.spec["base_model"] == "tiny" and job.spec["env"] is None
    errors = refused(team, owner, method="smoke", base_model="tiny")
    assert "base_model" in errors
