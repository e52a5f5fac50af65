"""The rollout driver: every live episode of every group sampled together, one batch a turn.

The episodes are driven by `EpisodeRecorder`, the recorder of `environments.rollouts`, so
token layout and masks are those of the inline rollouts; the environments step in this
process or on env workers (`environments.remote.RemoteGroups`), with the same sampler
requests, and so the same trajectories, either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from environments.registry import build_group
from environments.remote import RemoteGroups
from environments.renderer import Renderer
from environments.rollouts import (
    EpisodeRecorder,
    PolicyFn,
    PolicyInput,
    PolicyOutput,
    apply_group_rewards,
    play_concurrent,
)
from environments.types import GroupBuilder, StepResult, Trajectory
from training.engine import Engine
from training.policy import Policy
from training.sampler import SampleRequest, sample
from training.types import SamplingParams
from workers.runners.loop_types import TrainingError
from workers.runners.pictures import images_of

__all__ = ["InlineGroups", "Opponent", "RolloutStats", "SeedFn", "play_groups"]

# (group, episode, turn) -> the sampling seed of that row.
SeedFn = Callable[[int, int, int], int]


@dataclass(frozen=True)
class Opponent:
    """The frozen policy that plays a builder's `opponent_episodes`: an engine policy (None:
    the base model) at a published version (None: its live weights, which nothing trains)."""

    policy_id: str | None
    version: int | None = None


@dataclass
class RolloutStats:
    sampled_tokens: int = 0
    seconds: float = 0.0


class InlineGroups:
    """Groups whose episodes live in this process: `environments.remote.RemoteGroups`'s
    interface, with the exceptions worded as `rollouts.run_episode` words them."""

    def __init__(self, builders: Sequence[GroupBuilder]) -> None:
        self.episodes = [builder.make_episodes() for builder in builders]

    def start(self) -> list[list[tuple[list[Any], Any] | str]]:
        out: list[list[tuple[list[Any], Any] | str]] = []
        for episodes in self.episodes:
            row: list[tuple[list[Any], Any] | str] = []
            for episode in episodes:
                try:
                    row.append(episode.initial_observation())
                except Exception as exc:  # an env crash is a value
                    row.append(f"{type(exc).__name__}: {exc}")
            out.append(row)
        return out

    def step(self, actions: Sequence[Sequence[str | None]]) -> list[list[StepResult | str | None]]:
        out: list[list[StepResult | str | None]] = []
        for episodes, group_actions in zip(self.episodes, actions, strict=True):
            row: list[StepResult | str | None] = []
            for episode, action in zip(episodes, group_actions, strict=True):
                if action is None:
                    row.append(None)
                    continue
                try:
                    row.append(episode.step(action))
                except Exception as exc:  # an env crash is a value
                    row.append(f"{type(exc).__name__}: {exc}")
            out.append(row)
        return out

    def close(self) -> None:
        for episodes in self.episodes:
            for episode in episodes:
                episode.close()


def play_groups(
    engine: Engine,
    renderer: Renderer,
    group_specs: Sequence[dict[str, Any]],
    *,
    policy: Policy | None,
    version: int | None,
    temperature: float,
    top_p: float,
    max_tokens: int,
    max_turns: int,
    seed_of: SeedFn,
    stats: RolloutStats | None = None,
    env_execution: str = "inline",
    opponent: Opponent | None = None,
) -> list[list[Trajectory]]:
    """Play every group to the end with one sampler batch per turn across all live episodes.

    The episodes are driven by `EpisodeRecorder`, the recorder of `rollouts.run_episode`, so
    token layout and masks are those of the inline rollouts. The environments step in this
    process (`env_execution` "inline") or on env workers ("queue": one task per group and
    turn, `environments.remote.RemoteGroups`); the requests to the sampler, and so the
    trajectories, are the same either way. Builders whose episodes must run concurrently
    (self-play, a frozen opponent) run inline, one thread per episode with a one-row policy
    function; `opponent` samples the builder's `opponent_episodes`, which are not returned.
    `seed_of(group, episode, turn)` gives each row's sampling seed.
    """
    started = time.perf_counter()
    policy_id = policy.id if policy is not None else None
    max_positions = int(
        getattr(engine.model.config.get_text_config(), "max_position_embeddings", 0) or 0
    )
    counter = stats or RolloutStats()

    def params_for(inp: PolicyInput, seed: int) -> SamplingParams | None:
        limit = min(max_tokens, inp.stop.max_tokens)
        if max_positions:
            limit = min(limit, max_positions - len(inp.tokens))
        if limit < 1:
            return None
        return SamplingParams(
            max_tokens=limit,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=inp.stop.stop,
            stop_token_ids=inp.stop.stop_token_ids,
        )

    def row_policy(g: int, e: int, frozen: bool) -> PolicyFn:
        """Episode e of group g, one sampler row a turn, its seeds its own."""
        if frozen and opponent is None:
            raise TrainingError(f"{builders[g].env_name!r} plays a frozen opponent: none given")
        who, at = (
            (opponent.policy_id, opponent.version) if frozen and opponent else (policy_id, version)
        )
        turns = iter(range(max_turns + 1))

        def one_row(inp: PolicyInput) -> PolicyOutput:
            params = params_for(inp, seed_of(g, e, next(turns)))
            if params is None:
                raise TrainingError("the conversation filled the model's context")
            request = SampleRequest(inp.tokens, params, 1, who, at, images_of(engine, inp.messages))
            seq = sample(engine, [request])[0][0]
            counter.sampled_tokens += len(seq.tokens)
            return PolicyOutput(tokens=seq.tokens, logprobs=seq.logprobs)

        return one_row

    if env_execution not in ("inline", "queue"):
        raise ValueError(f"env_execution must be 'inline' or 'queue', not {env_execution!r}")
    builders = [build_group(dict(spec)) for spec in group_specs]
    results: list[list[Trajectory] | None] = [None] * len(builders)
    lockstep: list[int] = []  # the groups played one sampler batch per turn
    for g, builder in enumerate(builders):
        if not getattr(builder, "concurrent", False):
            lockstep.append(g)
        elif env_execution == "queue":
            raise TrainingError(
                f"env {builder.env_name!r} plays a group's episodes against each other: "
                "it runs inline only"
            )
        else:
            results[g] = play_concurrent(
                builder, renderer, max_turns, lambda e, frozen, g=g: row_policy(g, e, frozen)
            )

    envs: Any
    if env_execution == "queue":
        envs = RemoteGroups([group_specs[g] for g in lockstep])
    else:
        envs = InlineGroups([builders[g] for g in lockstep])
    recorders: list[list[EpisodeRecorder]] = []  # [position in lockstep][episode]
    try:
        for g, observations in zip(lockstep, envs.start(), strict=True):
            row = []
            for obs in observations:
                rec = EpisodeRecorder(renderer, builders[g].env_name)
                if isinstance(obs, str):
                    rec.fail(f"initial_observation failed: {obs}")
                else:
                    rec.begin(*obs)
                row.append(rec)
            recorders.append(row)
        for turn in range(max_turns):
            requests, rows = [], []
            for k, row in enumerate(recorders):
                for e, rec in enumerate(row):
                    if rec.done:
                        continue
                    inp = rec.policy_input()
                    params = params_for(inp, seed_of(lockstep[k], e, turn))
                    if params is None:
                        rec.fail("the conversation filled the model's context")
                        continue
                    requests.append(
                        SampleRequest(
                            inp.tokens,
                            params,
                            1,
                            policy_id,
                            version,
                            images_of(engine, inp.messages),
                        )
                    )
                    rows.append((k, e, rec))
            if not requests:
                break
            outputs = sample(engine, requests)
            actions: list[list[str | None]] = [[None] * len(row) for row in recorders]
            for (k, e, rec), out in zip(rows, outputs, strict=True):
                seq = out[0]
                counter.sampled_tokens += len(seq.tokens)
                actions[k][e] = rec.take_action(
                    PolicyOutput(tokens=seq.tokens, logprobs=seq.logprobs)
                )
            stepped = envs.step(actions)
            for k, e, rec in rows:
                result = stepped[k][e]
                if result is None:
                    rec.fail("the env worker skipped a live episode")
                elif isinstance(result, str):
                    rec.fail(f"step failed: {result}", turn_error="env_exception")
                else:
                    rec.record(result)
        for row in recorders:
            for rec in row:
                if not rec.done:
                    rec.fail(f"max_turns ({max_turns}) reached before the episode ended")
    finally:
        envs.close()

    for g, row in zip(lockstep, recorders, strict=True):
        results[g] = apply_group_rewards(builders[g], [rec.trajectory for rec in row])
    counter.seconds += time.perf_counter() - started
    return [r for r in results if r is not None]
