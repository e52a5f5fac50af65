"""`textworld` (dataset x multi turn): generated text adventures from TextWorld (MIT; it pulls
in jericho, GPL-2.0+; an optional dependency: the `envs` extra). Each dataset row names one
game of the pool that scripts/build_textworld_games.py builds: household cooking games and
pick-and-place quests, the task families ALFWorld trains on TextWorld's engine.

The pool lives on the machines that step episodes, at <OPENTINKER_DATA_DIR>/textworld-games;
a row's `game` is a path inside it (nothing outside the pool is ever opened).

Observations: only what the game printed for the last command (the first one without
TextWorld's ASCII banner, the prompt and the status line), optionally followed by the commands
the game accepts right now (`show_admissible`). The model answers with one command: the first
one on its first non-empty line is what the game gets; out-of-world verbs (save, restart,
quit, undo, script, ...) never reach it.

Reward per turn: the score gained by that command (TextWorld gives one point per step of the
quest), so a walkthrough collects the game's max score and grpo_per_step sees which commands
counted. The episode ends when the game is won or lost, or after `max_turns` commands.

Pickling (the env queue parks episodes in Redis between turns): the game interpreter is a
ctypes object that does not pickle, so an episode keeps (game, commands so far) and rebuilds
the game by replaying them; TextWorld games are deterministic, so the replay prints the same
text. Replay happens only where the live game is not at hand: each process keeps its live
games in a cache keyed by episode, checked against the command log.
"""

from __future__ import annotations

import re
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from environments.live_cache import LiveCache, Replaying
from environments.types import Episode, GroupBuilder, Message, StepResult, StopCondition

POOL_DIRNAME = "textworld-games"
GAME_SUFFIXES = (".z8", ".ulx")
# Live games kept per process (about 2 MiB each); one evicted early is rebuilt by replay.
CACHE_SIZE = 64
# Longer "commands" are not commands: the game would only answer that it did not understand.
MAX_COMMAND_CHARS = 200

INSTRUCTIONS = (
    "You are playing a text adventure. Reply with one command per turn, such as "
    '"look", "inventory", "open fridge", "take apple" or "go east".'
)


@pydantic_dataclass(frozen=True, config=ConfigDict(use_attribute_docstrings=True))
class TextWorldConfig:
    max_turns: int = Field(default=8, ge=1, le=64)
    """Commands per episode; it ends after this many even if the game goes on. The job's
    `rollout.max_turns` must be at least as large, or the trajectory is cut short as an error."""
    show_admissible: bool = False
    """Append the commands the game accepts right now to every observation (an easier game)."""
    normalize_score: bool = False
    """Divide each turn's score gain by the game's max score, so a won game totals 1 whatever
    its kind (cooking games are worth several points, quests one)."""
    max_tokens: int = Field(default=48, ge=1)


def _library() -> Any:
    try:
        import textworld  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ValueError(
            "textworld is not installed on this server (the `envs` extra of opentinker)"
        ) from exc
    return textworld


def games_root() -> Path:
    """Where the pool is, on the machine that steps the episodes."""
    from django.conf import settings

    return Path(settings.OPENTINKER_DATA_DIR) / POOL_DIRNAME


def check_game(game: Any) -> str:
    """The row's game as a pool-relative path, refused when it could leave the pool."""
    if not isinstance(game, str) or not game.strip():
        raise ValueError("`game` must be the path of a game file inside the pool")
    path = PurePosixPath(game.strip())
    if path.is_absolute() or ".." in path.parts or "\\" in game:
        raise ValueError(f"game {game!r} must be a path inside the pool, without '..'")
    if path.suffix not in GAME_SUFFIXES:
        raise ValueError(f"game {game!r} is not a compiled game ({', '.join(GAME_SUFFIXES)})")
    return str(path)


def _game_file(game: str) -> Path:
    path = games_root() / game
    if not path.is_file() or not path.with_suffix(".json").is_file():
        raise ValueError(
            f"game {game!r} is not in the pool at {games_root()} "
            "(scripts/build_textworld_games.py builds it)"
        )
    return path


_PROMPT = re.compile(r"\n>[^\n]*\Z")  # the input prompt and the status line after it
_RESTART = re.compile(r"^Would you like to RESTART.*$", re.MULTILINE)


def clean_text(text: str, *, first: bool = False) -> str:
    """The game's words only: no banner (first observation), prompt, status line or
    end-of-game menu; runs of blank lines squeezed, indentation dropped."""
    lines = text.split("\n")
    if first:
        # The banner is ASCII art: its lines have no letters.
        while lines and not re.search(r"[A-Za-z]", lines[0]):
            lines.pop(0)
    body = _RESTART.sub("", _PROMPT.sub("", "\n".join(lines)))
    body = "\n".join(line.strip() for line in body.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", body).strip()


# Inform 7 runs several commands given on one line ("open fridge. take apple", "... then ..."),
# and TextWorld then loses track of the score: a turn is the first command only.
_SEPARATOR = re.compile(r"[.,;!?]|\bthen\b", re.IGNORECASE)
# Out-of-world verbs: "save" and "script" write files into the worker's working directory,
# "restart", "quit" and "undo" put the interpreter where TextWorld's own bookkeeping (the score,
# the admissible commands) no longer is. None of them is a move in the game.
OUT_OF_WORLD = frozenset(
    {
        *("save", "restore", "restart", "quit", "q", "undo", "again", "g", "oops"),
        *("script", "transcript", "unscript", "noscript", "verbose", "brief", "superbrief"),
        *("version", "notify", "pronouns", "nouns"),
    }
)


def parse_command(action: str) -> str:
    """The command in a model's reply: the first one on its first non-empty line, lower case,
    without quotes or a "> " prompt."""
    for line in action.splitlines():
        line = line.strip().strip("`\"'").removeprefix(">")
        command = " ".join(_SEPARATOR.split(line, maxsplit=1)[0].lower().split())
        if command:
            return command[:MAX_COMMAND_CHARS]
    return ""


class LiveGame:
    """A running TextWorld game and every command it was given."""

    def __init__(self, path: Path) -> None:
        textworld = _library()
        infos = textworld.EnvInfos(
            admissible_commands=True, max_score=True, score=True, won=True, lost=True
        )
        with warnings.catch_warnings():
            # jericho cannot read a TextWorld game's score itself; TextWorld tracks it.
            warnings.filterwarnings("ignore", message=".*is not fully supported")
            self.env = textworld.start(str(path), request_infos=infos)
        self.state = self.env.reset()
        self.commands: list[str] = []
        self.done = False

    @classmethod
    def replay(cls, path: Path, commands: list[str]) -> LiveGame:
        live = cls(path)
        for command in commands:
            live.step(command)
        return live

    @property
    def actions(self) -> list[str]:
        return self.commands

    @property
    def max_score(self) -> int:
        return int(self.state["max_score"])

    def step(self, command: str) -> None:
        self.commands.append(command)
        self.state, _, done = self.env.step(command)
        self.done = bool(done)

    def admissible(self) -> list[str]:
        return sorted(self.state["admissible_commands"] or [])

    def close(self) -> None:
        self.env.close()


CACHE: LiveCache[LiveGame] = LiveCache(CACHE_SIZE)


def clear_cache() -> None:
    CACHE.clear()


class TextWorldEpisode(Replaying[LiveGame], Episode):
    """The model plays one game of the pool."""

    def __init__(self, config: TextWorldConfig, game: str) -> None:
        super().__init__()
        self.config = config
        self.game = game
        self.key = uuid.uuid4().hex
        self.commands: list[str] = []
        self.turns = 0
        self.score = 0
        self._live: LiveGame | None = None

    def _cache(self) -> LiveCache[LiveGame]:
        return CACHE

    def _log(self) -> list[str]:
        return self.commands

    def _rebuild(self) -> LiveGame:
        return LiveGame.replay(_game_file(self.game), self.commands)

    def _observation(self, live: LiveGame, text: str) -> str:
        if not self.config.show_admissible:
            return text
        return f"{text}\n\nCommands you can use now: {', '.join(live.admissible())}"

    def _initial(self) -> tuple[list[Message], StopCondition]:
        live = self._live_game()
        text = self._observation(live, clean_text(live.state.feedback, first=True))
        message: Message = {"role": "user", "content": f"{INSTRUCTIONS}\n\n{text}"}
        return [message], StopCondition(max_tokens=self.config.max_tokens)

    def _step(self, action: str) -> StepResult:
        live = self._live_game()
        command = parse_command(action)
        self.turns += 1
        gain = 0.0
        error = None if command else "empty_command"
        if command.split(" ", 1)[0] in OUT_OF_WORLD:
            error = "out_of_world_command"
            text = f"({command.split(' ', 1)[0]!r} is not a move in this game.)"
        elif command:
            live.step(command)
            self.commands.append(command)
            score = int(live.state["score"])
            gain, self.score = float(score - self.score), score
            if self.config.normalize_score and live.max_score:
                gain /= live.max_score
            text = clean_text(live.state.feedback)
        else:
            text = '(no command: reply with one command, such as "look")'
        won, lost = bool(live.state["won"]), bool(live.state["lost"])
        if won or lost or live.done or self.turns >= self.config.max_turns:
            outcome = "won" if won else "lost" if lost else "max_turns"
            max_score = live.max_score
            # Over: the game is released now, not parked with the group's unfinished episodes.
            self.close()
            return StepResult(
                reward=gain,
                done=True,
                error=error or ("max_turns" if outcome == "max_turns" else None),
                metrics={
                    "won": float(won),
                    "lost": float(lost),
                    "score": float(self.score),
                    "max_score": float(max_score),
                    "score_fraction": self.score / max_score if max_score else 0.0,
                    "moves": float(len(self.commands)),
                },
                info={"outcome": outcome, "score": self.score, "last_text": text},
            )
        return StepResult(
            reward=gain,
            done=False,
            next_messages=[{"role": "user", "content": self._observation(live, text)}],
            error=error,
            metrics={"score": float(self.score)},
        )

    def close(self) -> None:
        CACHE.forget(self.key)
        if self._live is not None:
            self._live.close()
            self._live = None


@dataclass
class TextWorldGroupBuilder(GroupBuilder):
    """G episodes of one game: the same world, so advantages compare the commands."""

    config: TextWorldConfig
    game: str
    group_size: int
    env_name: str = "textworld"

    def make_episodes(self) -> list[Episode]:
        return [TextWorldEpisode(self.config, self.game) for _ in range(self.group_size)]
