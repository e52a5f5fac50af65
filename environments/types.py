"""The environment protocol shared by training and inference.

An `Episode` is a single-use object: `initial_observation()` once, then `step(action)` until a
`StepResult` says `done`. Episodes are made by picklable builders (`GroupBuilder`), so a builder
can travel to an env worker and the episodes live only where they are stepped.

Observations are chat messages; the renderer (environments.renderer) turns them into tokens with
the base model's chat template, so environments never see token ids. Errors the policy causes
(an unparsable answer, an illegal move, code that crashes) are values in `StepResult.error`,
never exceptions: the episode goes on or ends with a reward that says what happened.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypedDict

from pydantic import ConfigDict

from environments.images import images_in

# The built-in envs' configs come from a job's JSON: checked as strictly as the JobSpec around
# them (JSON "64" is not 64, true is not 1), so a bad setting is refused at submission instead
# of failing, or silently scoring nonsense, in the middle of a run.
STRICT_CONFIG = ConfigDict(strict=True, allow_inf_nan=False, use_attribute_docstrings=True)


class Message(TypedDict):
    role: str
    content: Any
    """Text, or a list of parts (`environments.images`: text and image parts)."""


class DataSource(str, Enum):
    """Where an environment's prompts come from (the first axis of the 2x2 space)."""

    DATASET = "dataset"
    GENERATOR = "generator"


class Interaction(str, Enum):
    """How many model turns an episode has (the second axis of the 2x2 space)."""

    SINGLE_TURN = "single_turn"
    MULTI_TURN = "multi_turn"


@dataclass(frozen=True)
class StopCondition:
    """When the sampler should stop generating one action (maps onto SamplingParams)."""

    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    """Stop strings, on top of the chat template's end-of-turn token."""
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class StepResult:
    """The outcome of one `Episode.step`."""

    reward: float
    """Reward for this turn (per-turn rewards are kept for grpo_per_step)."""
    done: bool
    next_messages: list[Message] = field(default_factory=list)
    """Messages to append to the conversation before the next action (empty when done)."""
    stop: StopCondition | None = None
    """Stop condition for the next action; None keeps the previous one."""
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    """Short code of what the policy did wrong this turn (e.g. "illegal_move"), or None."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-able details for logs (parsed answer, sandbox result, board)."""


class EpisodeError(RuntimeError):
    """Raised when the protocol itself is misused (step after done, initial twice)."""


class Episode(abc.ABC):
    """One single-use environment episode.

    Subclasses implement `_initial()` and `_step()`; this base class enforces the call order so
    that a reused or over-stepped episode fails loudly instead of producing wrong rewards.
    """

    def __init__(self) -> None:
        self._started = False
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def initial_observation(self) -> tuple[list[Message], StopCondition]:
        if self._started:
            raise EpisodeError("initial_observation() called twice: episodes are single-use")
        self._started = True
        return self._initial()

    def step(self, action: str) -> StepResult:
        if not self._started:
            raise EpisodeError("step() before initial_observation()")
        if self._done:
            raise EpisodeError("step() after the episode ended")
        if not isinstance(action, str):
            raise TypeError(f"action must be the decoded text, got {type(action).__name__}")
        result = self._step(action)
        self._done = result.done
        return result

    def close(self) -> None:  # noqa: B027 (a hook: most episodes hold nothing to release)
        """Release resources and wake anything waiting on this episode (self-play)."""

    def end(self) -> None:
        """Mark the episode over without a final step (its step raised); then close it."""
        self._done = True
        self.close()

    @abc.abstractmethod
    def _initial(self) -> tuple[list[Message], StopCondition]: ...

    @abc.abstractmethod
    def _step(self, action: str) -> StepResult: ...


class GroupBuilder(abc.ABC):
    """Makes the G episodes of one prompt (one group for group-relative advantages).

    Must be picklable: plain data only (the row, the seed, the config), no open resources.
    """

    env_name: str = ""

    @abc.abstractmethod
    def make_episodes(self) -> list[Episode]: ...

    def opponent_episodes(self) -> frozenset[int]:
        """Episodes of `make_episodes()` played by a frozen opponent policy rather than the
        policy in training: sampled from the opponent's weights, left out of the group's
        trajectories (never trained on, no group reward). Default: none."""
        return frozenset()

    def compute_group_rewards(self, trajectories: list[Trajectory]) -> list[float]:
        """Extra reward per episode computed over the whole group (ranking, self-play).

        Added to each trajectory's last turn by `rollouts.run_group`. Default: none.
        """
        return [0.0 for _ in trajectories]


def check_self_play_size(group_size: int) -> None:
    if group_size < 2 or group_size % 2:
        raise ValueError(f"self-play needs an even group size >= 2, got {group_size}")


def self_play_pairs(
    group_size: int, new_game: Callable[[], tuple[Episode, Episode]]
) -> list[Episode]:
    """A self-play group's episodes: G/2 games from `new_game()`, episodes 2i and 2i+1 the
    two seats of game i."""
    check_self_play_size(group_size)
    episodes: list[Episode] = []
    for _ in range(group_size // 2):
        episodes += new_game()
    return episodes


@dataclass
class Turn:
    """One model turn: what the model saw since its last action, what it produced, and why.

    `observation_tokens` are the prompt tokens rendered before this action (the whole prompt on
    the first turn; the tool output or opponent move plus the chat template's glue afterwards).
    They are context only: never trained on. `action_tokens` are exactly the sampled tokens.
    """

    observation_tokens: list[int]
    action_tokens: list[int]
    action_logprobs: list[float]
    reward: float
    observation_messages: list[Message] = field(default_factory=list)
    action_text: str = ""
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """A finished episode as the engine consumes it (training.rl turns it into datums)."""

    turns: list[Turn]
    env_name: str = ""
    error: str | None = None
    """Set when the episode ended abnormally (environment crash, protocol error)."""
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def rewards_per_turn(self) -> list[float]:
        return [t.reward for t in self.turns]

    def tokens(self) -> list[int]:
        """The full token sequence: obs_0 act_0 obs_1 act_1 ..."""
        out: list[int] = []
        for t in self.turns:
            out.extend(t.observation_tokens)
            out.extend(t.action_tokens)
        return out

    def mask(self) -> list[int]:
        """1 for tokens the model generated (trainable), 0 for observations; aligned to tokens()."""
        out: list[int] = []
        for t in self.turns:
            out.extend([0] * len(t.observation_tokens))
            out.extend([1] * len(t.action_tokens))
        return out

    def logprobs(self) -> list[float]:
        """Sampler logprobs aligned to tokens(); 0.0 where masked."""
        out: list[float] = []
        for t in self.turns:
            out.extend([0.0] * len(t.observation_tokens))
            out.extend(t.action_logprobs)
        return out

    def images(self) -> list[bytes]:
        """The images of the observations (PNG or JPEG bytes), in token order."""
        return [image for t in self.turns for image in images_in(t.observation_messages)]

    def turn_index(self) -> list[int]:
        """For each token, the index of the turn it belongs to (for per-turn advantages)."""
        out: list[int] = []
        for i, t in enumerate(self.turns):
            out.extend([i] * (len(t.observation_tokens) + len(t.action_tokens)))
        return out

    def to_engine(self) -> Any:
        """The engine's `training.rl.Trajectory` (imported lazily: it pulls in torch)."""
        from training import rl

        return rl.Trajectory(
            [
                rl.Turn(
                    observation=list(t.observation_tokens),
                    action=list(t.action_tokens),
                    action_logprobs=list(t.action_logprobs),
                    reward=float(t.reward),
                )
                for t in self.turns
            ]
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form for Celery payloads and logs."""
        return {
            "env_name": self.env_name,
            "error": self.error,
            "metrics": self.metrics,
            "turns": [
                {
                    "observation_tokens": t.observation_tokens,
                    "action_tokens": t.action_tokens,
                    "action_logprobs": t.action_logprobs,
                    "reward": t.reward,
                    "observation_messages": t.observation_messages,
                    "action_text": t.action_text,
                    "error": t.error,
                    "metrics": t.metrics,
                    "info": t.info,
                }
                for t in self.turns
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trajectory:
        return cls(
            turns=[Turn(**t) for t in data["turns"]],
            env_name=data.get("env_name", ""),
            error=data.get("error"),
            metrics=data.get("metrics", {}),
        )
