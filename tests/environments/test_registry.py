from __future__ import annotations

import pickle
from typing import Any

import pytest

from environments.registry import (
    ContractError,
    check_contract,
    env_names,
    get_env,
    make_config,
    make_group_builders,
)
from environments.types import DataSource, Interaction


def test_it_declares_the_2x2_cell_of_every_builtin_env() -> None:
    cells = {name: get_env(name).cell for name in env_names()}
    assert cells["math"] == ("dataset", "single_turn")
    assert cells["math_code"] == ("dataset", "multi_turn")
    assert cells["bandit"] == ("generator", "single_turn")
    assert cells["gomoku"] == ("generator", "multi_turn")
    assert get_env("gomoku_selfplay").interaction is Interaction.MULTI_TURN


def test_it_refuses_a_dataset_for_a_generator_env() -> None:
    with pytest.raises(ContractError) as err:
        check_contract("bandit", "builtin:arith_train")
    assert err.value.field == "dataset"
    assert err.value.reason == "env 'bandit' is a generator environment and takes no dataset"


def test_it_refuses_a_dataset_env_without_a_dataset() -> None:
    for missing in (None, "", "  ", []):
        with pytest.raises(ContractError) as err:
            check_contract("math", missing)
        assert err.value.as_dict() == {
            "field": "dataset",
            "reason": "env 'math' reads a dataset: give `dataset`",
        }


def test_it_accepts_matching_contracts() -> None:
    check_contract("math", "builtin:arith_train")
    check_contract("math_code", [{"question": "q", "answer": "1"}])
    check_contract("bandit", None)
    check_contract("gomoku")


def test_it_names_unknown_envs() -> None:
    with pytest.raises(ContractError) as err:
        check_contract("chess", None)
    assert err.value.field == "env"
    assert "unknown environment 'chess'" in err.value.reason
    assert "math" in err.value.reason


def test_it_rejects_unknown_and_bad_config_keys() -> None:
    with pytest.raises(ContractError) as err:
        make_config("bandit", {"arms": 3})
    assert err.value.field == "env_config.arms"
    with pytest.raises(ContractError) as err:
        make_config("bandit", {"n_arms": 1})
    assert (
        err.value.field == "env_config.n_arms" and "greater than or equal to 2" in err.value.reason
    )
    with pytest.raises(ContractError):
        make_config("math_code", {"limits": {"isolation": "rlimit"}})
    assert make_config("math_code", {"limits": {"cpu_seconds": 3}}).limits.cpu_seconds == 3


@pytest.mark.parametrize(
    "env, config, field, reason",
    [
        ("bandit", {"n_arms": "x"}, "env_config.n_arms", "valid integer"),
        ("bandit", {"n_arms": 101}, "env_config.n_arms", "less than or equal to 100"),
        ("bandit", {"max_tokens": True}, "env_config.max_tokens", "valid integer"),
        ("math", {"max_tokens": "x"}, "env_config.max_tokens", "valid integer"),
        ("math", {"system_prompt": 5}, "env_config.system_prompt", "valid string"),
        ("math", {"format_reward": "lots"}, "env_config.format_reward", "valid number"),
        ("math", {"max_tokens": 0}, "env_config.max_tokens", "greater than or equal to 1"),
        ("math_code", {"format_reward": [1]}, "env_config.format_reward", "valid number"),
        ("math_code", {"max_turns": 0}, "env_config.max_turns", "greater than or equal to 1"),
        ("math_code", {"max_output_chars": "9"}, "env_config.max_output_chars", "integer"),
        ("math_code", {"limits": {"cpu_seconds": "3"}}, "env_config.limits", "an integer"),
        ("math_code", {"limits": {"wall_seconds": 60}}, "env_config.limits", "(0, 30]"),
        ("math_code", {"limits": [1]}, "env_config.limits", "SandboxLimits"),
        ("geometry", {"prompt_suffix": None}, "env_config.prompt_suffix", "valid string"),
        ("geometry", {"format_reward": float("nan")}, "env_config.format_reward", "finite"),
        ("gomoku", {"size": "7"}, "env_config.size", "valid integer"),
        ("gomoku", {"win_length": 6}, "env_config.win_length", "at most size (5)"),
        ("gomoku", {"model_mark": "Z"}, "env_config.model_mark", "'X', 'O' or 'random'"),
        ("gomoku", {"opponent_noise": 1.5}, "env_config.opponent_noise", "less than or equal"),
        ("gomoku_selfplay", {"move_timeout_s": 0}, "env_config.move_timeout_s", "greater than"),
    ],
)
def test_it_checks_builtin_config_types_and_ranges(
    env: str, config: dict[str, Any], field: str, reason: str
) -> None:
    with pytest.raises(ContractError) as err:
        make_config(env, config)
    assert err.value.field == field and reason in err.value.reason, err.value.as_dict()


def test_it_names_every_bad_setting_of_a_config() -> None:
    with pytest.raises(ContractError) as err:
        make_config("math", {"max_tokens": "x", "system_prompt": 5})
    assert {f for f, _ in err.value.problems()} == {
        "env_config.max_tokens",
        "env_config.system_prompt",
    }


def test_it_builds_builtin_configs_from_json_numbers() -> None:
    # JSON has one number type: an integer where a float is expected is fine.
    assert make_config("math", {"format_reward": 1}).format_reward == 1.0
    gomoku = make_config("gomoku", {"size": 7, "win_length": 5, "model_mark": "random"})
    assert (gomoku.size, gomoku.win_length, gomoku.model_mark) == (7, 5, "random")


def test_it_makes_picklable_reproducible_builders() -> None:
    rows = [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(10)]
    for name, kwargs in (
        ("math", {"rows": rows}),
        ("math_code", {"rows": rows}),
        ("bandit", {}),
        ("gomoku", {}),
        ("gomoku_selfplay", {}),
    ):
        a = make_group_builders(name, n_groups=3, group_size=4, seed=7, **kwargs)
        b = make_group_builders(name, n_groups=3, group_size=4, seed=7, **kwargs)
        assert len(a) == 3
        assert pickle.dumps(a) == pickle.dumps(b)
        restored = pickle.loads(pickle.dumps(a))
        assert len(restored[0].make_episodes()) == 4
    assert get_env("math").data_source is DataSource.DATASET


def test_it_describes_envs_as_json() -> None:
    info = get_env("math").describe()
    assert info["dataset_columns"][0]["name"] == "question"
    assert info["config_schema"]["properties"]["format_reward"]["default"] == 0.0
    assert get_env("bandit").describe()["dataset_columns"] is None
