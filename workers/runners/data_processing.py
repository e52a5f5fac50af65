"""From played groups to training data: advantages, RL datums, the KL penalty, SFT datums."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from environments.envs.math_env import sft_completion
from environments.registry import build_group
from environments.renderer import Renderer
from environments.types import Trajectory
from jobs.spec import JobSpec
from training import rl
from training.engine import Engine
from training.sampler import sequence_logprobs
from training.types import Datum
from workers.runners.pictures import encode_all, images_of

__all__ = [
    "RLBatch",
    "advantages",
    "apply_kl_penalty",
    "correct_flag",
    "mean",
    "rl_batch",
    "sft_datum",
    "std",
]


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def std(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def correct_flag(traj: Trajectory) -> float | None:
    """The env's own correctness flag of the final turn, where it has one (math envs)."""
    if traj.turns and "correct" in traj.turns[-1].metrics:
        return float(traj.turns[-1].metrics["correct"])
    return None


def advantages(spec: JobSpec, trajectories: list[Trajectory]) -> list[float | list[float]]:
    """One advantage per trajectory of a group (a list per turn for ``grpo_per_step``)."""
    algo = spec.algorithm
    if algo.advantage == "grpo_per_step":
        return list(
            rl.grpo_per_step(
                [t.rewards_per_turn for t in trajectories], normalize_std=algo.normalize_std
            )
        )
    rewards = [t.total_reward for t in trajectories]
    if algo.advantage == "grpo":
        adv = rl.grpo(rewards, normalize_std=algo.normalize_std)
    elif algo.advantage == "rloo":
        if len(rewards) < 2:
            return [0.0] * len(rewards)
        adv = rl.rloo(rewards)
    else:
        adv = rl.baseline(rewards, algo.baseline)
    return [float(a) for a in adv.tolist()]


@dataclass
class RLBatch:
    """An RL step's datums and what its episodes scored (every episode, errors included)."""

    datums: list[Datum] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    correct: list[float] = field(default_factory=list)
    errors: int = 0
    action_logprobs: list[float] = field(default_factory=list)


def rl_batch(
    spec: JobSpec, groups: Sequence[list[Trajectory]], engine: Engine | None = None
) -> RLBatch:
    """Advantages per group, then one datum per trajectory whose advantage is not all zero.
    `engine` processes the trajectories' images (a vision-language job)."""
    batch = RLBatch()
    for trajectories in groups:
        usable = [t for t in trajectories if t.turns]
        batch.errors += sum(1 for t in trajectories if t.error)
        for t in trajectories:
            batch.rewards.append(t.total_reward)
            flag = correct_flag(t)
            if flag is not None:
                batch.correct.append(flag)
            for turn in t.turns:
                batch.action_logprobs.extend(turn.action_logprobs)
        if not usable:
            continue
        for traj, adv in zip(usable, advantages(spec, usable), strict=True):
            values = adv if isinstance(adv, list) else [adv]
            # A zero advantage everywhere carries no gradient: skip the compute.
            if all(v == 0.0 for v in values):
                continue
            datum = rl.trajectory_to_datum(traj.to_engine(), adv)
            if spec.algorithm.loss_aggregation == "sequence_mean":
                # Every loss sums mask-weighted terms, so a mask summing to 1 per episode
                # gives each episode one unit of weight whatever its length.
                mask = datum.loss_fn_inputs["mask"]
                datum.loss_fn_inputs["mask"] = mask / mask.sum().clamp(min=1.0)
            pictures = traj.images()
            if pictures:
                if engine is None:
                    raise ValueError("a trajectory with images needs the engine to process them")
                datum.images = encode_all(engine, pictures)
            batch.datums.append(datum)
    return batch


def apply_kl_penalty(engine: Engine, datums: list[Datum], kl_coef: float) -> float:
    """Fold -kl_coef * (log pi_sampler - log pi_base) into each action token's advantage.

    Returns the mean per-token KL estimate (k1) over action tokens.
    """
    if not datums:
        return 0.0
    sequences = [
        [*d.model_input.tolist(), int(d.loss_fn_inputs["target_tokens"][-1])] for d in datums
    ]
    base = sequence_logprobs(
        engine.model,
        sequences,
        adapters=[None] * len(sequences),
        host=engine.host,
        images=[d.images for d in datums] if any(d.images for d in datums) else None,
    )
    total, count = 0.0, 0.0
    for datum, base_lp in zip(datums, base, strict=True):
        # The mask may carry the loss aggregation's weights; the penalty is per action token
        # and the loss applies those weights to it.
        action = (datum.loss_fn_inputs["mask"] > 0).float()
        kl = (datum.loss_fn_inputs["logprobs"] - torch.tensor(base_lp[1:])) * action
        datum.loss_fn_inputs["advantages"] = datum.loss_fn_inputs["advantages"] - kl_coef * kl
        total += float(kl.sum())
        count += float(action.sum())
    return total / count if count else 0.0


def sft_datum(
    renderer: Renderer,
    env_name: str,
    env_config: Mapping[str, Any],
    row: dict[str, Any],
    engine: Engine | None = None,
) -> Datum:
    """The env's own first observation, then the reply the row teaches (`sft_completion`)."""
    builder = build_group(
        {"env": env_name, "config": dict(env_config), "row": row, "seed": 0, "group_size": 1}
    )
    episode = builder.make_episodes()[0]
    try:
        messages, _ = episode.initial_observation()
    finally:
        episode.close()
    prompt = renderer.prompt_tokens(messages)
    answer = renderer.encode(sft_completion(row) + renderer.turn_end_text.strip())
    tokens = prompt + answer
    # weights[j] belongs to target token j + 1: only answer tokens carry loss.
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    datum = Datum.from_sequence(tokens, weights)
    if engine is not None and engine.processor is not None:
        datum.images = images_of(engine, messages)
    return datum
