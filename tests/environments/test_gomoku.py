"""Gomoku: board rules, move parsing, the built-in opponent, rewards, self-play turn order."""

from __future__ import annotations

import random
import threading
import time

import pytest

from environments.envs.gomoku import (
    Board,
    GameCoordinator,
    GomokuConfig,
    GomokuEpisode,
    GomokuSelfPlayGroupBuilder,
    SelfPlayEpisode,
    heuristic_move,
    parse_move,
)
from environments.renderer import Renderer
from environments.rollouts import PolicyInput, run_episode, run_group


def test_it_detects_wins_in_every_direction() -> None:
    for cells in (
        [(2, 0), (2, 1), (2, 2), (2, 3)],
        [(0, 4), (1, 4), (2, 4), (3, 4)],
        [(1, 1), (2, 2), (3, 3), (4, 4)],
        [(0, 3), (1, 2), (2, 1), (3, 0)],
    ):
        board = Board(5, 4)
        wins = [board.place("X", r, c) for r, c in cells]
        assert wins == [False, False, False, True]
    board = Board(5, 4)
    assert not any(board.place("X", r, c) for r, c in [(0, 0), (0, 1), (0, 2)])
    board.place("O", 0, 3)
    assert not board.place("X", 1, 0)


def test_it_parses_moves_and_checks_legality() -> None:
    assert parse_move("\\boxed{2,3}") == (2, 3)
    assert parse_move("I think 1, 4 is good") == (1, 4)
    assert parse_move("first 0,0 then \\boxed{3,3}") == (3, 3)
    assert parse_move("centre") is None
    board = Board(5, 4)
    board.place("X", 2, 2)
    assert "already taken by X" in board.check_move(2, 2)
    assert "off the board" in board.check_move(5, 0)
    assert board.check_move(0, 0) is None
    with pytest.raises(ValueError):
        board.place("O", 2, 2)


def test_it_renders_the_board_as_text() -> None:
    board = Board(5, 4)
    board.place("X", 0, 1)
    board.place("O", 4, 4)
    assert (
        board.render()
        == "  0 1 2 3 4\n0 . X . . .\n1 . . . . .\n2 . . . . .\n3 . . . . .\n4 . . . . O"
    )


def test_it_has_an_opponent_that_wins_and_blocks() -> None:
    rng = random.Random(0)
    board = Board(5, 4)
    for c in range(3):
        board.place("O", 4, c)
        board.place("X", 0, c)
    # O to move: winning at (4, 3) beats blocking X at (0, 3).
    assert heuristic_move(board, "O", rng) == (4, 3)
    board = Board(5, 4)
    for r, c in [(1, 1), (2, 2), (3, 3)]:
        board.place("X", r, c)
    board.place("O", 0, 4)
    assert heuristic_move(board, "O", rng) in {(0, 0), (4, 4)}


def test_it_penalises_illegal_moves_and_forfeits_after_too_many() -> None:
    ep = GomokuEpisode(GomokuConfig(max_illegal=3), seed=0)
    messages, _ = ep.initial_observation()
    assert "You play X" in messages[0]["content"]
    first = ep.step("\\boxed{9,9}")
    assert (first.reward, first.done, first.error) == (-0.1, False, "illegal_move")
    assert "off the board" in first.next_messages[0]["content"]
    second = ep.step("pass")
    assert second.reward == -0.1 and not second.done
    third = ep.step("\\boxed{7,7}")
    assert third.done and third.reward == pytest.approx(-1.1)
    assert third.info["outcome"] == "loss"


def test_it_plays_full_games_with_win_loss_draw_rewards(renderer: Renderer) -> None:
    outcomes: dict[str, int] = {}
    for seed in range(6):
        rng = random.Random(seed)

        def random_legal(inp: PolicyInput, rng: random.Random = rng) -> str:
            text = inp.messages[-1]["content"]
            rows = [line.split()[1:] for line in text.splitlines() if line[:1].isdigit()]
            empty = [(r, c) for r, row in enumerate(rows) for c, v in enumerate(row) if v == "."]
            r, c = rng.choice(empty)
            return f"\\boxed{{{r},{c}}}"

        ep = GomokuEpisode(GomokuConfig(model_mark="random"), seed=seed)
        traj = run_episode(random_legal, ep, renderer)
        assert traj.error is None
        final = traj.turns[-1]
        outcome = final.info["outcome"]
        assert final.reward == {"win": 1.0, "draw": 0.0, "loss": -1.0}[outcome]
        assert all(t.reward == 0.0 for t in traj.turns[:-1])
        assert all(t.error is None for t in traj.turns)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        # The model's own moves are the trainable tokens; board observations are masked.
        trained = renderer.decode([t for t, m in zip(traj.tokens(), traj.mask()) if m])
        assert "Gomoku" not in trained and "boxed" in trained
    # The heuristic opponent beats a random player most of the time.
    assert outcomes.get("loss", 0) >= 4


def test_it_lets_the_opponent_open_when_the_model_plays_o() -> None:
    ep = GomokuEpisode(GomokuConfig(model_mark="O"), seed=1)
    messages, _ = ep.initial_observation()
    assert len(ep.board.moves) == 1 and ep.board.moves[0][0] == "X"
    assert "You play O" in messages[0]["content"]


def _scripted_player(
    moves: list[tuple[int, int]], order: list[str], mark: str, lock: threading.Lock
):
    it = iter(moves)

    def policy(inp: PolicyInput) -> str:
        with lock:
            order.append(mark)
        time.sleep(0.01)  # give the other thread every chance to jump the queue
        r, c = next(it)
        return f"\\boxed{{{r},{c}}}"

    return policy


def test_it_alternates_turns_in_self_play() -> None:
    game = GameCoordinator(GomokuConfig())
    x_ep, o_ep = SelfPlayEpisode(game, "X"), SelfPlayEpisode(game, "O")
    order: list[str] = []
    lock = threading.Lock()
    x_moves = [(0, 0), (0, 1), (0, 2), (0, 3)]
    o_moves = [(4, 0), (4, 1), (4, 2)]
    results = {}
    # O's thread starts first; it must still wait for X's opening move.
    threads = [
        threading.Thread(
            target=lambda: results.__setitem__(
                "O", run_episode(_scripted_player(o_moves, order, "O", lock), o_ep)
            )
        ),
        threading.Thread(
            target=lambda: results.__setitem__(
                "X", run_episode(_scripted_player(x_moves, order, "X", lock), x_ep)
            )
        ),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert order == ["X", "O", "X", "O", "X", "O", "X"]
    assert game.log == ["X:0,0", "O:4,0", "X:0,1", "O:4,1", "X:0,2", "O:4,2", "X:0,3"]
    assert results["X"].total_reward == 1.0 and results["O"].total_reward == -1.0
    assert len(results["X"].turns) == 4 and len(results["O"].turns) == 3
    # Each player is shown the other's last move.
    assert "Opponent played 4,0" in results["X"].turns[1].observation_messages[0]["content"]
    assert "Opponent played 0,0" in results["O"].turns[0].observation_messages[0]["content"]


def test_it_plays_self_play_groups_concurrently(renderer: Renderer) -> None:
    builder = GomokuSelfPlayGroupBuilder(GomokuConfig(), seed=0, group_size=4)
    rngs: dict[int, random.Random] = {}

    def policy(inp: PolicyInput) -> str:
        rng = rngs.setdefault(threading.get_ident(), random.Random(threading.get_ident()))
        text = inp.messages[-1]["content"]
        rows = [line.split()[1:] for line in text.splitlines() if line[:1].isdigit()]
        empty = [(r, c) for r, row in enumerate(rows) for c, v in enumerate(row) if v == "."]
        r, c = rng.choice(empty)
        return f"\\boxed{{{r},{c}}}"

    trajs = run_group(policy, builder, renderer)
    assert len(trajs) == 4
    for x, o in ((trajs[0], trajs[1]), (trajs[2], trajs[3])):
        assert x.error is None and o.error is None
        # Zero-sum: one wins and the other loses, or both draw.
        assert x.turns[-1].reward == -o.turns[-1].reward
        assert len(x.turns) - len(o.turns) in (0, 1)


def test_it_frees_the_other_player_when_one_crashes() -> None:
    game = GameCoordinator(GomokuConfig(move_timeout_s=30))
    x_ep, o_ep = SelfPlayEpisode(game, "X"), SelfPlayEpisode(game, "O")
    result = {}

    def crash(inp: PolicyInput) -> str:
        raise RuntimeError("sampler died")

    o_thread = threading.Thread(
        target=lambda: result.__setitem__("O", run_episode(lambda inp: "\\boxed{1,1}", o_ep))
    )
    o_thread.start()
    with pytest.raises(RuntimeError):
        run_episode(crash, x_ep)
    o_thread.join(timeout=5)
    assert not o_thread.is_alive()
    assert result["O"].turns == [] or result["O"].turns[-1].error == "game_abandoned"
    assert game.abandoned == "player X left the game"


def test_it_refuses_odd_self_play_groups() -> None:
    with pytest.raises(ValueError, match="even group size"):
        GomokuSelfPlayGroupBuilder(GomokuConfig(), seed=0, group_size=3)
