"""`textworld`: generated games built by scripts/build_textworld_games.py, played through
`environments.rollouts` by scripted policies (the walkthrough, "look" forever, a fatal meal);
only new text per turn; episodes that survive pickling without replaying each turn; the same
rewards inline and on a real env worker; bad settings and rows refused by name."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from environments.datasets import load_rows
from environments.envs import textworld_env
from environments.envs.textworld_env import (
    INSTRUCTIONS,
    TextWorldEpisode,
    clear_cache,
    games_root,
    parse_command,
)
from environments.registry import (
    ContractError,
    build_group,
    check_contract,
    get_env,
    group_specs,
    make_config,
    make_group_builders,
)
from environments.renderer import Renderer
from environments.rollouts import PolicyInput, run_group
from environments.types import Episode, GroupBuilder, Message

pytest.importorskip("textworld")

ROOT = Path(__file__).resolve().parents[2]
Row = dict[str, Any]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Row]]:
    """The default pool (4 train + 2 held-out games) where the env looks for it; compiled
    once per machine (~15 s on two busy cores), a rerun only replays the walkthroughs."""
    root = games_root()
    started = time.monotonic()
    log_path = tmp_path_factory.mktemp("textworld") / "build.log"
    # The build's output goes to a file the child holds, not to pipes this process reads for
    # a minute while other tests' threads run beside it.
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "scripts" / "build_textworld_games.py"),
                "--out",
                str(root),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    assert proc.wait(timeout=600) == 0, log_path.read_text(errors="replace")[-3000:]
    print(f"textworld pool ready in {time.monotonic() - started:.1f}s")
    return {
        split: [json.loads(line) for line in (root / f"{split}.jsonl").read_text().splitlines()]
        for split in ("train", "held_out")
    }


def _rows(pool: dict[str, list[Row]]) -> list[Row]:
    return pool["train"] + pool["held_out"]


def _first(pool: dict[str, list[Row]], kind: str) -> Row:
    return next(r for r in pool["train"] if r["kind"] == kind)


def _group(row: Row, group_size: int = 1, **config: Any) -> GroupBuilder:
    (builder,) = make_group_builders(
        "textworld", config=config, rows=[row], n_groups=1, group_size=group_size
    )
    return builder


def _turn(inp: PolicyInput) -> int:
    return sum(m["role"] == "assistant" for m in inp.messages)


def scripted(commands: list[str]) -> Callable[[PolicyInput], str]:
    return lambda inp: commands[_turn(inp)]


def looker(inp: PolicyInput) -> str:
    return "look"


def test_it_builds_disjoint_train_and_held_out_games(pool: dict[str, list[Row]]) -> None:
    assert [len(pool["train"]), len(pool["held_out"])] == [4, 2]
    assert {r["kind"] for r in pool["train"]} == {"cooking", "quest"}
    assert {r["kind"] for r in pool["held_out"]} == {"cooking", "quest"}
    train_seeds = {(r["kind"], r["seed"]) for r in pool["train"]}
    assert not train_seeds & {(r["kind"], r["seed"]) for r in pool["held_out"]}
    for split, rows in pool.items():
        # The files as a user uploads them: valid against the env's dataset schema.
        assert load_rows(games_root() / f"{split}.jsonl", "textworld") == rows
        for row in rows:
            assert row["split"] == split
            assert (games_root() / row["game"]).is_file()
            assert row["max_score"] >= 1 and len(row["walkthrough"]) >= 4


def test_it_pays_the_max_score_to_the_walkthrough(pool: dict[str, list[Row]]) -> None:
    for row in _rows(pool):
        trajectories = run_group(scripted(row["walkthrough"]), _group(row, 2, max_turns=16))
        for traj in trajectories:
            assert traj.error is None, traj.error
            assert [t.action_text for t in traj.turns] == row["walkthrough"]
            assert traj.total_reward == row["max_score"]
            assert set(traj.rewards_per_turn) <= {0.0, 1.0}  # one point per step of the quest
            final = traj.turns[-1]
            assert final.info["outcome"] == "won" and final.error is None
            assert final.metrics["won"] == 1.0 and final.metrics["score_fraction"] == 1.0


def test_it_gives_nothing_to_a_policy_that_only_looks(pool: dict[str, list[Row]]) -> None:
    for row in (_first(pool, "cooking"), _first(pool, "quest")):
        (traj,) = run_group(looker, _group(row, max_turns=5))
        assert traj.error is None
        assert len(traj.turns) == 5 and traj.rewards_per_turn == [0.0] * 5
        final = traj.turns[-1]
        assert final.info["outcome"] == "max_turns" and final.error == "max_turns"
        assert final.metrics["won"] == 0.0 and final.metrics["moves"] == 5.0


def test_it_ends_a_lost_game_with_the_points_so_far(pool: dict[str, list[Row]]) -> None:
    row = _first(pool, "cooking")
    take = next(c for c in row["walkthrough"] if c.startswith("take ") and " from " in c)
    ingredient = take.removeprefix("take ").split(" from ")[0]
    # Eating the raw ingredient spoils the recipe: TextWorld's cooking games are lost then.
    commands = [*row["walkthrough"][: row["walkthrough"].index(take) + 1], f"eat {ingredient}"]
    (traj,) = run_group(scripted(commands), _group(row, max_turns=16))
    assert len(traj.turns) == len(commands)
    assert traj.turns[-1].info["outcome"] == "lost"
    assert traj.turns[-1].metrics["lost"] == 1.0
    assert traj.total_reward == 1.0


@pytest.mark.parametrize("kind", ["cooking", "quest"])
def test_it_sends_only_what_is_new_each_turn(kind: str, pool: dict[str, list[Row]]) -> None:
    row = _first(pool, kind)
    (traj,) = run_group(scripted(row["walkthrough"]), _group(row, max_turns=16))
    first = traj.turns[0].observation_messages[0]["content"]
    assert first.startswith(INSTRUCTIONS + "\n\n")
    objective = first.split("\n\n")[1]
    assert "Your task is to: put the" in objective or "cook" in objective
    assert "-= " in first  # then the first room
    assert "$$" not in first and "\\$" not in first  # no ASCII banner
    later = [t.observation_messages[0]["content"] for t in traj.turns[1:]]
    assert later[0].startswith("You open the")  # both walkthroughs open a container first
    for text in [first, *later]:
        assert not re.search(r"=-\s*\d+/\d+", text)  # no status line (room, score/moves)
        assert not text.rstrip().endswith(">")  # no input prompt
        assert "Commands you can use now" not in text
    for text in later:
        assert objective not in text and INSTRUCTIONS not in text
        assert len(text) < len(first)
    assert "RESTART" not in traj.turns[-1].info["last_text"]


def test_it_lists_the_admissible_commands_when_asked(pool: dict[str, list[Row]]) -> None:
    row = _first(pool, "cooking")
    (traj,) = run_group(
        scripted(row["walkthrough"]), _group(row, max_turns=16, show_admissible=True)
    )
    assert traj.total_reward == row["max_score"]
    for turn, command in zip(traj.turns, row["walkthrough"], strict=True):
        (message,) = turn.observation_messages
        hint = message["content"].split("Commands you can use now: ")[1]
        assert command in hint.split(", ")


def test_it_normalizes_the_score_to_one_per_game_when_asked(pool: dict[str, list[Row]]) -> None:
    for row in (_first(pool, "cooking"), _first(pool, "quest")):
        (traj,) = run_group(
            scripted(row["walkthrough"]), _group(row, max_turns=16, normalize_score=True)
        )
        assert traj.total_reward == pytest.approx(1.0)
        assert max(traj.rewards_per_turn) == pytest.approx(1 / row["max_score"])


def test_it_reads_one_command_from_the_first_line_and_counts_empty_replies(
    pool: dict[str, list[Row]],
) -> None:
    assert parse_command("\n  > Open fridge\nbecause it is closed") == "open fridge"
    assert parse_command("`go east`") == "go east"
    assert parse_command("open fridge. take carrot from fridge") == "open fridge"
    assert parse_command("open  fridge then save") == "open fridge"
    assert parse_command("  \n ") == ""
    row = _first(pool, "quest")
    replies = ["", *(f"{c}\nI think this helps." for c in row["walkthrough"])]
    (traj,) = run_group(scripted(replies), _group(row, max_turns=16))
    assert traj.turns[0].error == "empty_command" and traj.turns[0].reward == 0.0
    assert traj.total_reward == 1.0 and traj.turns[-1].info["outcome"] == "won"
    assert traj.turns[-1].metrics["moves"] == len(row["walkthrough"])


def test_it_keeps_out_of_world_commands_from_the_game(
    pool: dict[str, list[Row]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left to the interpreter, "save" and "script" write files into the working directory
    and "restart" leaves TextWorld's score behind: none of them reaches the game."""
    monkeypatch.chdir(tmp_path)
    row = _first(pool, "cooking")
    meta = ["save", "script", "restart", "yes", "undo", "quit"]
    (traj,) = run_group(scripted([*meta, *row["walkthrough"]]), _group(row, max_turns=16))
    errors = [t.error for t in traj.turns]
    assert errors[:6] == ["out_of_world_command"] * 3 + [None] + ["out_of_world_command"] * 2
    assert "is not a move in this game" in traj.turns[1].observation_messages[0]["content"]
    assert traj.total_reward == row["max_score"] and traj.turns[-1].info["outcome"] == "won"
    assert traj.turns[-1].metrics["moves"] == 1 + len(row["walkthrough"])  # "yes" only
    assert list(tmp_path.iterdir()) == []


def _drive(
    episode: Episode,
    policy: Callable[[PolicyInput], str],
    between: Callable[[Episode], Episode] = lambda e: e,
) -> list[tuple[str, float]]:
    """Play an episode by hand, passing it through `between` before every step."""
    messages, stop = episode.initial_observation()
    conversation: list[Message] = list(messages)
    out = [(messages[-1]["content"], 0.0)]
    for _ in range(64):
        action = policy(PolicyInput(list(conversation), [], stop))
        episode = between(episode)
        result = episode.step(action)
        text = result.next_messages[-1]["content"] if result.next_messages else ""
        out.append((text, result.reward))
        if result.done:
            episode.close()
            return out
        conversation += [{"role": "assistant", "content": action}, *result.next_messages]
    raise AssertionError("the episode did not end")


def _roundtrip(episode: Episode) -> Episode:
    blob = pickle.dumps(episode)
    assert len(blob) < 4096  # the game, the commands and the config: no interpreter
    restored = pickle.loads(blob)
    assert isinstance(restored, TextWorldEpisode) and restored._live is None
    return restored


def test_it_rebuilds_a_pickled_episode_by_replay_only_when_the_game_is_gone(
    pool: dict[str, list[Row]],
) -> None:
    row = _first(pool, "cooking")
    # A detour first, so the replayed game must also replay commands that score nothing.
    commands = ["look", "inventory", *row["walkthrough"]]

    def fresh() -> Episode:
        return _group(row, show_admissible=True, max_turns=16).make_episodes()[0]

    reference = _drive(fresh(), scripted(commands))
    assert sum(r for _, r in reference) == row["max_score"]
    before = textworld_env.CACHE.replays
    assert _drive(fresh(), scripted(commands), _roundtrip) == reference
    assert textworld_env.CACHE.replays == before  # the live game came from the cache

    def forgetting(episode: Episode) -> Episode:
        restored = _roundtrip(episode)
        clear_cache()  # as on another env worker process
        return restored

    assert _drive(fresh(), scripted(commands), forgetting) == reference
    # Every step but the first (no command yet) rebuilt the game from its command log.
    assert textworld_env.CACHE.replays - before == len(commands) - 1


def test_it_makes_picklable_builders_whose_episodes_share_the_game(
    pool: dict[str, list[Row]],
) -> None:
    rows = pool["train"]
    a = make_group_builders("textworld", rows=rows, n_groups=3, group_size=2, seed=7)
    b = make_group_builders("textworld", rows=rows, n_groups=3, group_size=2, seed=7)
    assert pickle.dumps(a) == pickle.dumps(b)
    restored = pickle.loads(pickle.dumps(a))
    episodes = restored[0].make_episodes()
    texts = [ep.initial_observation()[0][0]["content"] for ep in episodes]
    assert len(texts) == 2 and texts[0] == texts[1]
    for ep in episodes:
        ep.close()


@pytest.mark.parametrize(
    "config, field, words",
    [
        ({"max_turns": 0}, "env_config.max_turns", "greater than or equal to 1"),
        ({"max_turns": 65}, "env_config.max_turns", "less than or equal to 64"),
        ({"show_admissible": "perhaps"}, "env_config.show_admissible", "valid boolean"),
        ({"normalize_score": [1]}, "env_config.normalize_score", "valid boolean"),
        ({"max_tokens": 0}, "env_config.max_tokens", "greater than or equal to 1"),
        ({"game": "zork1.z5"}, "env_config.game", "unknown setting"),
    ],
)
def test_it_names_the_setting_of_a_bad_config(
    config: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(ContractError) as err:
        make_config("textworld", config)
    assert err.value.field == field
    assert words in err.value.reason


@pytest.mark.parametrize(
    "game, words",
    [
        ("../db.sqlite3.z8", "without '..'"),
        ("/etc/passwd.z8", "inside the pool"),
        ("cooking-0.json", "not a compiled game"),
        ("", "must be the path"),
        (7, "must be the path"),
    ],
)
def test_it_refuses_a_row_whose_game_is_outside_the_pool(game: Any, words: str) -> None:
    with pytest.raises(ContractError) as err:
        make_group_builders("textworld", rows=[{"game": game}], n_groups=1, group_size=1)
    assert err.value.field == "row.game"
    assert words in err.value.reason


def test_it_needs_a_dataset_and_says_when_a_game_is_missing() -> None:
    with pytest.raises(ContractError) as err:
        check_contract("textworld", None)
    assert err.value.field == "dataset"
    builder = _group({"game": f"missing-{uuid.uuid4().hex}.z8"})
    (traj,) = run_group(looker, builder)
    assert traj.error is not None and "is not in the pool" in traj.error


def test_it_describes_its_settings_and_dataset() -> None:
    info = get_env("textworld").describe()
    assert (info["data_source"], info["interaction"]) == ("dataset", "multi_turn")
    assert [c["name"] for c in info["dataset_columns"]] == ["game"]
    props = info["config_schema"]["properties"]
    assert "accepts right now" in props["show_admissible"]["description"]
    assert props["max_turns"]["default"] == 8


def by_intro(rows: list[Row], **config: Any) -> Callable[[PolicyInput], str]:
    """Each game's walkthrough, told apart by its first observation: the remote path hands
    the policy the conversation only, not the row."""
    walkthroughs = {}
    for row in rows:
        episode = _group(row, **config).make_episodes()[0]
        walkthroughs[episode.initial_observation()[0][0]["content"]] = row["walkthrough"]
        episode.close()
    assert len(walkthroughs) == len(rows)

    def policy(inp: PolicyInput) -> str:
        commands = walkthroughs[inp.messages[0]["content"]]
        return commands[_turn(inp)] if _turn(inp) < len(commands) else "look"

    return policy


@pytest.mark.parametrize("policy_name", ["walkthrough", "looker"])
def test_it_plays_the_same_on_an_env_worker_as_inline(
    policy_name: str, pool: dict[str, list[Row]], env_worker: str, renderer: Renderer
) -> None:
    from environments.remote import run_group_remote

    config = {"max_turns": 10, "show_admissible": True}
    policy = by_intro(_rows(pool), **config) if policy_name == "walkthrough" else looker
    specs = group_specs("textworld", config=config, rows=_rows(pool), n_groups=6, group_size=2)
    assert len({s["row"]["game"] for s in specs}) == 6
    for spec in specs:
        remote = run_group_remote(policy, spec, renderer, timeout=120)
        inline = run_group(policy, build_group(spec), renderer)
        expected = spec["row"]["max_score"] if policy_name == "walkthrough" else 0
        for r, i in zip(remote, inline, strict=True):
            assert r.error is None, r.error
            assert r.total_reward == expected
            assert r.rewards_per_turn == i.rewards_per_turn
            assert r.tokens() == i.tokens() and r.mask() == i.mask()
