"""`reasoning_gym` (generator x single turn): one procedural task of reasoning-gym per group.

reasoning-gym (Apache-2.0, an optional dependency: the `envs` extra) has ~100 generators
(chain_sum, countdown, leg_counting, arc_agi, ...), each with its own config and scorer. The
env config names one (`dataset`) with that generator's own settings (`options`), or a weighted
`composite` of several. Each group draws one item of the `size` items of the seeded dataset.

The item is generated once, where the group is built, and travels inside the group builder as
the library made it (pickled, never rebuilt from JSON): a few generators give another item for
the same seed under another PYTHONHASHSEED, and arc_agi's answers stop matching once JSON has
turned its tuples into lists. The dataset object itself stays out of the builder; the scorer
comes from a per-process cache of datasets, rebuilt from the config where the episode is
stepped.

Reward: the generator's score of the extracted answer (0..1). With `partial_credit` false (the
default) a score below 1 counts as 0, since most scorers give 0.01-0.05 to any wrong answer. An
answer that cannot be extracted is error "no_answer"; a scorer that raises is error
"scorer_error" with the exception in `info` (reward 0), never a crashed episode.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from environments.grading import last_boxed
from environments.types import Episode, GroupBuilder, Message, StepResult, StopCondition

COMPOSITE = "composite"
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_INSTRUCTIONS = {
    "answer_tag": "\n\nGive your final answer inside <answer></answer> tags.",
    "last_line": "\n\nGive your final answer alone on the last line.",
    "boxed": "\n\nGive your final answer in \\boxed{}.",
}
_DOCS = "see GET /api/v1/environments/reasoning_gym for the generator names"


def _library() -> dict[str, Any]:
    """reasoning-gym's registry of generators: name -> (dataset class, config class)."""
    try:
        from reasoning_gym.factory import DATASETS  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ValueError(
            "reasoning-gym is not installed on this server (the `envs` extra of opentinker)"
        ) from exc
    return dict(DATASETS)


def generator_names() -> list[str]:
    """The generators a config may name, `composite` included; empty without the library."""
    try:
        names = set(_library())
    except ValueError:
        return []
    return sorted(names | {COMPOSITE})


def _check_generator(name: str, *, allow_composite: bool) -> None:
    known = _library()
    if name == COMPOSITE and allow_composite:
        return
    if name not in known:
        close = difflib.get_close_matches(name, list(known), n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown reasoning-gym generator {name!r}{hint} ({_DOCS})")


def _check_options(name: str, options: dict[str, Any]) -> None:
    """Build the generator's own config from `options`, as `create_dataset` would."""
    config_cls = _library()[name][1]
    known = {f.name for f in dataclasses.fields(config_cls)}
    for key in options:
        if key in ("size", "seed"):
            raise ValueError(f"{key!r} is set at the top level of env_config, not in options")
        if key not in known:
            others = ", ".join(sorted(known - {"size", "seed"}))
            raise ValueError(f"generator {name!r} has no option {key!r}; its options: {others}")
    try:
        config = config_cls(**options)
        if hasattr(config, "validate"):
            config.validate()
    except Exception as exc:
        # The library says why with bare asserts and type errors: keep its words, name it.
        raise ValueError(
            f"generator {name!r} refused its options: {type(exc).__name__}: {exc}"
        ) from exc


@pydantic_dataclass(frozen=True, config=ConfigDict(use_attribute_docstrings=True))
class CompositeMember:
    """One generator of a `composite` dataset."""

    name: str
    """A reasoning-gym generator name (not `composite`)."""
    weight: float = 1.0
    """Relative sampling weight (> 0)."""
    config: dict[str, Any] = field(default_factory=dict)
    """That generator's own options, as in `options`."""


@pydantic_dataclass(frozen=True, config=ConfigDict(use_attribute_docstrings=True))
class ReasoningGymConfig:
    dataset: str = "chain_sum"
    """A reasoning-gym generator name (the list is under `choices`), or `composite`."""
    options: dict[str, Any] = Field(default_factory=dict, validate_default=True)
    """The generator's own settings (e.g. {"min_terms": 2, "max_terms": 3} for chain_sum)."""
    datasets: list[CompositeMember] = Field(default_factory=list, validate_default=True)
    """For `composite` only: the generators to mix, each {name, weight, config}."""
    size: int = Field(default=10_000, ge=1, le=10**9)
    """How many distinct items the seeded dataset holds; each group draws one by its seed."""
    seed: int = Field(default=0, ge=0)
    """The dataset's seed: the same seed and size give the same items."""
    partial_credit: bool = False
    """Reward the scorer's fractional score; when false a score below 1.0 earns 0."""
    answer_format: Literal["answer_tag", "last_line", "boxed"] = "answer_tag"
    """Where the answer is read: the last <answer>...</answer>, the last non-empty line, or
    the last \\boxed{} (the form the project's math envs and its tiny model use)."""
    instruction: str | None = None
    """Appended to the question; None uses the answer format's own, "" appends nothing."""
    system_prompt: str = ""
    max_tokens: int = Field(default=256, ge=1)

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        _check_generator(value, allow_composite=True)
        return value

    @field_validator("options")
    @classmethod
    def _valid_options(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name = info.data.get("dataset")
        if name is None:  # the dataset itself was refused, which says enough
            return value
        if name == COMPOSITE:
            if value:
                raise ValueError("a composite dataset takes its generators' options in datasets")
            return value
        _check_options(name, value)
        return value

    @field_validator("datasets")
    @classmethod
    def _valid_members(
        cls, value: list[CompositeMember], info: ValidationInfo
    ) -> list[CompositeMember]:
        name = info.data.get("dataset")
        if name is None:
            return value
        if name != COMPOSITE:
            if value:
                raise ValueError(f"datasets is for dataset 'composite', not {name!r}")
            return value
        if not value:
            raise ValueError("a composite dataset needs at least one generator")
        seen: set[str] = set()
        for i, member in enumerate(value):
            where = f"datasets[{i}]"
            if member.name in seen:
                raise ValueError(f"{where}: generator {member.name!r} is listed twice")
            seen.add(member.name)
            if not member.weight > 0:
                raise ValueError(f"{where}: weight must be > 0, got {member.weight}")
            try:
                _check_generator(member.name, allow_composite=False)
                _check_options(member.name, member.config)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
        return value


def _key(config: ReasoningGymConfig) -> str:
    members = [(m.name, m.weight, m.config) for m in config.datasets]
    return json.dumps(
        [config.dataset, config.options, members, config.size, config.seed],
        sort_keys=True,
        default=repr,
    )


@functools.lru_cache(maxsize=32)
def _dataset_for(key: str) -> Any:
    import reasoning_gym  # type: ignore[import-untyped]

    name, options, members, size, seed = json.loads(key)
    if name != COMPOSITE:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
    from reasoning_gym.composite import DatasetSpec  # type: ignore[import-untyped]

    specs = [DatasetSpec(name=n, weight=w, config=dict(c)) for n, w, c in members]
    return reasoning_gym.create_dataset(COMPOSITE, size=size, seed=seed, datasets=specs)


def dataset(config: ReasoningGymConfig) -> Any:
    """The library's dataset object for `config`, built once per process."""
    return _dataset_for(_key(config))


def entry_index(config: ReasoningGymConfig, group_seed: int) -> int:
    # String seeding goes through sha512: the same index under any PYTHONHASHSEED.
    return random.Random(f"reasoning-gym-{group_seed}").randrange(config.size)


def extract(text: str, answer_format: str) -> str | None:
    if answer_format == "boxed":
        boxed = last_boxed(text)
        return boxed.strip() if boxed is not None else None
    if answer_format == "answer_tag":
        found = _ANSWER_TAG.findall(text)
        return found[-1].strip() if found else None
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def format_answer(answer: str, answer_format: str) -> str:
    """How a completion that gives `answer` looks in this format (for scripted policies)."""
    if answer_format == "boxed":
        return f"\\boxed{{{answer}}}"
    return f"<answer>{answer}</answer>" if answer_format == "answer_tag" else f"\n{answer}"


class ReasoningGymEpisode(Episode):
    def __init__(self, entry: dict[str, Any], config: ReasoningGymConfig) -> None:
        super().__init__()
        self.entry = entry
        self.config = config

    def _initial(self) -> tuple[list[Message], StopCondition]:
        messages: list[Message] = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        instruction = self.config.instruction
        if instruction is None:
            instruction = _INSTRUCTIONS[self.config.answer_format]
        messages.append({"role": "user", "content": str(self.entry["question"]) + instruction})
        return messages, StopCondition(max_tokens=self.config.max_tokens)

    def _step(self, action: str) -> StepResult:
        given = extract(action, self.config.answer_format)
        truth = self.entry.get("answer")
        info: dict[str, Any] = {
            "given": given,
            "answer": None if truth is None else str(truth),
            "source": str(self.entry.get("metadata", {}).get("source_dataset", "")),
        }
        if given is None:
            return StepResult(
                reward=0.0,
                done=True,
                error="no_answer",
                metrics={"correct": 0.0, "score": 0.0, "format": 0.0},
                info=info,
            )
        try:
            score = float(dataset(self.config).score_answer(answer=given, entry=self.entry))
        except Exception as exc:
            info["scorer_error"] = f"{type(exc).__name__}: {exc}"
            return StepResult(
                reward=0.0,
                done=True,
                error="scorer_error",
                metrics={"correct": 0.0, "score": 0.0, "format": 1.0},
                info=info,
            )
        correct = score >= 1.0
        reward = score if self.config.partial_credit else float(correct)
        info["score"] = score
        return StepResult(
            reward=reward,
            done=True,
            metrics={"correct": float(correct), "score": score, "format": 1.0},
            info=info,
        )


@dataclass
class ReasoningGymGroupBuilder(GroupBuilder):
    """The G episodes of one generated item; `entry` is that item as the library made it."""

    config: ReasoningGymConfig
    entry: dict[str, Any]
    index: int
    group_size: int
    env_name: str = "reasoning_gym"

    def make_episodes(self) -> list[Episode]:
        return [ReasoningGymEpisode(self.entry, self.config) for _ in range(self.group_size)]


def make_builder(
    config: ReasoningGymConfig, seed: int, group_size: int
) -> ReasoningGymGroupBuilder:
    """Generate the group's item here, once; the builder carries it from now on."""
    index = entry_index(config, seed)
    return ReasoningGymGroupBuilder(config, dataset(config)[index], index, group_size)
