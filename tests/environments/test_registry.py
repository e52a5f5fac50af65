from __future__ import annotations

import pickle

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
    assert err.value.field == "env_config" and "n_arms" in err.value.reason
    with pytest.raises(ContractError):
        make_config("math_code", {"limits": {"isolation": "rlimit"}})
    assert make_config("math_code", {"limits": {"cpu_seconds": 3}}).limits.cpu_seconds == 3


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
