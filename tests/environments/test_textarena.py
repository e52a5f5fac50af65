"""`textarena`: real TextArena games played through `environments.rollouts` by scripted
policies (legal, winning, or hopeless), against the game, a random opponent or in self-play;
only new text per turn; episodes that survive pickling without replaying each turn; the same
rewards inline and on a real env worker."""

from __future__ import annotations

import pickle
import random
import re
from collections.abc import Callable
from typing import Any

import pytest

from environments.envs import textarena_env
from environments.envs.textarena_env import GAMES, TextArenaEpisode, clear_cache, game_names
from environments.envs.textarena_seats import (
    TextArenaSelfPlayGroupBuilder,
    TextArenaSnapshotGroupBuilder,
)
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
from environments.types import Episode, GroupBuilder, Message

pytest.importorskip("textarena")


def _group(game: str, group_size: int = 1, seed: int = 2, **config: Any) -> GroupBuilder:
    (builder,) = make_group_builders(
        "textarena", config={"game": game, **config}, n_groups=1, group_size=group_size, seed=seed
    )
    return builder


def _seen(inp: PolicyInput) -> str:
    return "\n".join(m["content"] for m in inp.messages if m["role"] == "user")


def _quoted_moves(inp: PolicyInput, label: str) -> list[str]:
    """The moves the game lists last, e.g. "Available Moves: '[0]', '[4]'"."""
    lists = re.findall(label + r"[^\n]*", _seen(inp))
    return re.findall(r"'(\[[^']*\])'", lists[-1]) if lists else []


def first_listed(inp: PolicyInput) -> str:
    moves = _quoted_moves(inp, "Available Moves:") or _quoted_moves(inp, "available actions are:")
    return moves[0]


def optimal_nim(inp: PolicyInput) -> str:
    board = re.findall(r"Current Pile:\n((?:  pile \d+: \d+\n?)+)", _seen(inp))[-1]
    piles = [int(n) for n in re.findall(r"pile \d+: (\d+)", board)]
    total = 0
    for n in piles:
        total ^= n
    for i, n in enumerate(piles):
        if total and n ^ total < n:
            return f"[{i} {n - (n ^ total)}]"
    return next(f"[{i} 1]" for i, n in enumerate(piles) if n)


def binary_search(inp: PolicyInput) -> str:
    lo, hi = 1, 20
    guesses = [m["content"] for m in inp.messages if m["role"] == "assistant"]
    hints = [m["content"] for m in inp.messages if m["role"] == "user"][1:]
    for guess, hint in zip(guesses, hints):
        g = int(guess.strip("[]"))
        if "higher" in hint:
            lo = g + 1
        elif "lower" in hint:
            hi = g - 1
    return f"[{(lo + hi) // 2}]"


HANOI = ["[A C]", "[A B]", "[C B]", "[A C]", "[B A]", "[B C]", "[A C]"]


def hanoi(inp: PolicyInput) -> str:
    return HANOI[sum(m["role"] == "assistant" for m in inp.messages)]


def hopeless(inp: PolicyInput) -> str:
    return "I would rather not play"


@pytest.mark.parametrize("game", game_names())
def test_it_ends_every_allowed_game_of_a_policy_that_never_moves(game: str) -> None:
    (traj,) = run_group(hopeless, _group(game))
    assert traj.error is None
    assert [t.error for t in traj.turns] == ["illegal_move"] * len(traj.turns)
    assert 1 <= len(traj.turns) <= 3
    assert traj.turns[0].reward == pytest.approx(-0.1)
    final = traj.turns[-1]
    if GAMES[game].players == 2:
        assert final.info["outcome"] == "loss" and final.reward == pytest.approx(-1.1)
    else:
        assert final.info["outcome"] == "unsolved" and final.metrics["solved"] == 0.0


@pytest.mark.parametrize(
    "game, policy, expected",
    [
        ("GuessTheNumber-v0", binary_search, 1.0),
        ("TowerOfHanoi-v0", hanoi, 1.0),
        ("Nim-v0", optimal_nim, 1.0),  # 3 ^ 4 ^ 5 != 0: the first mover wins with xor play
    ],
)
def test_it_rewards_a_policy_that_plays_to_win(
    game: str, policy: Callable[[PolicyInput], str], expected: float
) -> None:
    for seed in (1, 2, 3):
        trajectories = run_group(policy, _group(game, group_size=2, seed=seed))
        for traj in trajectories:
            assert traj.error is None
            assert [t.error for t in traj.turns] == [None] * len(traj.turns)
            assert traj.rewards_per_turn[:-1] == [0.0] * (len(traj.turns) - 1)
            assert traj.rewards_per_turn[-1] == expected
            assert traj.turns[-1].metrics["illegal_moves"] == 0.0


def test_it_reads_the_last_boxed_move_with_the_boxed_action_format() -> None:
    def boxed_nim(inp: PolicyInput) -> str:
        return f"I take \\boxed{{9 9}} no, \\boxed{{{optimal_nim(inp)[1:-1]}}}"

    (traj,) = run_group(boxed_nim, _group("Nim-v0", action_format="boxed"))
    assert [t.error for t in traj.turns] == [None] * len(traj.turns)
    assert traj.rewards_per_turn[-1] == 1.0
    # Without a boxed move, TextArena's own rule applies; the default format never looks
    # inside \\boxed{}.
    (unboxed,) = run_group(
        lambda inp: optimal_nim(inp)[1:-1], _group("Nim-v0", action_format="boxed")
    )
    assert unboxed.turns[0].error is None and unboxed.rewards_per_turn[-1] == 1.0
    (default,) = run_group(boxed_nim, _group("Nim-v0"))
    assert default.turns[0].error == "illegal_move"


def test_the_demonstration_rows_are_the_envs_own_observations_and_legal_moves() -> None:
    rows = textarena_env.demonstration_rows("Nim-v0", games=3, seed=5, model_seat=0)
    assert rows == textarena_env.demonstration_rows("Nim-v0", games=3, seed=5, model_seat=0)
    with pytest.raises(ValueError, match="two-player"):
        textarena_env.demonstration_rows("Sudoku-v0", games=1, seed=0, model_seat=0)
    first = TextArenaEpisode(textarena_env.TextArenaConfig(game="Nim-v0"), 5)
    assert rows[0]["question"] == first.initial_observation()[0][-1]["content"]
    # Replaying a game's answers through the env accepts every one of them, and
    replay = TextArenaEpisode(
        textarena_env.TextArenaConfig(game="Nim-v0", action_format="boxed"), 5
    )
    # each row's context is the conversation an RL rollout of that game holds at that turn.
    conversation = replay.initial_observation()[0]
    for i, row in enumerate(rows):
        assert [
            *row.get("context", []),
            {"role": "user", "content": row["question"]},
        ] == conversation
        reply = f"\\boxed{{{row['answer']}}}"
        result = replay.step(reply)
        assert result.error is None
        if result.done:
            break
        assert result.next_messages[-1]["content"] == rows[i + 1]["question"]
        conversation += [{"role": "assistant", "content": reply}, *result.next_messages]


def test_text_format_demonstrations_teach_the_move_as_the_game_asks_for_it() -> None:
    rows = textarena_env.demonstration_rows(
        "KuhnPoker-v0-1round", games=4, seed=3, model_seat=0, action_format="text"
    )
    with pytest.raises(ValueError, match="action_format"):
        textarena_env.demonstration_rows("Nim-v0", games=1, seed=0, model_seat=0, action_format="x")
    config = textarena_env.TextArenaConfig(game="KuhnPoker-v0-1round", action_format="text")
    replay = TextArenaEpisode(config, 3)
    conversation = replay.initial_observation()[0]
    for row in rows:
        assert row["completion"] == f"[{row['answer']}]"
        assert [*row.get("context", []), {"role": "user", "content": row["question"]}] == (
            conversation
        )
        result = replay.step(row["completion"])
        assert result.error is None
        if result.done:
            break
        conversation += [{"role": "assistant", "content": row["completion"]}, *result.next_messages]


@pytest.mark.parametrize("game", ["TicTacToe-v0", "KuhnPoker-v0"])
def test_it_plays_legal_moves_against_the_random_opponent(game: str) -> None:
    outcomes = set()
    for seed in range(6):
        for seat in (0, 1):
            (traj,) = run_group(first_listed, _group(game, seed=seed, model_seat=seat))
            assert traj.error is None
            assert all(t.error is None for t in traj.turns)
            assert traj.total_reward in (-1.0, 0.0, 1.0)
            assert traj.turns[-1].info["seat"] == seat
            outcomes.add(traj.turns[-1].info["outcome"])
    # The opponent is random, and it is an opponent: the model neither always wins nor loses.
    assert len(outcomes) >= 2


def kuhn_by_card(inp: PolicyInput) -> str:
    """Bet or call with the king, check or fold otherwise."""
    card = re.findall(r"Your card is: '([JQK])'", _seen(inp))[-1]
    moves = _quoted_moves(inp, "available actions are:")
    wanted = ["[bet]", "[call]"] if card == "K" else ["[check]", "[fold]"]
    return next(m for m in wanted if m in moves)


def test_the_one_round_kuhn_poker_ends_after_one_deal_and_a_king_always_wins_it() -> None:
    cards = []
    for seed in range(12):
        (traj,) = run_group(kuhn_by_card, _group("KuhnPoker-v0-1round", seed=seed))
        assert traj.error is None and all(t.error is None for t in traj.turns)
        seen = "\n".join(
            m["content"] for m in traj.turns[0].observation_messages if m["role"] == "user"
        )
        assert "in a 1 round game of Kuhn Poker" in seen
        assert 1 <= len(traj.turns) <= 2
        card = re.findall(r"Your card is: '([JQK])'", seen)[-1]
        cards.append(card)
        if card == "K":
            assert traj.total_reward == 1.0
        assert traj.total_reward in (-1.0, 1.0)
    assert set(cards) == {"J", "Q", "K"}


def test_it_sends_only_what_is_new_each_turn() -> None:
    (traj,) = run_group(first_listed, _group("TicTacToe-v0", model_seat=0))
    first, second = (t.observation_messages[0]["content"] for t in traj.turns[:2])
    assert "You are Player 0 in Tic Tac Toe" in first
    assert "You are Player 0" not in second and "Your goal is" not in second
    assert "[Player 0]" not in second  # the model's own move is in its context already
    assert "[Player 1]" in second and second.count("Current Board") == 2
    assert len(second) < len(first) + 400


def test_without_the_rules_the_first_observation_is_the_game_itself() -> None:
    (full,) = run_group(first_listed, _group("TicTacToe-v0", model_seat=0))
    (bare,) = run_group(first_listed, _group("TicTacToe-v0", model_seat=0, rules=False))
    with_rules = full.turns[0].observation_messages[0]["content"]
    without = bare.turns[0].observation_messages[0]["content"]
    assert "You are Player 0 in Tic Tac Toe" in with_rules
    assert "You are Player 0" not in without and "Current Board" in without
    assert with_rules.endswith(without) and len(without) < len(with_rules) - 200
    # The same game from there on: the same moves, replies and reward.
    assert [t.action_text for t in bare.turns] == [t.action_text for t in full.turns]
    later = [[m["content"] for m in t.observation_messages] for t in bare.turns[1:]]
    assert later == [[m["content"] for m in t.observation_messages] for t in full.turns[1:]]
    assert bare.total_reward == full.total_reward
    selfplay = run_group(
        first_listed, _group("TicTacToe-v0", group_size=2, opponent="selfplay", rules=False)
    )
    assert all(
        "You are Player" not in t.turns[0].observation_messages[0]["content"] for t in selfplay
    )
    rows = textarena_env.demonstration_rows("Nim-v0", games=1, seed=0, model_seat=0, rules=False)
    assert "You are Player" not in rows[0]["question"]


def test_it_plays_both_seats_in_self_play_with_each_seats_reward() -> None:
    builder = _group("TicTacToe-v0", group_size=4, opponent="selfplay")
    assert isinstance(builder, TextArenaSelfPlayGroupBuilder) and builder.concurrent
    trajectories = run_group(first_listed, builder)
    assert len(trajectories) == 4
    # First-listed play: O (seat 0) takes 0, 2, 4, 6 and wins on the diagonal.
    for seat0, seat1 in (trajectories[0:2], trajectories[2:4]):
        assert seat0.error is None and seat1.error is None
        assert seat0.total_reward == 1.0 and seat1.total_reward == -1.0
        assert seat0.turns[-1].info["seat"] == 0 and seat1.turns[-1].info["seat"] == 1
        assert [t.action_text for t in seat0.turns] == ["[0]", "[2]", "[4]", "[6]"]
        assert [t.action_text for t in seat1.turns] == ["[1]", "[3]", "[5]", "[6]"][
            : len(seat1.turns)
        ]
    nim = run_group(optimal_nim, _group("Nim-v0", group_size=2, opponent="selfplay"))
    assert nim[0].total_reward == 1.0 and nim[1].total_reward == -1.0


def test_it_plays_a_frozen_opponent_and_returns_only_the_learners_episodes() -> None:
    builder = _group("TicTacToe-v0", group_size=3, opponent="snapshot")
    assert isinstance(builder, TextArenaSnapshotGroupBuilder) and builder.concurrent
    assert builder.opponent_episodes() == {1, 3, 5}
    # An opponent that never makes a legal move forfeits: every learner game is a win.
    won = run_group(first_listed, builder, opponent_fn=hopeless)
    assert len(won) == 3
    for traj in won:
        assert traj.error is None and traj.total_reward == 1.0
        assert traj.turns[-1].info["seat"] == 0 and traj.turns[-1].info["outcome"] == "win"
    # Seat 1 against the same first-listed play as its own: O (seat 0) wins on the diagonal.
    lost = run_group(
        first_listed,
        _group("TicTacToe-v0", group_size=2, opponent="snapshot", model_seat=1),
        opponent_fn=first_listed,
    )
    assert [t.total_reward for t in lost] == [-1.0, -1.0]
    assert [t.action_text for t in lost[0].turns] == ["[1]", "[3]", "[5]"]
    assert lost[0].turns[-1].info["seat"] == 1
    # The learner seat "random" is drawn once per group from its seed.
    seats = {
        _group("Nim-v0", seed=s, opponent="snapshot", model_seat="random").learner_seat()
        for s in range(8)
    }
    assert seats == {0, 1}
    with pytest.raises(ValueError, match="frozen opponent"):
        run_group(first_listed, builder)


def test_it_penalises_an_illegal_move_in_self_play_and_lets_the_seat_retry() -> None:
    def policy(inp: PolicyInput) -> str:
        text = _seen(inp)
        if "You are Player 1" in text and "attempted an invalid move" not in text:
            return "[0]"  # taken by seat 0's first move
        return first_listed(inp)

    seat0, seat1 = run_group(policy, _group("TicTacToe-v0", group_size=2, opponent="selfplay"))
    assert seat1.turns[0].error == "illegal_move" and seat1.turns[0].reward == pytest.approx(-0.1)
    assert seat1.turns[1].error is None
    assert seat0.total_reward == 1.0 and seat1.total_reward == pytest.approx(-1.1)


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
            return out
        conversation += [{"role": "assistant", "content": action}, *result.next_messages]
    raise AssertionError("the episode did not end")


def _roundtrip(episode: Episode) -> Episode:
    restored = pickle.loads(pickle.dumps(episode))
    assert isinstance(restored, TextArenaEpisode) and restored._live is None
    return restored


def _cells() -> Callable[[PolicyInput], str]:
    cells = iter([f"[{r} {c}]" for r in range(8) for c in range(8)])
    return lambda inp: next(cells)


@pytest.mark.parametrize(
    "game, make_policy", [("KuhnPoker-v0", lambda: first_listed), ("Minesweeper-v0", _cells)]
)
def test_it_rebuilds_a_pickled_episode_by_replay_only_when_the_game_is_gone(
    game: str, make_policy: Callable[[], Callable[[PolicyInput], str]]
) -> None:
    """KuhnPoker deals again each round and Minesweeper lays its mines on the first reveal:
    both draw randomness mid-game, so a replay must land on the very same state."""

    def fresh() -> Episode:
        return _group(game, seed=5).make_episodes()[0]

    reference = _drive(fresh(), make_policy())
    assert len(reference) > 2
    before = textarena_env.CACHE.replays
    assert _drive(fresh(), make_policy(), _roundtrip) == reference
    assert textarena_env.CACHE.replays == before  # the live game came from the cache

    def forgetting(episode: Episode) -> Episode:
        restored = _roundtrip(episode)
        clear_cache()  # as on another env worker process
        return restored

    assert _drive(fresh(), make_policy(), forgetting) == reference
    assert textarena_env.CACHE.replays - before == len(reference) - 1


def test_it_keeps_each_games_randomness_to_itself() -> None:
    def transcript(seed: int) -> list[tuple[str, float]]:
        return _drive(_group("KuhnPoker-v0", seed=seed).make_episodes()[0], first_listed)

    alone = [transcript(seed) for seed in (11, 12)]
    # Interleave the two games step by step in one thread.
    episodes = [_group("KuhnPoker-v0", seed=s).make_episodes()[0] for s in (11, 12)]
    logs: list[list[tuple[str, float]]] = [[], []]
    convs: list[list[Message]] = [[], []]
    stops = []
    for i, ep in enumerate(episodes):
        messages, stop = ep.initial_observation()
        convs[i] = list(messages)
        logs[i].append((messages[-1]["content"], 0.0))
        stops.append(stop)
    live = [0, 1]
    random.seed(1234)
    expected_global = random.Random(1234).random()
    while live:
        for i in list(live):
            action = first_listed(PolicyInput(list(convs[i]), [], stops[i]))
            result = episodes[i].step(action)
            text = result.next_messages[-1]["content"] if result.next_messages else ""
            logs[i].append((text, result.reward))
            convs[i] += [{"role": "assistant", "content": action}, *result.next_messages]
            if result.done:
                live.remove(i)
    assert logs == alone
    assert random.random() == expected_global  # the caller's random stream is untouched


@pytest.mark.parametrize(
    "config, field, words",
    [
        ({"game": "Chess-v0"}, "env_config.game", "is not offered"),
        ({"game": "Wordle-v0"}, "env_config.game", "TicTacToe-v0"),
        (
            {"game": "GuessTheNumber-v0", "opponent": "selfplay"},
            "env_config.opponent",
            "one-player",
        ),
        ({"opponent": "frozen"}, "env_config.opponent", "'selfplay' or 'snapshot'"),
        (
            {"game": "Mastermind-v0", "opponent": "snapshot"},
            "env_config.opponent",
            "no seat for snapshot",
        ),
        (
            {"opponent_job": "8d0b6a7e-3f4e-4a51-9a57-0c1d2e3f4a5b"},
            "env_config.opponent_job",
            '"snapshot" opponent',
        ),
        ({"opponent": "snapshot", "opponent_job": "job-7"}, "env_config.opponent_job", "UUID"),
        (
            {"opponent": "snapshot", "opponent_checkpoint": "step-000002"},
            "env_config.opponent_checkpoint",
            "give both",
        ),
        ({"model_seat": 2}, "env_config.model_seat", "seats 0 to 1"),
        ({"illegal_penalty": "a lot"}, "env_config.illegal_penalty", "number"),
        ({"move_timeout_s": 0}, "env_config.move_timeout_s", "greater than 0"),
        ({"players": 3}, "env_config.players", "unknown setting"),
        ({"action_format": "json"}, "env_config.action_format", "'text' or 'boxed'"),
        ({"rules": "some"}, "env_config.rules", "boolean"),
    ],
)
def test_it_names_the_setting_of_a_bad_config(
    config: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(ContractError) as err:
        make_config("textarena", config)
    assert err.value.field == field
    assert words in err.value.reason


def test_it_makes_picklable_reproducible_builders() -> None:
    for config in (
        {"game": "KuhnPoker-v0"},
        {"game": "Nim-v0", "opponent": "selfplay"},
        {"game": "Nim-v0", "opponent": "snapshot"},
    ):
        a = make_group_builders("textarena", config=config, n_groups=2, group_size=2, seed=7)
        b = make_group_builders("textarena", config=config, n_groups=2, group_size=2, seed=7)
        assert pickle.dumps(a) == pickle.dumps(b)
        restored = pickle.loads(pickle.dumps(a))
        # A snapshot group's G learner seats each face a frozen opponent's seat.
        seats = 4 if config.get("opponent") == "snapshot" else 2
        assert len(restored[0].make_episodes()) == seats
    # The episodes of one group face the same deal, so their advantages compare play.
    (group,) = make_group_builders(
        "textarena", config={"game": "KuhnPoker-v0"}, n_groups=1, group_size=2, seed=7
    )
    hands = [ep.initial_observation()[0][0]["content"] for ep in group.make_episodes()]
    assert hands[0] == hands[1] and "Your card is" in hands[0]


def test_it_refuses_an_odd_self_play_group() -> None:
    with pytest.raises(ContractError) as err:
        make_group_builders(
            "textarena",
            config={"opponent": "selfplay"},
            n_groups=1,
            group_size=3,
        )
    assert err.value.field == "group_size" and "even group size" in err.value.reason


def test_it_describes_the_allowed_games() -> None:
    info = get_env("textarena").describe()
    assert info["choices"]["game"] == sorted(GAMES)
    assert {"TicTacToe-v0", "ConnectFour-v0", "KuhnPoker-v0", "GuessTheNumber-v0"} <= set(
        info["choices"]["game"]
    )
    assert (info["data_source"], info["interaction"]) == ("generator", "multi_turn")
    assert "random legal moves" in info["config_schema"]["properties"]["opponent"]["description"]


@pytest.mark.parametrize(
    "config, policy",
    [
        ({"game": "TicTacToe-v0", "model_seat": "random"}, first_listed),
        ({"game": "KuhnPoker-v0"}, first_listed),
        ({"game": "GuessTheNumber-v0"}, binary_search),
        ({"game": "Nim-v0", "model_seat": 1}, optimal_nim),
    ],
)
def test_it_plays_the_same_on_an_env_worker_as_inline(
    config: dict[str, Any],
    policy: Callable[[PolicyInput], str],
    env_worker: str,
    renderer: Renderer,
) -> None:
    from environments.remote import run_group_remote

    for spec in group_specs("textarena", config=config, n_groups=2, group_size=2, seed=3):
        remote = run_group_remote(policy, spec, renderer, timeout=60)
        inline = run_group(policy, build_group(spec), renderer)
        for r, i in zip(remote, inline, strict=True):
            assert r.error is None, r.error
            assert len(r.turns) > 1
            assert r.rewards_per_turn == i.rewards_per_turn
            assert r.tokens() == i.tokens() and r.mask() == i.mask()


def test_it_refuses_self_play_on_the_env_queue(env_worker: str) -> None:
    from environments.remote import RemoteEnvError, run_group_remote

    (spec,) = group_specs("textarena", config={"opponent": "selfplay"}, n_groups=1, group_size=2)
    with pytest.raises(RemoteEnvError, match="runs inline only"):
        run_group_remote(first_listed, spec, timeout=30)
