"""`gomoku` (generator x multi turn): k-in-a-row on a small board, against a built-in opponent
or against another episode of the same policy (self-play).

Board: `size` x `size` (default 5x5, 4 in a row wins; 7x7 with 5 is a config away), shown as
text with 0-based row and column indices (the format of the tiny base model's training data).
A move is `\\boxed{row,col}` or a bare `row,col`. X moves first.

Reward scale (per turn, so grpo_per_step sees where things went wrong):
- an illegal move (unparsable, off the board, occupied): `illegal_penalty` (default -0.1) on
  that turn and the player moves again; the `max_illegal`-th illegal move forfeits the game;
- the turn that ends the game: +1 win, 0 draw, -1 loss (a forfeit is a loss).

Self-play: two episodes share one `GameCoordinator`. Each player's `initial_observation()` and
`step()` block until it is that player's turn (threading.Condition), so the two episodes can be
driven by two independent threads (`rollouts.run_group` does this for `concurrent` builders).
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from environments.types import (
    STRICT_CONFIG,
    Episode,
    GroupBuilder,
    Message,
    StepResult,
    StopCondition,
    check_self_play_size,
    self_play_pairs,
)

EMPTY = "."
_DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))
_BOXED_MOVE = re.compile(r"\\boxed\{\s*(-?\d+)\s*,\s*(-?\d+)\s*\}")
_BARE_MOVE = re.compile(r"(?<![\d.])(-?\d+)\s*,\s*(-?\d+)(?![\d.])")


@pydantic_dataclass(frozen=True, config=STRICT_CONFIG)
class GomokuConfig:
    size: int = Field(default=5, ge=3, le=15)
    win_length: int = Field(default=4, ge=3)
    """At most ``size``."""
    model_mark: Literal["X", "O", "random"] = "X"
    """"X" (moves first), "O", or "random" (drawn from the episode seed). Ignored in self-play."""
    illegal_penalty: float = -0.1
    max_illegal: int = Field(default=3, ge=1)
    opponent: Literal["heuristic", "random"] = "heuristic"
    """"heuristic" (win, block, else best-scoring cell) or "random"."""
    opponent_noise: float = Field(default=0.0, ge=0.0, le=1.0)
    """Probability that the heuristic opponent plays a random legal move instead."""
    move_timeout_s: float = Field(default=300.0, gt=0)
    """Self-play: how long a player waits for the other before the game is abandoned."""
    max_tokens: int = Field(default=16, ge=1)

    @field_validator("win_length")
    @classmethod
    def _fits_the_board(cls, value: int, info: ValidationInfo) -> int:
        size = info.data.get("size")
        if size is not None and value > size:
            raise ValueError(f"must be at most size ({size}), got {value}")
        return value


def other(mark: str) -> str:
    return "O" if mark == "X" else "X"


class Board:
    def __init__(self, size: int, win_length: int) -> None:
        self.size = size
        self.win_length = win_length
        self.cells = [[EMPTY] * size for _ in range(size)]
        self.moves: list[tuple[str, int, int]] = []

    def empty_cells(self) -> list[tuple[int, int]]:
        return [
            (r, c) for r in range(self.size) for c in range(self.size) if self.cells[r][c] == EMPTY
        ]

    def full(self) -> bool:
        return len(self.moves) == self.size * self.size

    def check_move(self, r: int, c: int) -> str | None:
        """None if (r, c) is legal, else why not."""
        if not (0 <= r < self.size and 0 <= c < self.size):
            return f"{r},{c} is off the board (rows and columns are 0 to {self.size - 1})"
        if self.cells[r][c] != EMPTY:
            return f"{r},{c} is already taken by {self.cells[r][c]}"
        return None

    def place(self, mark: str, r: int, c: int) -> bool:
        """Place a legal move; True if it wins."""
        problem = self.check_move(r, c)
        if problem:
            raise ValueError(problem)
        self.cells[r][c] = mark
        self.moves.append((mark, r, c))
        return self.line_length(mark, r, c) >= self.win_length

    def line_length(self, mark: str, r: int, c: int) -> int:
        """Longest line of `mark` through (r, c), counting (r, c) as `mark`."""
        best = 0
        for dr, dc in _DIRECTIONS:
            n = 1
            for sign in (1, -1):
                rr, cc = r + sign * dr, c + sign * dc
                while 0 <= rr < self.size and 0 <= cc < self.size and self.cells[rr][cc] == mark:
                    n += 1
                    rr += sign * dr
                    cc += sign * dc
            best = max(best, n)
        return best

    def render(self) -> str:
        header = "  " + " ".join(str(c) for c in range(self.size))
        rows = [f"{r} " + " ".join(self.cells[r]) for r in range(self.size)]
        return "\n".join([header, *rows])

    def prompt(self, mark: str) -> str:
        return (
            f"Gomoku on a {self.size}x{self.size} board, {self.win_length} in a row wins. "
            f"You play {mark}.\n{self.render()}\nReply with your move as \\boxed{{row,col}}."
        )


def parse_move(text: str) -> tuple[int, int] | None:
    found = _BOXED_MOVE.findall(text) or _BARE_MOVE.findall(text)
    if not found:
        return None
    r, c = found[-1]
    return int(r), int(c)


def heuristic_move(board: Board, mark: str, rng: random.Random) -> tuple[int, int]:
    """Win if possible, else block the opponent's win, else the cell with the best line score."""
    empty = board.empty_cells()
    opp = other(mark)
    for target in (mark, opp):
        for r, c in empty:
            if board.line_length(target, r, c) >= board.win_length:
                return r, c
    centre = (board.size - 1) / 2

    def score(cell: tuple[int, int]) -> float:
        r, c = cell
        own = board.line_length(mark, r, c)
        block = board.line_length(opp, r, c)
        return own * own * 2 + block * block - 0.01 * (abs(r - centre) + abs(c - centre))

    best = max(score(cell) for cell in empty)
    return rng.choice([cell for cell in empty if score(cell) == best])


def opponent_move(
    board: Board, mark: str, config: GomokuConfig, rng: random.Random
) -> tuple[int, int]:
    if config.opponent == "random" or rng.random() < config.opponent_noise:
        return rng.choice(board.empty_cells())
    return heuristic_move(board, mark, rng)


class GomokuEpisode(Episode):
    """The model against the built-in opponent."""

    def __init__(self, config: GomokuConfig, seed: int) -> None:
        super().__init__()
        self.config = config
        self.rng = random.Random(f"gomoku-{seed}")
        self.board = Board(config.size, config.win_length)
        mark = config.model_mark
        self.mark = self.rng.choice("XO") if mark == "random" else mark
        self.illegal = 0

    def _stop(self) -> StopCondition:
        return StopCondition(max_tokens=self.config.max_tokens)

    def _initial(self) -> tuple[list[Message], StopCondition]:
        if self.mark == "O":
            r, c = opponent_move(self.board, "X", self.config, self.rng)
            self.board.place("X", r, c)
        return [{"role": "user", "content": self.board.prompt(self.mark)}], self._stop()

    def _end(self, reward: float, outcome: str, error: str | None = None) -> StepResult:
        return StepResult(
            reward=reward,
            done=True,
            error=error,
            metrics={
                "win": float(outcome == "win"),
                "draw": float(outcome == "draw"),
                "loss": float(outcome == "loss"),
                "illegal_moves": float(self.illegal),
                "moves": float(len(self.board.moves)),
            },
            info={"outcome": outcome, "board": self.board.render()},
        )

    def _step(self, action: str) -> StepResult:
        move = parse_move(action)
        problem = (
            "no move found; answer with \\boxed{row,col}"
            if move is None
            else self.board.check_move(*move)
        )
        if problem:
            self.illegal += 1
            if self.illegal >= self.config.max_illegal:
                return self._end(self.config.illegal_penalty - 1.0, "loss", error="illegal_move")
            text = f"Illegal move: {problem}. Try again.\n{self.board.prompt(self.mark)}"
            return StepResult(
                reward=self.config.illegal_penalty,
                done=False,
                next_messages=[{"role": "user", "content": text}],
                error="illegal_move",
                metrics={"illegal_moves": float(self.illegal)},
            )
        assert move is not None
        if self.board.place(self.mark, *move):
            return self._end(1.0, "win")
        if self.board.full():
            return self._end(0.0, "draw")
        opp = other(self.mark)
        r, c = opponent_move(self.board, opp, self.config, self.rng)
        if self.board.place(opp, r, c):
            return self._end(-1.0, "loss")
        if self.board.full():
            return self._end(0.0, "draw")
        text = f"Opponent played {r},{c}.\n{self.board.prompt(self.mark)}"
        return StepResult(reward=0.0, done=False, next_messages=[{"role": "user", "content": text}])


@dataclass
class GomokuGroupBuilder(GroupBuilder):
    config: GomokuConfig
    seed: int
    group_size: int
    env_name: str = "gomoku"

    def make_episodes(self) -> list[Episode]:
        # One seed per group: the G episodes face the same opening, so advantages compare play.
        return [GomokuEpisode(self.config, self.seed) for _ in range(self.group_size)]


class GameAbandoned(RuntimeError):
    pass


class GameCoordinator:
    """One game shared by two player episodes; wakes the player whose turn it is."""

    def __init__(self, config: GomokuConfig) -> None:
        self.config = config
        self.board = Board(config.size, config.win_length)
        self.to_move = "X"
        self.winner: str | None = None
        self.finished = False
        self.abandoned: str | None = None
        self.forfeit = False
        self.log: list[str] = []
        """Every event in order: "X:r,c", "X:illegal", "X:forfeit", "abandoned:..."."""
        self._cond = threading.Condition()

    def wait_for_turn(self, mark: str) -> None:
        """Block until `mark` is to move or the game is over."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.finished or self.abandoned is not None or self.to_move == mark,
                timeout=self.config.move_timeout_s,
            )
            if not ok:
                self._abandon_locked(
                    f"{other(mark)} did not move within {self.config.move_timeout_s:g}s"
                )

    def try_move(self, mark: str, move: tuple[int, int] | None) -> str | None:
        """Play `mark`'s move; returns why it is illegal, or None when it was played."""
        with self._cond:
            if self.finished or self.abandoned is not None:
                raise GameAbandoned(self.abandoned or "the game is over")
            if self.to_move != mark:
                raise RuntimeError(f"{mark} moved out of turn")
            problem = (
                "no move found; answer with \\boxed{row,col}"
                if move is None
                else self.board.check_move(*move)
            )
            if problem:
                self.log.append(f"{mark}:illegal")
                return problem
            assert move is not None
            self.log.append(f"{mark}:{move[0]},{move[1]}")
            if self.board.place(mark, *move):
                self.winner, self.finished = mark, True
            elif self.board.full():
                self.finished = True
            else:
                self.to_move = other(mark)
            self._cond.notify_all()
            return None

    def resign(self, mark: str) -> None:
        with self._cond:
            if not self.finished:
                self.log.append(f"{mark}:forfeit")
                self.winner, self.finished, self.forfeit = other(mark), True, True
                self._cond.notify_all()

    def abandon(self, reason: str) -> None:
        with self._cond:
            self._abandon_locked(reason)

    def _abandon_locked(self, reason: str) -> None:
        if not self.finished and self.abandoned is None:
            self.abandoned = reason
            self.log.append(f"abandoned:{reason}")
            self._cond.notify_all()


class SelfPlayEpisode(Episode):
    """One side of a self-play game."""

    def __init__(self, coordinator: GameCoordinator, mark: str) -> None:
        super().__init__()
        self.game = coordinator
        self.mark = mark
        self.config = coordinator.config
        self.illegal = 0

    def _observation(self, prefix: str = "") -> list[Message]:
        moves = self.game.board.moves
        last = moves[-1] if moves and moves[-1][0] != self.mark else None
        note = f"Opponent played {last[1]},{last[2]}.\n" if last else ""
        return [{"role": "user", "content": prefix + note + self.game.board.prompt(self.mark)}]

    def _initial(self) -> tuple[list[Message], StopCondition]:
        self.game.wait_for_turn(self.mark)
        return self._observation(), StopCondition(max_tokens=self.config.max_tokens)

    def _outcome(self, reward_extra: float = 0.0) -> StepResult:
        game = self.game
        if game.abandoned is not None:
            return StepResult(
                reward=reward_extra,
                done=True,
                error="game_abandoned",
                info={"reason": game.abandoned, "board": game.board.render()},
            )
        if game.winner == self.mark:
            outcome, reward = "win", 1.0
        elif game.winner is None:
            outcome, reward = "draw", 0.0
        else:
            outcome, reward = "loss", -1.0
        return StepResult(
            reward=reward + reward_extra,
            done=True,
            error="illegal_move" if game.forfeit and outcome == "loss" else None,
            metrics={
                "win": float(outcome == "win"),
                "draw": float(outcome == "draw"),
                "loss": float(outcome == "loss"),
                "illegal_moves": float(self.illegal),
                "moves": float(len(game.board.moves)),
            },
            info={"outcome": outcome, "mark": self.mark, "board": game.board.render()},
        )

    def _step(self, action: str) -> StepResult:
        game = self.game
        if game.finished or game.abandoned is not None:
            return self._outcome()
        try:
            problem = game.try_move(self.mark, parse_move(action))
        except GameAbandoned:
            return self._outcome()
        if problem:
            self.illegal += 1
            if self.illegal >= self.config.max_illegal:
                game.resign(self.mark)
                return self._outcome(self.config.illegal_penalty)
            text = f"Illegal move: {problem}. Try again.\n"
            return StepResult(
                reward=self.config.illegal_penalty,
                done=False,
                next_messages=[{"role": "user", "content": text + game.board.prompt(self.mark)}],
                error="illegal_move",
            )
        if game.finished:
            return self._outcome()
        game.wait_for_turn(self.mark)
        if game.finished or game.abandoned is not None:
            return self._outcome()
        return StepResult(reward=0.0, done=False, next_messages=self._observation())

    def close(self) -> None:
        # A player that stops (crash, max turns) must not leave the other waiting forever.
        self.game.abandon(f"player {self.mark} left the game")


@dataclass
class GomokuSelfPlayGroupBuilder(GroupBuilder):
    """G episodes = G/2 games; episodes 2i (X) and 2i+1 (O) share game i."""

    config: GomokuConfig
    seed: int
    group_size: int
    env_name: str = "gomoku"
    concurrent: bool = True

    def __post_init__(self) -> None:
        check_self_play_size(self.group_size)

    def make_episodes(self) -> list[Episode]:
        def new_game() -> tuple[Episode, Episode]:
            game = GameCoordinator(self.config)
            return SelfPlayEpisode(game, "X"), SelfPlayEpisode(game, "O")

        return self_play_pairs(self.group_size, new_game)
