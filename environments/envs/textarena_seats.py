"""Two seats of one TextArena game in one process: self-play (both seats the policy in
training) and a frozen opponent (the other seat a fixed policy, sampled beside the learner).

Each seat is an episode; a `TextArenaCoordinator` holds the game and wakes the seat whose turn
it is (the turn protocol of gomoku's `GameCoordinator`), so the rollout driver plays a group's
seats from one thread each (the builders are `concurrent`). The rules, rewards and messages
are `textarena_env`'s.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

from environments.envs.textarena_env import (
    LiveGame,
    TextArenaConfig,
    format_action,
    game_metrics,
)
from environments.types import (
    Episode,
    GroupBuilder,
    Message,
    StepResult,
    StopCondition,
    check_self_play_size,
    self_play_pairs,
)


class GameAbandoned(RuntimeError):
    pass


class TextArenaCoordinator:
    """One two-player game shared by two seat episodes; wakes the seat whose turn it is.

    The turn protocol of gomoku's `GameCoordinator`: each seat's `initial_observation()` and
    `step()` block until that seat is to move, so `rollouts.run_group` can drive the two
    episodes from two threads (the builder is `concurrent`).
    """

    def __init__(self, config: TextArenaConfig, seed: int) -> None:
        self.config = config
        self.live = LiveGame(config.game, seed, 2)
        self.abandoned: str | None = None
        self._cond = threading.Condition()

    def is_over(self) -> bool:
        return self.live.is_done() or self.abandoned is not None

    def wait_for_turn(self, seat: int) -> None:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self.is_over() or self.live.to_move == seat,
                timeout=self.config.move_timeout_s,
            )
            if not ok:
                self._abandon_locked(
                    f"player {1 - seat} did not move within {self.config.move_timeout_s:g}s"
                )

    def play(self, seat: int, action: str) -> bool:
        """Play `seat`'s action; True when the game refused it."""
        with self._cond:
            if self.is_over():
                raise GameAbandoned(self.abandoned or "the game is over")
            if self.live.to_move != seat:
                raise RuntimeError(f"player {seat} moved out of turn")
            refused = self.live.step(action)
            self._cond.notify_all()
            return refused

    def take_messages(self, seat: int, rules: bool = True) -> str:
        with self._cond:
            return self.live.take_messages(seat, rules)

    def abandon(self, reason: str) -> None:
        with self._cond:
            self._abandon_locked(reason)

    def _abandon_locked(self, reason: str) -> None:
        if not self.live.is_done() and self.abandoned is None:
            self.abandoned = reason
            self._cond.notify_all()


class TextArenaSelfPlayEpisode(Episode):
    """One seat of a self-play game."""

    def __init__(self, game: TextArenaCoordinator, seat: int) -> None:
        super().__init__()
        self.game = game
        self.seat = seat
        self.config = game.config
        self.illegal = 0

    def _initial(self) -> tuple[list[Message], StopCondition]:
        self.game.wait_for_turn(self.seat)
        text = self.game.take_messages(self.seat, self.config.rules)
        return [{"role": "user", "content": text}], StopCondition(max_tokens=self.config.max_tokens)

    def _outcome(self, extra: float = 0.0, refused: bool = False) -> StepResult:
        if self.game.abandoned is not None:
            return StepResult(
                reward=extra,
                done=True,
                error="game_abandoned",
                info={"reason": self.game.abandoned, "seat": self.seat},
            )
        rewards, info = self.game.live.outcome()
        reward = rewards.get(self.seat, 0.0)
        outcome = "win" if reward > 0 else "draw" if reward == 0 else "loss"
        return StepResult(
            reward=reward + extra,
            done=True,
            error="illegal_move" if refused else None,
            metrics=game_metrics(reward, self.illegal, len(self.game.live.actions), 2),
            info={
                "outcome": outcome,
                "game_reward": reward,
                "reason": str(info.get(self.seat, {}).get("reason", "")),
                "seat": self.seat,
            },
        )

    def _step(self, action: str) -> StepResult:
        game = self.game
        if game.is_over():
            return self._outcome()
        try:
            refused = game.play(self.seat, format_action(action, self.config.action_format))
        except GameAbandoned:
            return self._outcome()
        extra = self.config.illegal_penalty if refused else 0.0
        self.illegal += int(refused)
        if game.is_over():
            return self._outcome(extra, refused)
        if not refused:
            game.wait_for_turn(self.seat)
            if game.is_over():
                return self._outcome()
        return StepResult(
            reward=extra,
            done=False,
            next_messages=[{"role": "user", "content": game.take_messages(self.seat)}],
            error="illegal_move" if refused else None,
            metrics={"illegal_moves": float(self.illegal)},
        )

    def close(self) -> None:
        # A seat that stops (crash, max turns) must not leave the other waiting forever.
        self.game.abandon(f"player {self.seat} left the game")


@dataclass
class TextArenaSelfPlayGroupBuilder(GroupBuilder):
    """G episodes = G/2 games of the group's seed; episodes 2i and 2i+1 are seats 0 and 1."""

    config: TextArenaConfig
    seed: int
    group_size: int
    env_name: str = "textarena"
    concurrent: bool = True

    def __post_init__(self) -> None:
        check_self_play_size(self.group_size)

    def make_episodes(self) -> list[Episode]:
        def new_game() -> tuple[Episode, Episode]:
            game = TextArenaCoordinator(self.config, self.seed)
            return TextArenaSelfPlayEpisode(game, 0), TextArenaSelfPlayEpisode(game, 1)

        return self_play_pairs(self.group_size, new_game)


@dataclass
class TextArenaSnapshotGroupBuilder(GroupBuilder):
    """G games of the group's seed against a frozen policy: episode 2i is the learner's seat
    of game i, episode 2i+1 the opponent's, played by the frozen policy (`opponent_episodes`)
    and never trained on. Same coordinator and turn protocol as self-play."""

    config: TextArenaConfig
    seed: int
    group_size: int
    env_name: str = "textarena"
    concurrent: bool = True

    def learner_seat(self) -> int:
        seat = self.config.model_seat
        if seat == "random":
            return random.Random(f"textarena-seat-{self.seed}").randrange(2)
        return int(seat)

    def make_episodes(self) -> list[Episode]:
        mine = self.learner_seat()
        episodes: list[Episode] = []
        for _ in range(self.group_size):
            game = TextArenaCoordinator(self.config, self.seed)
            episodes += [
                TextArenaSelfPlayEpisode(game, mine),
                TextArenaSelfPlayEpisode(game, 1 - mine),
            ]
        return episodes

    def opponent_episodes(self) -> frozenset[int]:
        return frozenset(range(1, 2 * self.group_size, 2))
