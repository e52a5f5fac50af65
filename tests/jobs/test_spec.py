"""JobSpec v1: defaults, bounds, strictness, versioning, field-named errors."""

from __future__ import annotations

import pytest

from jobs.spec import CURRENT_VERSION, JobSpec, SpecError, parse_spec


def fields(exc: pytest.ExceptionInfo[SpecError]) -> list[str]:
    return [e["field"] for e in exc.value.errors]


def test_it_fills_in_defaults():
    spec = parse_spec({"method": "smoke"})
    assert isinstance(spec, JobSpec)
    assert spec.version == CURRENT_VERSION == 1
    assert (spec.base_model, spec.gpus, spec.smoke_steps, spec.smoke_step_seconds) == (
        "tiny",
        1,
        5,
        0.5,
    )
    assert spec.env is None and spec.dataset is None
    dumped = spec.model_dump(mode="json")
    assert parse_spec(dumped) == spec


@pytest.mark.parametrize(
    "data, field",
    [
        ({"method": "smoke", "gpus": 0}, "gpus"),
        ({"method": "smoke", "gpus": 65}, "gpus"),
        ({"method": "smoke", "gpus": "2"}, "gpus"),
        ({"method": "smoke", "gpus": True}, "gpus"),
        ({"method": "smoke", "priority": 101}, "priority"),
        ({"method": "smoke", "max_runtime_s": 7 * 86400 + 1}, "max_runtime_s"),
        ({"method": "smoke", "max_runtime_s": 0}, "max_runtime_s"),
        ({"method": "smoke", "smoke_steps": 1001}, "smoke_steps"),
        ({"method": "smoke", "smoke_step_seconds": 61}, "smoke_step_seconds"),
        ({"method": "smoke", "smoke_step_seconds": -1}, "smoke_step_seconds"),
        ({"method": "rl", "smoke_steps": 3}, "smoke_steps"),
        ({"method": "dpo"}, "method"),
        ({}, "method"),
        ({"method": "smoke", "gpu": 2}, "gpu"),
        ({"method": "smoke", "env": ""}, "env"),
        ({"method": "smoke", "version": 2}, "version"),
        ({"method": "smoke", "version": "1"}, "version"),
        ({"method": "rl"}, "env"),
        ({"method": "sft", "dataset": "arith"}, "env"),
        ({"method": "smoke", "dataset": "arith"}, "dataset"),
    ],
)
def test_it_names_the_offending_field(data, field):
    with pytest.raises(SpecError) as exc:
        parse_spec(data)
    assert field in fields(exc)
    assert all(e["reason"] for e in exc.value.errors)


def test_it_refuses_a_non_object():
    with pytest.raises(SpecError) as exc:
        parse_spec(["method", "smoke"])
    assert exc.value.errors == [{"field": "", "reason": "the spec must be a JSON object"}]


def test_it_accepts_integer_seconds_and_full_specs():
    spec = parse_spec(
        {
            "version": 1,
            "method": "rl",
            "base_model": "tiny",
            "env": "arith",
            "dataset": "arith-train",
            "gpus": 4,
            "priority": 90,
            "max_runtime_s": 600,
        }
    )
    assert spec.gpus == 4 and spec.env == "arith"
    assert parse_spec({"method": "smoke", "smoke_step_seconds": 1}).smoke_step_seconds == 1.0
