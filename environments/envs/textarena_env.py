"""`textarena` (generator x multi turn): TextArena games (MIT, an optional dependency: the
`envs` extra), one-player puzzles against the game, two-player games against a fixed opponent
(random legal moves, or a frozen snapshot of a policy: the base model or another job's weights,
sampled beside the learner and never trained), or in self-play where two episodes of the group
are the two seats. The two-seat games (self-play, a frozen opponent) are `textarena_seats`.

Only the games of `GAMES` are offered: they run on Python 3.11 with no network (several
TextArena games need 3.12 syntax, NLTK corpora that download, or a remote LLM), and each was
played to the end in tests/environments/test_textarena.py.

Observations: TextArena's own wrappers resend the whole history every turn; here the raw
game's per-player message queue is read instead, so each user message holds only what is new
since the model's last action (the opponent's move, the new board, an invalid-move notice),
without the echo of the model's own action.

Reward scale, per turn (grpo_per_step sees where things went wrong):
- a move the game refuses: `illegal_penalty` (default -0.1) on that turn; the game's own rules
  decide what follows (TicTacToe asks again once, then forfeits; a second mistake ends most
  games), exactly as TextArena plays them;
- the turn that ends the game: the game's reward for the model's seat (two-player: +1 win, 0
  draw, -1 loss; one-player games use their own scale, e.g. 1 for a solved puzzle).

Pickling (the env queue parks episodes in Redis between turns): the wrapped TextArena env
recurses forever on unpickle, so an episode keeps (game, seed, actions so far) and rebuilds the
game by replaying the actions. Replay happens only where the live game is not at hand: each
process keeps its live games in a cache keyed by episode, checked against the action log.

Randomness: TextArena games draw from the global `random` module (dealing cards, placing
mines) and reseed it on reset. Every call into a game runs with that game's own saved stream
swapped in and the caller's restored afterwards, so games interleaved in one process (a group,
self-play threads, an env worker) stay reproducible and a replay lands in the same state.
"""

from __future__ import annotations

import copy
import functools
import random
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from environments.grading import last_boxed
from environments.live_cache import LiveCache
from environments.types import Episode, GroupBuilder, Message, StepResult, StopCondition

Moves = Callable[[dict[str, Any]], list[str]]


@dataclass(frozen=True)
class GameInfo:
    players: int
    moves: Moves | None = None
    """Candidate moves from the game state, for the random opponent (two-player games); the
    opponent keeps the first the game accepts, in a random order."""


def _nim_moves(state: dict[str, Any]) -> list[str]:
    return [f"[{p} {q}]" for p, n in enumerate(state["piles"]) for q in range(1, n + 1)]


def _kuhn_moves(state: dict[str, Any]) -> list[str]:
    return ["[check]", "[bet]", "[call]", "[fold]"]


# Games built from TextArena's own game classes with other arguments, registered under these
# ids: TextArena's KuhnPoker-v0 plays 3 rounds, whose text passes 1,000 tokens by the third
# round with a small byte-level tokenizer; one round is ~610.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "KuhnPoker-v0-1round": ("textarena.envs.KuhnPoker.env:KuhnPokerEnv", {"max_rounds": 1}),
}

GAMES: dict[str, GameInfo] = {
    "TicTacToe-v0": GameInfo(2, lambda s: [f"[{i}]" for i in range(9)]),
    "ConnectFour-v0": GameInfo(2, lambda s: [f"[col {c}]" for c in range(len(s["board"][0]))]),
    "KuhnPoker-v0": GameInfo(2, _kuhn_moves),
    "KuhnPoker-v0-1round": GameInfo(2, _kuhn_moves),
    "Nim-v0": GameInfo(2, _nim_moves),
    "GuessTheNumber-v0": GameInfo(1),
    "TowerOfHanoi-v0": GameInfo(1),
    "Minesweeper-v0": GameInfo(1),
    "FrozenLake-v0": GameInfo(1),
    "LightsOut-v0": GameInfo(1),
    "Sudoku-v0": GameInfo(1),
    "Mastermind-v0": GameInfo(1),
}

# The most opponent moves between two model turns: a game that never hands the turn back is
# an environment bug, reported as one rather than looped on.
MAX_OPPONENT_MOVES = 200
# Live games kept per process; a game evicted early is rebuilt by replay, so this only bounds
# memory (a game is a few KiB) against replay time.
CACHE_SIZE = 1024


def game_names() -> list[str]:
    return sorted(GAMES)


@pydantic_dataclass(frozen=True, config=ConfigDict(use_attribute_docstrings=True))
class TextArenaConfig:
    game: str = "TicTacToe-v0"
    """A TextArena game id from the allowlist (the list is under `choices`)."""
    opponent: Literal["random", "selfplay", "snapshot"] = "random"
    """Two-player games: "random" (a fixed opponent playing random legal moves), "selfplay"
    (episodes 2i and 2i+1 of a group play each other; needs an even group size, inline only)
    or "snapshot" (a frozen policy plays the other seat of each episode: `opponent_job`'s
    weights, or the base model; inline only). One-player games have no opponent."""
    opponent_job: str | None = None
    """"snapshot" only: the id of a LoRA job of the team on the same base model whose final
    adapter (or `opponent_checkpoint`) plays the opponent; null: the base model itself."""
    opponent_checkpoint: str | None = Field(
        default=None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$"
    )
    """A checkpoint of `opponent_job` (e.g. "step-000010") instead of its final adapter."""
    model_seat: int | Literal["random"] = 0
    """Against a fixed opponent: the seat the model plays (0 usually moves first), or
    "random" (drawn from the group seed)."""
    illegal_penalty: float = -0.1
    """Reward of a turn whose move the game refused."""
    move_timeout_s: float = Field(default=300.0, gt=0)
    """Self-play and snapshot: how long a seat waits for the other before the game is
    abandoned."""
    max_tokens: int = Field(default=64, ge=1)
    action_format: Literal["text", "boxed"] = "text"
    """How a reply becomes a move: "text" (TextArena's own rule: the reply as given, bracketed
    when it holds no brackets) or "boxed" (the content of the reply's last \\boxed{...},
    bracketed: "\\boxed{4}" plays "[4]"; the answer format of this project's other envs and
    of SFT targets; a reply without one falls back to "text")."""
    rules: bool = True
    """False leaves the game's own prompt (its rules and move syntax, ~1,000 characters)
    out of the first observation: the board, the game's messages and the moves it accepts
    stay. For models whose context or pre-training cannot hold the rules, which then learn
    the game from demonstrations and rewards."""

    @field_validator("game")
    @classmethod
    def _allowed_game(cls, value: str) -> str:
        _library()
        if value not in GAMES:
            raise ValueError(
                f"game {value!r} is not offered; the games that run here: {', '.join(game_names())}"
            )
        return value

    @field_validator("opponent")
    @classmethod
    def _opponent_fits(cls, value: str, info: ValidationInfo) -> str:
        game = info.data.get("game")
        if value in ("selfplay", "snapshot") and game is not None and GAMES[game].players != 2:
            raise ValueError(f"{game!r} is a one-player game: there is no seat for {value}")
        return value

    @field_validator("opponent_job")
    @classmethod
    def _job_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return value
        if info.data.get("opponent") != "snapshot":
            raise ValueError('names the weights of a "snapshot" opponent: set opponent too')
        try:
            return str(uuid.UUID(value))
        except ValueError:
            raise ValueError("must be a job id (UUID)") from None

    @field_validator("opponent_checkpoint")
    @classmethod
    def _checkpoint_of_a_job(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("opponent_job") is None:
            raise ValueError("names a checkpoint of `opponent_job`: give both")
        return value

    @field_validator("model_seat")
    @classmethod
    def _seat_exists(cls, value: int | str, info: ValidationInfo) -> int | str:
        game = info.data.get("game")
        if isinstance(value, int) and game is not None:
            players = GAMES[game].players
            if not 0 <= value < players:
                raise ValueError(f"{game!r} has seats 0 to {players - 1}, not {value}")
        return value


def _library() -> Any:
    try:
        import textarena  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ValueError(
            "textarena is not installed on this server (the `envs` extra of opentinker)"
        ) from exc
    _register_variants()
    return textarena


@functools.cache
def _register_variants() -> None:
    # Once per process: `_library()` runs for every game built or replayed.
    from textarena.envs.registration import ENV_REGISTRY, register  # type: ignore[import-untyped]

    with _REGISTER_LOCK:  # the cache does not stop two first calls running at once
        for game, (entry_point, kwargs) in VARIANTS.items():
            if game not in ENV_REGISTRY:
                register(id=game, entry_point=entry_point, **kwargs)


_REGISTER_LOCK = threading.Lock()


def format_action(text: str, action_format: str = "text") -> str:
    """The move a reply plays: TextArena's default action wrapper (bracket an action that has
    no brackets), applied to the reply's last boxed content for `action_format` "boxed"."""
    if action_format == "boxed":
        boxed = last_boxed(text)
        if boxed is not None:
            text = boxed
    stripped = text.strip()
    if "[" not in stripped and "]" not in stripped:
        return f"[{stripped}]"
    return stripped


def _refused(state: Any, mover: int, errors_before: int) -> bool:
    # TextArena tells of a refused move only through its state: the error count rises when
    # the player may try again, and `invalid_move` is set when the refusal ended the game.
    if int(getattr(state, "error_count", 0)) > errors_before:
        return True
    return bool(state.done and state.game_info.get(mover, {}).get("invalid_move"))


# Guards the global `random` module while a game runs with its own stream swapped in.
_RANDOM_LOCK = threading.RLock()


class LiveGame:
    """A raw (unwrapped) TextArena env, its own random stream and every action applied."""

    def __init__(self, game: str, seed: int, players: int) -> None:
        ta = _library()
        env = ta.make(game)
        while isinstance(env, ta.Wrapper):
            env = env.env
        self.env = env
        self.actions: list[str] = []
        self.result: tuple[dict[int, float], dict[int, Any]] | None = None
        self._rng_state = random.Random(seed).getstate()
        self._call(lambda: self.env.reset(num_players=players, seed=seed))

    @classmethod
    def replay(
        cls, game: str, seed: int, players: int, actions: list[str], delivered: bool
    ) -> LiveGame:
        """The game after `actions`; `delivered`: the players saw every message until now."""
        live = cls(game, seed, players)
        for action in actions:
            live.step(action)
        if delivered:
            for queue in live.env.state.observations.values():
                queue.clear()
        return live

    def _call(self, fn: Callable[[], Any], *, keep: bool = True) -> Any:
        """Run `fn` on this game's random stream; `keep=False` leaves the stream as it was."""
        with _RANDOM_LOCK:
            outer = random.getstate()
            random.setstate(self._rng_state)
            try:
                return fn()
            finally:
                if keep:
                    self._rng_state = random.getstate()
                random.setstate(outer)

    @property
    def state(self) -> Any:
        return self.env.state

    def is_done(self) -> bool:
        return bool(self.env.state.done)

    @property
    def to_move(self) -> int:
        return int(self.env.state.current_player_id)

    def step(self, action: str) -> bool:
        """Apply the mover's action; True when the game refused it."""
        state = self.env.state
        mover = self.to_move
        before = int(getattr(state, "error_count", 0))
        self.actions.append(action)
        self._call(lambda: self.env.step(action=action))
        return _refused(state, mover, before)

    def accepts(self, action: str) -> bool:
        """Whether the mover's `action` is legal, tried on a copy (the game is untouched)."""
        trial = copy.deepcopy(self.env)
        state = trial.state
        mover = int(state.current_player_id)
        before = int(getattr(state, "error_count", 0))
        self._call(lambda: trial.step(action=action), keep=False)
        return not _refused(state, mover, before)

    def take_messages(self, seat: int, rules: bool = True) -> str:
        """What `seat` has not seen yet, as text, minus the echo of its own actions (and the
        game's prompt when not `rules`)."""
        ta = _library()
        queue = self.env.state.observations[seat]
        messages, queue[:] = list(queue), []
        roles = self.env.state.role_mapping
        lines = []
        for sender, text, kind in messages:
            if sender == seat and kind is ta.ObservationType.PLAYER_ACTION:
                continue
            if not rules and kind is ta.ObservationType.PROMPT:
                continue
            name = "GAME" if sender == ta.GAME_ID else roles.get(sender, f"Player {sender}")
            lines.append(f"[{name}] {str(text).strip()}")
        return "\n".join(lines)

    def outcome(self) -> tuple[dict[int, float], dict[int, Any]]:
        if self.result is None:
            rewards, info = self._call(self.env.close)
            self.result = ({int(k): float(v) for k, v in (rewards or {}).items()}, info or {})
        return self.result


CACHE: LiveCache[LiveGame] = LiveCache(CACHE_SIZE)


def clear_cache() -> None:
    CACHE.clear()


def game_metrics(reward: float, illegal: int, moves: int, players: int) -> dict[str, float]:
    if players == 1:
        return {
            "solved": float(reward >= 1),
            "game_reward": reward,
            "illegal_moves": float(illegal),
            "moves": float(moves),
        }
    return {
        "win": float(reward > 0),
        "draw": float(reward == 0),
        "loss": float(reward < 0),
        "illegal_moves": float(illegal),
        "moves": float(moves),
    }


class TextArenaEpisode(Episode):
    """The model against the game (one player) or against the random opponent (two)."""

    def __init__(self, config: TextArenaConfig, seed: int) -> None:
        super().__init__()
        self.config = config
        self.seed = seed
        seat = config.model_seat
        if seat == "random":
            seat = random.Random(f"textarena-seat-{seed}").randrange(self.rules.players)
        self.seat = int(seat)
        self.key = uuid.uuid4().hex
        self.actions: list[str] = []
        self.illegal = 0
        self._opponent_rng = random.Random(f"textarena-opponent-{seed}")
        self._delivered = False
        """Whether the model saw any message: a game rebuilt after that starts with none."""
        self._live: LiveGame | None = None

    @property
    def rules(self) -> GameInfo:
        return GAMES[self.config.game]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._live is not None:
            CACHE.remember(self.key, self._live)
        state["_live"] = None
        return state

    def _game(self) -> LiveGame:
        live = self._live
        if live is None or live.actions != self.actions:
            live = CACHE.take(self.key, self.actions)
        if live is None:
            CACHE.replays += int(self._delivered)
            live = LiveGame.replay(
                self.config.game, self.seed, self.rules.players, self.actions, self._delivered
            )
        self._live = live
        return live

    def _play(self, live: LiveGame, action: str) -> bool:
        refused = live.step(action)
        self.actions.append(action)
        return refused

    def _opponent_turns(self, live: LiveGame) -> None:
        for _ in range(MAX_OPPONENT_MOVES):
            if live.is_done() or live.to_move == self.seat:
                return
            self._play(live, self._opponent_move(live))
        raise RuntimeError(f"{self.config.game}: the opponent moved {MAX_OPPONENT_MOVES} times")

    def _opponent_move(self, live: LiveGame) -> str:
        assert self.rules.moves is not None
        candidates = self.rules.moves(live.state.game_state)
        self._opponent_rng.shuffle(candidates)
        for move in candidates:
            if live.accepts(move):
                return move
        return candidates[0]  # nothing legal: the game's own rules end it

    def _initial(self) -> tuple[list[Message], StopCondition]:
        live = self._game()
        self._opponent_turns(live)
        text = live.take_messages(self.seat, self.config.rules)
        self._delivered = True
        return [{"role": "user", "content": text}], StopCondition(max_tokens=self.config.max_tokens)

    def _end(self, live: LiveGame, extra: float, refused: bool) -> StepResult:
        rewards, info = live.outcome()
        reward = rewards.get(self.seat, 0.0)
        seat_info = info.get(self.seat, {})
        outcome = "win" if reward > 0 else "draw" if reward == 0 else "loss"
        if self.rules.players == 1:
            outcome = "solved" if reward >= 1 else "unsolved"
        return StepResult(
            reward=reward + extra,
            done=True,
            error="illegal_move" if refused else None,
            metrics=game_metrics(reward, self.illegal, len(self.actions), self.rules.players),
            info={
                "outcome": outcome,
                "game_reward": reward,
                "reason": str(seat_info.get("reason", "")),
                "seat": self.seat,
            },
        )

    def _step(self, action: str) -> StepResult:
        live = self._game()
        if live.is_done():
            return self._end(live, 0.0, False)
        refused = self._play(live, format_action(action, self.config.action_format))
        extra = self.config.illegal_penalty if refused else 0.0
        self.illegal += int(refused)
        self._opponent_turns(live)
        if live.is_done():
            self._forget()
            return self._end(live, extra, refused)
        return StepResult(
            reward=extra,
            done=False,
            next_messages=[{"role": "user", "content": live.take_messages(self.seat)}],
            error="illegal_move" if refused else None,
            metrics={"illegal_moves": float(self.illegal)},
        )

    def _forget(self) -> None:
        CACHE.forget(self.key)

    def close(self) -> None:
        self._forget()
        self._live = None


def demonstration_rows(
    game: str,
    games: int,
    seed: int,
    model_seat: int,
    action_format: str = "boxed",
    rules: bool = True,
) -> list[dict[str, Any]]:
    """SFT rows for the `math` env from `games` games of a two-player `game` against the
    random opponent, the model's seat playing random legal moves too: per model turn, the
    observation exactly as this env shows it (`question`), the game's earlier turns as the
    rollout holds them (`context`, from the second turn on) and the move unbracketed
    (`answer`). With `action_format` "boxed" SFT writes the answer as `\\boxed{...}` (what
    that format plays); with "text" each row's `completion` is the move as the game asks for
    it (`[check]`), a reply of a few tokens that the "text" format plays as given. `rules`:
    the env's option of that name, which the RL job must match.
    scripts/build_textarena_demos.py writes them."""
    info = GAMES.get(game)
    if info is None or info.moves is None:
        two_player = sorted(g for g, i in GAMES.items() if i.moves is not None)
        raise ValueError(f"one of the two-player games {', '.join(two_player)}")
    config = TextArenaConfig(
        game=game, model_seat=model_seat, action_format=action_format, rules=rules
    )
    rows: list[dict[str, Any]] = []
    for i in range(games):
        rng = random.Random(f"demo-{game}-{seed + i}")
        episode = TextArenaEpisode(config, seed + i)
        messages, _ = episode.initial_observation()
        history: list[dict[str, str]] = []
        observation = messages[-1]["content"]
        while True:
            live = episode._game()
            candidates = info.moves(live.state.game_state)
            rng.shuffle(candidates)
            move = next((m for m in candidates if live.accepts(m)), candidates[0])
            answer = move[1:-1]
            row: dict[str, Any] = {"question": observation, "answer": answer}
            if action_format == "text":
                row["completion"] = reply = move
            else:
                reply = f"\\boxed{{{answer}}}"
            if history:
                row["context"] = list(history)
            rows.append(row)
            result = episode.step(reply)
            if result.done:
                break
            history += [
                {"role": "user", "content": observation},
                {"role": "assistant", "content": reply},
            ]
            observation = result.next_messages[-1]["content"]
        episode.close()
    return rows


@dataclass
class TextArenaGroupBuilder(GroupBuilder):
    config: TextArenaConfig
    seed: int
    group_size: int
    env_name: str = "textarena"

    def make_episodes(self) -> list[Episode]:
        # One seed per group: the G episodes get the same deal, so advantages compare play.
        return [TextArenaEpisode(self.config, self.seed) for _ in range(self.group_size)]
