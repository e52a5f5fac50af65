"""`scienceworld`: ScienceWorld's simulator (a JVM) played through `environments.rollouts` by
scripted policies (ScienceWorld's own gold path, "look around" forever); episodes that survive
pickling and replay only where the simulator is gone; the same rewards inline and on a real
env worker; variations drawn from the chosen split; bad settings refused by name."""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from typing import Any

import pytest

from environments.envs import scienceworld_env
from environments.envs.scienceworld_env import ScienceWorldEpisode, clear_cache, gold_actions
from environments.registry import (
    ContractError,
    build_group,
    get_env,
    group_specs,
    make_config,
    make_group_builders,
)
from environments.renderer import Renderer
from environments.rollouts import PolicyInput, run_group
from environments.types import Episode, GroupBuilder

pytest.importorskip("scienceworld")
if shutil.which("java") is None:
    pytest.skip(scienceworld_env.JAVA_MISSING, allow_module_level=True)

# The simulator and the env queue do not depend on the database: the embedded pass runs it.
pytestmark = pytest.mark.once

TASK = "find-living-thing"
CONFIG = {"task": TASK, "max_turns": 24}


def _group(seed: int, group_size: int = 1, **config: Any) -> GroupBuilder:
    (builder,) = make_group_builders(
        "scienceworld", config={**CONFIG, **config}, n_groups=1, group_size=group_size, seed=seed
    )
    return builder


def _turn(inp: PolicyInput) -> int:
    return sum(m["role"] == "assistant" for m in inp.messages)


def scripted(actions: list[str]) -> Callable[[PolicyInput], str]:
    return lambda inp: actions[_turn(inp)] if _turn(inp) < len(actions) else "look around"


def looker(inp: PolicyInput) -> str:
    return "look around"


def _drive(
    episode: Episode,
    policy: Callable[[PolicyInput], str],
    between: Callable[[Episode], Episode] = lambda e: e,
) -> list[tuple[str, float]]:
    messages, stop = episode.initial_observation()
    conversation = list(messages)
    out = [(messages[-1]["content"], 0.0)]
    for _ in range(64):
        action = policy(PolicyInput(list(conversation), [], stop))
        episode = between(episode)
        result = episode.step(action)
        text = result.next_messages[-1]["content"] if result.next_messages else ""
        out.append((text, result.reward))
        if result.done:
            return out
        conversation += [{"role": "assistant", "content": action}, *result.next_messages]
    raise AssertionError("the episode did not end")


@pytest.fixture(scope="module")
def solved() -> tuple[int, list[str]]:
    """A training variation of the task and ScienceWorld's own solution of it."""
    builder = _group(seed=3)
    builder.make_episodes()[0].close()
    assert builder.variation is not None
    config = make_config("scienceworld", CONFIG)
    return builder.variation, gold_actions(config, builder.variation)


def test_it_lists_its_tasks_and_refuses_bad_settings_by_name() -> None:
    described = get_env("scienceworld").describe()
    assert len(described["choices"]["task"]) == 30 and TASK in described["choices"]["task"]
    for config, field in (
        ({"task": "fly-to-the-moon"}, "env_config.task"),
        ({"simplifications": "easy,levitation"}, "env_config.simplifications"),
        ({"split": "validation"}, "env_config.split"),
        ({"max_turns": 0}, "env_config.max_turns"),
        ({"colour": "red"}, "env_config.colour"),
    ):
        with pytest.raises(ContractError) as err:
            make_config("scienceworld", config)
        assert err.value.field == field, (config, err.value)


def test_the_gold_path_completes_the_task_and_looking_earns_next_to_nothing(
    solved: tuple[int, list[str]], renderer: Renderer
) -> None:
    _, gold = solved
    (done,) = run_group(scripted(gold), _group(seed=3), renderer)
    assert done.error is None
    assert sum(done.rewards_per_turn) == pytest.approx(1.0)
    assert any(0 < r < 1 for r in done.rewards_per_turn)  # the subgoals score on their own turns
    (idle,) = run_group(looker, _group(seed=3, max_turns=4), renderer)
    # ScienceWorld scores the first subgoal of this task (the agent's first move) to anyone.
    assert idle.total_reward < 0.1 and len(idle.rewards_per_turn) == 4


def test_it_draws_variations_from_the_split() -> None:
    config = make_config("scienceworld", CONFIG)
    train = {scienceworld_env.variation_of(config, seed) for seed in range(40)}
    test_config = make_config("scienceworld", {**CONFIG, "split": "test"})
    test = {scienceworld_env.variation_of(test_config, seed) for seed in range(40)}
    assert len(train) > 1 and len(test) > 1 and not train & test


def _roundtrip(episode: Episode) -> Episode:
    blob = pickle.dumps(episode)
    assert len(blob) < 4096  # the task, the variation and the actions: no JVM
    restored = pickle.loads(blob)
    assert isinstance(restored, ScienceWorldEpisode) and restored._live is None
    return restored


def test_it_rebuilds_a_pickled_episode_by_replay_only_when_the_simulator_is_gone(
    solved: tuple[int, list[str]],
) -> None:
    _, gold = solved
    actions = ["look around", *gold[:5]]

    def fresh() -> Episode:
        return _group(seed=3, max_turns=len(actions)).make_episodes()[0]

    reference = _drive(fresh(), scripted(actions))
    before = scienceworld_env.CACHE.replays
    assert _drive(fresh(), scripted(actions), _roundtrip) == reference
    assert scienceworld_env.CACHE.replays == before  # the live simulator came from the cache

    def forgetting(episode: Episode) -> Episode:
        restored = _roundtrip(episode)
        clear_cache()  # as on another env worker process
        return restored

    assert _drive(fresh(), scripted(actions), forgetting) == reference
    assert scienceworld_env.CACHE.replays - before == len(actions) - 1


@pytest.mark.parametrize("policy_name", ["gold", "looker"])
def test_it_plays_the_same_on_an_env_worker_as_inline(
    policy_name: str, solved: tuple[int, list[str]], env_worker: str, renderer: Renderer
) -> None:
    from environments.remote import run_group_remote

    (spec,) = group_specs("scienceworld", config=CONFIG, n_groups=1, group_size=2, seed=3)
    config = make_config("scienceworld", CONFIG)
    variation = scienceworld_env.variation_of(config, spec["seed"])
    gold = solved[1] if variation == solved[0] else gold_actions(config, variation)
    policy = scripted(gold) if policy_name == "gold" else looker
    remote = run_group_remote(policy, spec, renderer, timeout=180)
    inline = run_group(policy, build_group(spec), renderer)
    for r, i in zip(remote, inline, strict=True):
        assert r.error == i.error
        assert (r.total_reward == pytest.approx(1.0)) == (policy_name == "gold")
        assert r.rewards_per_turn == i.rewards_per_turn
        assert r.tokens() == i.tokens() and r.mask() == i.mask()
