"""Hydra-style overrides onto a YAML spec, type-checked against the shipped JobSpec schema,
and the server's own validation of what they produce."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opentinker.errors import SpecError
from opentinker.spec import apply_overrides, check_spec, load_yaml, shipped_schema

RL = {"method": "rl", "env": "math"}


def test_it_sets_nested_keys_with_yaml_typed_values() -> None:
    spec = apply_overrides(
        RL,
        [
            "rollout.group_size=8",
            "optimizer.lr=3e-4",
            "optimizer.grad_clip=null",
            "lora.target_modules=[q_proj, v_proj]",
            "full_finetune=false",
            "env_config.anything.nested=2",
            "steps=20",
        ],
    )
    assert spec == {
        "method": "rl",
        "env": "math",
        "rollout": {"group_size": 8},
        "optimizer": {"lr": 3e-4, "grad_clip": None},
        "lora": {"target_modules": ["q_proj", "v_proj"]},
        "full_finetune": False,
        "env_config": {"anything": {"nested": 2}},
        "steps": 20,
    }
    # The input is left alone.
    assert RL == {"method": "rl", "env": "math"}


def test_it_keeps_text_for_string_fields_and_overrides_the_file(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("method: rl\nenv: math\nrollout:\n  group_size: 4\n  max_tokens: 16\n")
    spec = apply_overrides(load_yaml(path), ["dataset=2024", "rollout.group_size=2"])
    assert spec["dataset"] == "2024"
    assert spec["rollout"] == {"group_size": 2, "max_tokens": 16}


def test_the_result_is_accepted_by_the_servers_spec_model() -> None:
    from jobs.spec import parse_spec

    spec = apply_overrides(RL, ["rollout.group_size=8", "optimizer.lr=3e-4", "lora.rank=8"])
    parsed = parse_spec(spec)
    assert parsed.rollout.group_size == 8 and parsed.optimizer.lr == 3e-4


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "rollout.group_sise=8",
            "unknown key 'rollout.group_sise'; did you mean 'rollout.group_size'?",
        ),
        ("lr=1e-3", "unknown key 'lr'; did you mean 'optimizer.lr'?"),
        (
            "optimizer.learning_rate=1",
            "known keys under optimizer: betas, grad_clip, lr, weight_decay",
        ),
        ("steps=many", 'bad value for steps: expected an integer, got "many"'),
        ("steps=0", "bad value for steps: must be >= 1, got 0"),
        ("seed=1.5", "bad value for seed: expected an integer, got 1.5"),
        ("method=ppo", 'bad value for method: expected one of "smoke", "rl", "sft"'),
        ("full_finetune=maybe", "bad value for full_finetune: expected true or false"),
        ("rollout=3", "bad value for rollout: expected a mapping, got 3"),
        (
            "base_model.name=x",
            "unknown key 'base_model.name': base_model is a string, not a mapping",
        ),
        ("rollout.group_size", "is not key=value"),
        ("rollout..group_size=2", "empty part in key"),
        ("optimizer.lr=0", "bad value for optimizer.lr: must be > 0, got 0"),
    ],
)
def test_it_rejects_bad_overrides_with_a_helpful_message(override: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        apply_overrides(RL, [override])
    assert message in str(info.value)


def test_it_names_the_field_of_a_rejected_override() -> None:
    with pytest.raises(SpecError) as info:
        apply_overrides(RL, ["rollout.temperature=hot"])
    assert info.value.errors == [
        {"field": "rollout.temperature", "reason": 'expected a number, got "hot"'}
    ]


def test_it_checks_a_whole_spec_file() -> None:
    assert check_spec({"method": "smoke", "smoke_steps": 3}) == []
    assert check_spec({"method": "smoke", "smoke_step": 3, "rollout": {"group_size": "x"}}) == [
        {"field": "smoke_step", "reason": "unknown key; did you mean 'smoke_steps'?"},
        {"field": "rollout", "reason": 'group_size: expected an integer, got "x"'},
    ]


def test_it_refuses_spec_files_that_are_not_mappings(tmp_path: Path) -> None:
    listed = tmp_path / "list.yaml"
    listed.write_text("- method: smoke\n")
    with pytest.raises(SpecError, match="a job spec is a mapping"):
        load_yaml(listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("method: [smoke\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_yaml(broken)
    with pytest.raises(SpecError, match="cannot read"):
        load_yaml(tmp_path / "absent.yaml")


def test_the_shipped_schema_is_a_json_schema_of_the_jobspec() -> None:
    schema = shipped_schema()
    assert schema["title"] == "JobSpec"
    assert schema["additionalProperties"] is False
    assert {"method", "rollout", "lora", "optimizer"} <= set(schema["properties"])


def test_a_spec_is_read_as_json_data_dates_as_text(tmp_path: Path, cli: Callable[..., Any]) -> None:
    # YAML reads 2024-05-01 as a date, which json (and so the request) could not encode.
    dated = tmp_path / "dated.yaml"
    dated.write_text("method: rl\nenv: math\ndataset: 2024-05-01\nenv_config: {t: 2024-05-01}\n")
    spec = load_yaml(dated)
    assert spec["dataset"] == "2024-05-01" and spec["env_config"] == {"t": "2024-05-01"}
    assert check_spec(spec) == []
    assert apply_overrides(RL, ["dataset=2024-06-01"])["dataset"] == "2024-06-01"
    printed = cli("submit", str(dated), "env_config.when=2024-06-01", "--dry-run")
    assert printed.exit_code == 0, printed.stderr
    assert printed.json()["env_config"] == {"t": "2024-05-01", "when": "2024-06-01"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1: x\n", "1: a key must be text (quote it)"),
        ("rollout: {1: 2}\n", "rollout.1: a key must be text (quote it)"),
        ("env_config: {t: [1, .nan]}\n", "env_config.t[1]: nan is not a number JSON can carry"),
        ("env_config: {t: .inf}\n", "env_config.t: inf is not a number JSON can carry"),
        ("dataset: !!binary aGVsbG8=\n", "dataset: a YAML bytes value is not JSON data"),
    ],
)
def test_what_json_cannot_carry_is_one_line_naming_the_field(
    tmp_path: Path, cli: Callable[..., Any], text: str, message: str
) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("method: rl\n" + text)
    result = cli("submit", str(path), "--dry-run")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {path}: {message}"


def test_an_override_json_cannot_carry_is_refused() -> None:
    with pytest.raises(SpecError) as info:
        apply_overrides(RL, ["env_config.x=.nan"])
    assert str(info.value) == "bad value for env_config.x: nan is not a number JSON can carry"
    assert info.value.errors == [
        {"field": "env_config.x", "reason": "nan is not a number JSON can carry"}
    ]
