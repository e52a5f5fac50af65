"""`scienceworld` (generator x multi turn): ScienceWorld's 30 elementary-science tasks
(Apache-2.0; an optional dependency, the `envs` extra) as text games. Each task runs in a
Java simulator (one JVM per live game), so Java 17 must be on every machine that steps
episodes (Debian: openjdk-17-jre-headless; `scripts/install_java.sh`); without it a config
naming this env is refused with a message that says so.

A group plays one variation of the task: the job's seed picks it from the task's `split`
(ScienceWorld's own train / dev / test variations), so held-out evaluation can play
variations training never saw. Observations: the task and the first look around, then what
the simulator printed for each action (optionally with the actions it accepts now).

Reward per turn: the score that action gained (ScienceWorld scores 0-100 per task, in steps
of the task's subgoals; a failed task drops to -100 and ends), divided by 100 unless
`normalize_score` is off. The episode ends when the task is completed or failed, or after
`max_turns` actions.

Pickling: the simulator is a JVM behind py4j, so an episode keeps (task, variation, actions so
far) and rebuilds by replaying them (the simulator is deterministic for a variation); each
process keeps its live games by episode (`environments.live_cache`), so a replay happens only
when a turn lands on another process.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from environments.envs.textworld_env import parse_command
from environments.live_cache import LiveCache, Replaying
from environments.types import Episode, GroupBuilder, Message, StepResult, StopCondition

# A JVM per live game (~100-200 MiB): a process keeps a few; an evicted one is shut down and
# its episode, should it come back, replays.
CACHE_SIZE = 8
MAX_SCORE = 100
SIMPLIFICATIONS = (
    "easy",
    "teleportAction",
    "selfWateringFlowerPots",
    "openContainers",
    "openDoors",
    "noElectricalAction",
)
JAVA_MISSING = (
    "ScienceWorld needs Java 17 on every machine that steps episodes, and this server has no "
    "`java` (Debian: openjdk-17-jre-headless; scripts/install_java.sh installs it)"
)
INSTRUCTIONS = (
    "You are doing a science task in a text world. Reply with one action per turn, such as "
    '"look around", "open door to kitchen", "go to kitchen", "pick up thermometer" or '
    '"focus on substance in pot".'
)


def _library() -> Any:
    try:
        import scienceworld  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ValueError(
            "scienceworld is not installed on this server (the `envs` extra of opentinker)"
        ) from exc
    return scienceworld


@cache
def task_names() -> list[str]:
    """The 30 tasks, from the library's own list (no JVM needed)."""
    _library()
    from scienceworld.constants import ID2TASK  # type: ignore[import-untyped]

    return list(ID2TASK.values())


def listed_tasks() -> list[str]:
    """The tasks for `GET /api/v1/environments` ([] where the library is missing)."""
    try:
        return task_names()
    except ValueError:
        return []


@pydantic_dataclass(frozen=True, config=ConfigDict(use_attribute_docstrings=True))
class ScienceWorldConfig:
    task: str = Field(default="find-living-thing", validate_default=True)
    """One of ScienceWorld's 30 task names (`choices.task` of the environment)."""
    split: Literal["train", "dev", "test"] = "train"
    """Whose variations the seeds draw from: ScienceWorld's train, dev or test variations."""
    simplifications: str = "easy"
    """Comma-separated ScienceWorld simplifications ("easy" = teleportAction, openDoors,
    selfWateringFlowerPots, noElectricalAction; "" for none)."""
    max_turns: int = Field(default=16, ge=1, le=100)
    """Actions per episode; the job's `rollout.max_turns` must be at least as large."""
    show_valid_actions: bool = False
    """Append the actions the simulator accepts now (many: long prompts) to each observation."""
    normalize_score: bool = True
    """Divide each turn's score gain by 100, so a completed task totals 1."""
    max_tokens: int = Field(default=32, ge=1)

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str) -> str:
        names = task_names()
        if value not in names:
            raise ValueError(f"unknown task {value!r}; known: {', '.join(names)}")
        if shutil.which("java") is None:
            raise ValueError(JAVA_MISSING)
        return value

    @field_validator("simplifications")
    @classmethod
    def _known_simplifications(cls, value: str) -> str:
        unknown = [s for s in value.split(",") if s and s not in SIMPLIFICATIONS]
        if unknown:
            raise ValueError(f"unknown simplification(s) {unknown}; known: {SIMPLIFICATIONS}")
        return value


class LiveTask:
    """A running simulator at one variation of a task, and every action it was given."""

    def __init__(self, config: ScienceWorldConfig, variation: int) -> None:
        library = _library()
        self.env = library.ScienceWorldEnv("", envStepLimit=10_000)
        self.env.load(config.task, variation, config.simplifications)
        self.first_text, self.info = self.env.reset()
        self.actions: list[str] = []
        self.score = 0
        self.done = False

    @classmethod
    def replay(cls, config: ScienceWorldConfig, variation: int, actions: list[str]) -> LiveTask:
        live = cls(config, variation)
        for action in actions:
            live.step(action)
        return live

    def step(self, action: str) -> str:
        self.actions.append(action)
        text, _, done, self.info = self.env.step(action)
        self.score = int(self.info["score"])
        self.done = bool(done)
        return str(text)

    def valid_actions(self) -> list[str]:
        return sorted(str(a) for a in self.info.get("valid", []))

    def close(self) -> None:
        self.env.close()


CACHE: LiveCache[LiveTask] = LiveCache(CACHE_SIZE, on_evict=LiveTask.close)


def clear_cache() -> None:
    CACHE.clear()


@cache
def _variations(task: str, split: str, simplifications: str) -> tuple[int, ...]:
    """A task's variations of one split (asking the simulator takes a JVM: once a process)."""
    probe = _library().ScienceWorldEnv("", envStepLimit=10)
    try:
        probe.load(task, 0, simplifications)
        listed = {
            "train": probe.get_variations_train,
            "dev": probe.get_variations_dev,
            "test": probe.get_variations_test,
        }[split]()
    finally:
        probe.close()
    return tuple(sorted(int(v) for v in listed))


def variation_of(config: ScienceWorldConfig, seed: int) -> int:
    """The variation a group of this seed plays: one of the task's `split` variations."""
    variations = _variations(config.task, config.split, config.simplifications)
    if not variations:
        raise ValueError(f"task {config.task!r} has no {config.split} variations")
    return variations[seed % len(variations)]


def gold_actions(config: ScienceWorldConfig, variation: int) -> list[str]:
    """ScienceWorld's own solution of a variation (scripted baselines and tests)."""
    env = _library().ScienceWorldEnv("", envStepLimit=10_000)
    try:
        env.load(config.task, variation, config.simplifications, generateGoldPath=True)
        return [str(a) for a in env.get_gold_action_sequence()]
    finally:
        env.close()


class ScienceWorldEpisode(Replaying[LiveTask], Episode):
    """The model does one variation of a task."""

    def __init__(self, config: ScienceWorldConfig, variation: int) -> None:
        super().__init__()
        self.config = config
        self.variation = variation
        self.key = uuid.uuid4().hex
        self.actions: list[str] = []
        self.turns = 0
        self.score = 0
        self._live: LiveTask | None = None

    def _cache(self) -> LiveCache[LiveTask]:
        return CACHE

    def _log(self) -> list[str]:
        return self.actions

    def _rebuild(self) -> LiveTask:
        return LiveTask.replay(self.config, self.variation, self.actions)

    def _observation(self, live: LiveTask, text: str) -> str:
        text = text.strip()
        if not self.config.show_valid_actions:
            return text
        return f"{text}\n\nActions you can use now: {', '.join(live.valid_actions())}"

    def _initial(self) -> tuple[list[Message], StopCondition]:
        live = self._live_game()
        task = str(live.info.get("taskDesc", "")).strip()
        text = self._observation(live, live.first_text)
        message: Message = {"role": "user", "content": f"{INSTRUCTIONS}\n\n{task}\n\n{text}"}
        return [message], StopCondition(max_tokens=self.config.max_tokens)

    def _step(self, action: str) -> StepResult:
        live = self._live_game()
        command = parse_command(action)
        self.turns += 1
        gain = 0.0
        error = None
        if command:
            text = live.step(command)
            self.actions.append(command)
            gain, self.score = float(live.score - self.score), live.score
            if self.config.normalize_score:
                gain /= MAX_SCORE
        else:
            error = "empty_command"
            text = '(no action: reply with one action, such as "look around")'
        completed = live.done and live.score >= MAX_SCORE
        failed = live.done and live.score < 0
        if live.done or self.turns >= self.config.max_turns:
            outcome = "completed" if completed else "failed" if failed else "max_turns"
            self.close()
            return StepResult(
                reward=gain,
                done=True,
                error=error or ("max_turns" if outcome == "max_turns" else None),
                metrics={
                    "completed": float(completed),
                    "failed": float(failed),
                    "score": float(self.score),
                    "moves": float(len(self.actions)),
                },
                info={"outcome": outcome, "score": self.score, "last_text": text.strip()},
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
class ScienceWorldGroupBuilder(GroupBuilder):
    """G episodes of one variation of a task: the same world, so advantages compare actions.
    The variation is drawn from the seed where the group is first played (it needs a JVM)."""

    config: ScienceWorldConfig
    seed: int
    group_size: int
    env_name: str = "scienceworld"
    variation: int | None = None

    def make_episodes(self) -> list[Episode]:
        if self.variation is None:
            self.variation = variation_of(self.config, self.seed)
        return [ScienceWorldEpisode(self.config, self.variation) for _ in range(self.group_size)]
