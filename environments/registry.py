"""The environment registry: each environment's 2x2 cell, dataset schema and builder factory.

`check_contract(env_name, dataset)` is what job submission calls: a dataset environment needs a
dataset, a generator environment refuses one. `make_group_builders` turns (env, config, rows)
into the picklable group builders a runner or an env worker steps.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config

from environments.envs.bandit import BanditConfig, BanditGroupBuilder
from environments.envs.geometry import GeometryConfig, check_images
from environments.envs.geometry import make_builder as make_geometry_builder
from environments.envs.gomoku import GomokuConfig, GomokuGroupBuilder, GomokuSelfPlayGroupBuilder
from environments.envs.math_code import MathCodeConfig, MathCodeGroupBuilder
from environments.envs.math_env import MathConfig, MathGroupBuilder, row_context
from environments.envs.reasoning_gym_env import ReasoningGymConfig, generator_names, make_builder
from environments.envs.scienceworld_env import (
    ScienceWorldConfig,
    ScienceWorldGroupBuilder,
    listed_tasks,
)
from environments.envs.textarena_env import TextArenaConfig, TextArenaGroupBuilder, game_names
from environments.envs.textarena_seats import (
    TextArenaSelfPlayGroupBuilder,
    TextArenaSnapshotGroupBuilder,
)
from environments.envs.textworld_env import TextWorldConfig, TextWorldGroupBuilder, check_game
from environments.schema import Column, DatasetSchema
from environments.types import DataSource, GroupBuilder, Interaction


class ContractError(ValueError):
    """A job's environment settings break a registry rule. `field` names the offending key."""

    def __init__(self, field: str, reason: str, *, more: Sequence[tuple[str, str]] = ()) -> None:
        self.field = field
        self.reason = reason
        self.more = list(more)
        super().__init__(reason)

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "reason": self.reason}

    def problems(self) -> list[tuple[str, str]]:
        """Every ``(field, reason)`` found, this error's first (a config may break several)."""
        return [(self.field, self.reason), *self.more]


GroupFactory = Callable[..., GroupBuilder]


@dataclass(frozen=True)
class EnvSpec:
    name: str
    data_source: DataSource
    interaction: Interaction
    description: str
    config_cls: type
    factory: GroupFactory
    """factory(config, *, row, seed, group_size) -> GroupBuilder (row is None for generators)."""
    schema: DatasetSchema | None = None
    choices: Callable[[], dict[str, list[str]]] | None = None
    """The values a setting may take when only the environment's library knows them."""
    needs_images: bool = False
    """Its observations hold images: only a vision-language base model can play it."""

    @property
    def cell(self) -> tuple[str, str]:
        return self.data_source.value, self.interaction.value

    def describe(self) -> dict[str, Any]:
        """What a user needs to write a job against this environment (the environments API)."""
        return {
            "name": self.name,
            "data_source": self.data_source.value,
            "interaction": self.interaction.value,
            "description": self.description,
            "dataset_columns": self.schema.describe() if self.schema else None,
            "needs_images": self.needs_images,
            "config_schema": TypeAdapter(self.config_cls).json_schema(mode="serialization"),
            "choices": self.choices() if self.choices else {},
        }


_REGISTRY: dict[str, EnvSpec] = {}


def register(spec: EnvSpec) -> EnvSpec:
    if (spec.data_source is DataSource.DATASET) != (spec.schema is not None):
        raise ValueError(f"env {spec.name!r}: dataset environments need a schema, generators none")
    # The fields' docstrings are the only documentation of an env's settings: let the
    # config schema carry them as descriptions.
    with_config(ConfigDict(use_attribute_docstrings=True))(spec.config_cls)
    _REGISTRY[spec.name] = spec
    return spec


def env_names() -> list[str]:
    return sorted(_REGISTRY)


def get_env(name: str) -> EnvSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ContractError(
            "env", f"unknown environment {name!r}; known: {', '.join(env_names())}"
        ) from None


def _given(dataset: Any) -> bool:
    if dataset is None:
        return False
    if isinstance(dataset, str):
        return bool(dataset.strip())
    if isinstance(dataset, (list, tuple, dict)):
        return len(dataset) > 0
    return True


def check_contract(env_name: str, dataset: Any = None) -> None:
    """Raise ContractError when `dataset` does not fit the environment's data source."""
    spec = get_env(env_name)
    if spec.data_source is DataSource.GENERATOR and _given(dataset):
        raise ContractError(
            "dataset", f"env {env_name!r} is a generator environment and takes no dataset"
        )
    if spec.data_source is DataSource.DATASET and not _given(dataset):
        raise ContractError("dataset", f"env {env_name!r} reads a dataset: give `dataset`")


def pairs_episodes(env_name: str, config: dict[str, Any] | None = None) -> bool:
    """Self-play: a group's episodes play against each other (in one process, in pairs), so a
    group is even, inline, and evaluated two at a time."""
    if env_name == "gomoku_selfplay":
        return True
    return env_name == "textarena" and (config or {}).get("opponent") == "selfplay"


def frozen_opponent(env_name: str, config: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The frozen policy a config plays against, {"job": id or None (the base model),
    "checkpoint": name or None}; None when its episodes play no frozen policy."""
    config = config or {}
    if env_name != "textarena" or config.get("opponent") != "snapshot":
        return None
    return {"job": config.get("opponent_job"), "checkpoint": config.get("opponent_checkpoint")}


def shows_images(env_name: str) -> bool:
    """Its observations hold images (a vision-language base model only); False for an
    unknown env, which the contract check names."""
    spec = _REGISTRY.get(env_name)
    return spec is not None and spec.needs_images


def make_config(env_name: str, config: dict[str, Any] | None = None) -> Any:
    """Build the env's config dataclass from JSON, naming any unknown or bad key."""
    spec = get_env(env_name)
    config = dict(config or {})
    known = {f.name for f in dataclasses.fields(spec.config_cls)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ContractError(
            f"env_config.{unknown[0]}",
            f"unknown setting for env {env_name!r}; known: {', '.join(sorted(known))}",
        )
    try:
        return spec.config_cls(**config)
    except ValidationError as exc:
        # Pydantic configs say which setting is wrong: name it, as for an unknown key.
        found = []
        for error in exc.errors():
            path = ".".join(str(part) for part in error["loc"])
            reason = str(error["msg"]).removeprefix("Value error, ")
            found.append((f"env_config.{path}" if path else "env_config", reason))
        raise ContractError(*found[0], more=found[1:]) from exc
    except (TypeError, ValueError) as exc:
        raise ContractError("env_config", str(exc)) from exc


def group_specs(
    env_name: str,
    *,
    config: dict[str, Any] | None = None,
    rows: list[dict[str, Any]] | None = None,
    n_groups: int,
    group_size: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """JSON descriptions of `n_groups` groups, reproducible from `seed`.

    A spec is {"env", "config", "row", "seed", "group_size"}: everything needed to rebuild the
    group anywhere (an env worker gets specs, never pickles). Dataset rows are drawn without
    replacement in a seeded order; generator groups get distinct seeds.
    """
    spec = get_env(env_name)
    check_contract(env_name, rows)
    make_config(env_name, config)
    if n_groups < 1 or group_size < 1:
        raise ContractError("group_size", "n_groups and group_size must be >= 1")
    if spec.data_source is DataSource.DATASET:
        assert rows is not None
        picked: list[dict[str, Any] | None] = list(_pick_rows(rows, n_groups, seed))
    else:
        picked = [None] * n_groups
    return [
        {
            "env": env_name,
            "config": dict(config or {}),
            "row": row,
            "seed": seed * 100_003 + i,
            "group_size": group_size,
        }
        for i, row in enumerate(picked)
    ]


def build_group(group_spec: dict[str, Any]) -> GroupBuilder:
    """The group builder for one spec from `group_specs`."""
    try:
        env_name = group_spec["env"]
        group_size = int(group_spec["group_size"])
        seed = int(group_spec["seed"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ContractError("group", f"malformed group spec: {exc!r}") from exc
    spec = get_env(env_name)
    row = group_spec.get("row")
    if (spec.data_source is DataSource.DATASET) != (row is not None):
        raise ContractError(
            "group.row",
            f"env {env_name!r} is a {spec.data_source.value} "
            "environment: a group needs a row exactly when it reads a dataset",
        )
    config = make_config(env_name, group_spec.get("config"))
    try:
        return spec.factory(config, row=row, seed=seed, group_size=group_size)
    except ContractError:
        raise
    except ValueError as exc:
        raise ContractError("group_size", str(exc)) from exc


def make_group_builders(
    env_name: str,
    *,
    config: dict[str, Any] | None = None,
    rows: list[dict[str, Any]] | None = None,
    n_groups: int,
    group_size: int,
    seed: int = 0,
) -> list[GroupBuilder]:
    """`n_groups` builders of `group_size` episodes each, reproducible from `seed`."""
    return [
        build_group(s)
        for s in group_specs(
            env_name, config=config, rows=rows, n_groups=n_groups, group_size=group_size, seed=seed
        )
    ]


def _pick_rows(rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[order[i % len(order)]] for i in range(n)]


def _context_problem(value: Any) -> str | None:
    try:
        row_context(value)
    except ValueError as exc:
        return str(exc)
    return None


def _register_builtins() -> None:
    qa_schema = DatasetSchema(
        (
            Column("question", (str,), description="the problem shown to the model"),
            Column(
                "answer", (str, int, float), description="ground truth, compared for equivalence"
            ),
            Column(
                "context",
                (list,),
                description="math only: user and assistant turns shown before the question, "
                "ending with the assistant's (e.g. a game's earlier turns)",
                check=_context_problem,
                required=False,
            ),
            Column(
                "completion",
                (str,),
                description="SFT only: the assistant reply taught verbatim (default: the answer "
                "in \\boxed{})",
                required=False,
            ),
        )
    )

    def math_factory(config: Any, *, row: Any, seed: int, group_size: int) -> GroupBuilder:
        try:
            context = row_context(row.get("context"))
        except ValueError as exc:
            raise ContractError("row.context", str(exc)) from exc
        return MathGroupBuilder(
            str(row["question"]), str(row["answer"]), group_size, config, context
        )

    def math_code_factory(config: Any, *, row: Any, seed: int, group_size: int) -> GroupBuilder:
        return MathCodeGroupBuilder(str(row["question"]), str(row["answer"]), group_size, config)

    def bandit_factory(config: Any, *, row: Any, seed: int, group_size: int) -> GroupBuilder:
        return BanditGroupBuilder(config, seed, group_size)

    def gomoku_factory(config: Any, *, row: Any, seed: int, group_size: int) -> GroupBuilder:
        return GomokuGroupBuilder(config, seed, group_size)

    def gomoku_selfplay_factory(
        config: Any, *, row: Any, seed: int, group_size: int
    ) -> GroupBuilder:
        return GomokuSelfPlayGroupBuilder(config, seed, group_size)

    def reasoning_gym_factory(config: Any, *, row: Any, seed: int, group_size: int) -> GroupBuilder:
        try:
            return make_builder(config, seed, group_size)
        except Exception as exc:
            # Options the generator's config accepted and its dataset then refused.
            raise ContractError(
                "env_config.options",
                f"reasoning-gym could not generate from {config.dataset!r}: "
                f"{type(exc).__name__}: {exc}",
            ) from exc

    def textarena_factory(config: Any, *, row: Any, seed: int, group_size: int) -> GroupBuilder:
        if config.opponent == "selfplay":
            return TextArenaSelfPlayGroupBuilder(config, seed, group_size)
        if config.opponent == "snapshot":
            return TextArenaSnapshotGroupBuilder(config, seed, group_size)
        return TextArenaGroupBuilder(config, seed, group_size)

    def textworld_factory(config: Any, *, row: Any, seed: int, group_size: int) -> GroupBuilder:
        try:
            game = check_game(row.get("game"))
        except ValueError as exc:
            raise ContractError("row.game", str(exc)) from exc
        return TextWorldGroupBuilder(config, game, group_size)

    register(
        EnvSpec(
            "math",
            DataSource.DATASET,
            Interaction.SINGLE_TURN,
            "Answer a problem; reward 1 if the final answer is equivalent to the truth.",
            MathConfig,
            math_factory,
            qa_schema,
        )
    )
    register(
        EnvSpec(
            "math_code",
            DataSource.DATASET,
            Interaction.MULTI_TURN,
            "Solve a problem, optionally running Python in the sandbox between turns.",
            MathCodeConfig,
            math_code_factory,
            qa_schema,
        )
    )
    register(
        EnvSpec(
            "bandit",
            DataSource.GENERATOR,
            Interaction.SINGLE_TURN,
            "Pick an arm of a K-armed bandit with hidden means; reward is the payoff.",
            BanditConfig,
            bandit_factory,
        )
    )
    register(
        EnvSpec(
            "gomoku",
            DataSource.GENERATOR,
            Interaction.MULTI_TURN,
            "k-in-a-row on a small board against a built-in heuristic opponent.",
            GomokuConfig,
            gomoku_factory,
        )
    )
    register(
        EnvSpec(
            "gomoku_selfplay",
            DataSource.GENERATOR,
            Interaction.MULTI_TURN,
            "Gomoku where two episodes of the group play each other.",
            GomokuConfig,
            gomoku_selfplay_factory,
        )
    )
    register(
        EnvSpec(
            "reasoning_gym",
            DataSource.GENERATOR,
            Interaction.SINGLE_TURN,
            "A procedural reasoning task from reasoning-gym, graded by its own scorer.",
            ReasoningGymConfig,
            reasoning_gym_factory,
            choices=lambda: {"dataset": generator_names()},
        )
    )
    register(
        EnvSpec(
            "textarena",
            DataSource.GENERATOR,
            Interaction.MULTI_TURN,
            "A TextArena game: one-player puzzles, or two-player games against a random "
            "legal-move opponent or in self-play.",
            TextArenaConfig,
            textarena_factory,
            choices=lambda: {"game": game_names()},
        )
    )
    register(
        EnvSpec(
            "textworld",
            DataSource.DATASET,
            Interaction.MULTI_TURN,
            "A generated TextWorld text adventure (cooking or pick-and-place); each command's "
            "reward is the score it gains.",
            TextWorldConfig,
            textworld_factory,
            DatasetSchema(
                (
                    Column(
                        "game",
                        (str,),
                        description="the game file, relative to the pool that "
                        "scripts/build_textworld_games.py builds",
                    ),
                )
            ),
        )
    )

    def scienceworld_factory(config: Any, *, row: Any, seed: int, group_size: int) -> GroupBuilder:
        return ScienceWorldGroupBuilder(config, seed, group_size)

    register(
        EnvSpec(
            "scienceworld",
            DataSource.GENERATOR,
            Interaction.MULTI_TURN,
            "A ScienceWorld task (30 elementary-science tasks in a text world; needs Java 17); "
            "each action's reward is the score it gains.",
            ScienceWorldConfig,
            scienceworld_factory,
            choices=lambda: {"task": listed_tasks()},
        )
    )

    def geometry_factory(config: Any, *, row: Any, seed: int, group_size: int) -> GroupBuilder:
        try:
            return make_geometry_builder(config, row, group_size)
        except ValueError as exc:
            raise ContractError("row.images", str(exc)) from exc

    register(
        EnvSpec(
            "geometry",
            DataSource.DATASET,
            Interaction.SINGLE_TURN,
            "A geometry3k-style problem: a diagram (an image: needs a vision-language base "
            "model) and a question; reward 1 if the final answer equals the truth.",
            GeometryConfig,
            geometry_factory,
            DatasetSchema(
                (
                    Column(
                        "images",
                        (list,),
                        description="the diagrams: PNG or JPEG images, each as base64 or a "
                        "data:image/...;base64 URI",
                        check=check_images,
                    ),
                    Column(
                        "problem",
                        (str,),
                        description="the question; <image> marks where an image goes",
                    ),
                    Column(
                        "answer",
                        (str, int, float),
                        description="ground truth, compared for equivalence",
                    ),
                )
            ),
            needs_images=True,
        )
    )


_register_builtins()
