"""RL building blocks: advantage estimators and the conversion of trajectories into datums.

Advantage functions take the rewards of ONE group (the samples drawn for one prompt), shape
(G,), or a stack of groups, shape (N, G), and work along the last dimension.

A trajectory is a list of turns; each turn is the tokens the environment (or the prompt)
contributed, then the tokens the model generated with their sampler log-probabilities. Only
model-generated tokens carry loss (mask 1); prompt, environment and tool tokens get mask 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from training.types import Datum, SampledSequence


def _rewards(rewards: Sequence[float] | Sequence[Sequence[float]] | torch.Tensor) -> torch.Tensor:
    # float64: a float32 group mean of equal rewards is off by an ulp, and a std of zero
    # then turns that ulp into a full-size advantage.
    tensor = torch.as_tensor(rewards, dtype=torch.float64)
    if tensor.dim() not in (1, 2) or tensor.shape[-1] == 0:
        raise ValueError(
            f"rewards must have shape (G,) or (N, G) with G >= 1, got {tuple(tensor.shape)}"
        )
    if not torch.isfinite(tensor).all():
        raise ValueError("rewards must be finite")
    return tensor


def grpo(
    rewards: Sequence[float] | Sequence[Sequence[float]] | torch.Tensor,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Reward minus the group mean; optionally divided by the group's std (+ eps)."""
    r = _rewards(rewards)
    advantages = _centred(r)
    if normalize_std:
        # Population std (unbiased=False): a group of one gets std 0, not NaN.
        advantages = advantages / (r.std(dim=-1, keepdim=True, unbiased=False) + eps)
    return advantages.float()


def _centred(r: torch.Tensor) -> torch.Tensor:
    """r minus its mean along the last dimension, exactly 0 where the rewards are equal.

    Rewards that are equal but for rounding (-0.1 - 0.1 - 1.0 against -1.0 - 0.1 - 0.1) carry
    no signal; left as they are, the std normalisation would scale their rounding up to an
    advantage of one sign for the whole group, pushing every sampled token down.
    """
    spread = r.amax(dim=-1, keepdim=True) - r.amin(dim=-1, keepdim=True)
    equal = spread <= 1e-9 * (1.0 + r.abs().amax(dim=-1, keepdim=True))
    return torch.where(equal, torch.zeros_like(r), r - r.mean(dim=-1, keepdim=True))


def rloo(rewards: Sequence[float] | Sequence[Sequence[float]] | torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean of the other G-1 rewards."""
    r = _rewards(rewards)
    size = r.shape[-1]
    if size < 2:
        raise ValueError("rloo needs at least two samples per group")
    # r_i - mean(others) = G / (G - 1) * (r_i - mean(all)).
    return (_centred(r) * size / (size - 1)).float()


def baseline(
    rewards: Sequence[float] | Sequence[Sequence[float]] | torch.Tensor, value: float = 0.0
) -> torch.Tensor:
    """Reward minus a fixed baseline (e.g. a running mean kept by the caller)."""
    return (_rewards(rewards) - float(value)).float()


def returns_to_go(rewards: Sequence[float], gamma: float = 1.0) -> list[float]:
    """R_t = sum_{k >= t} gamma^(k - t) r_k."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out


def grpo_per_step(
    turn_rewards: Sequence[Sequence[float]],
    gamma: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per-turn advantages for multi-turn agents.

    `turn_rewards[i][t]` is the reward after turn t of trajectory i of one group. Each turn's
    return-to-go is normalised by the mean (and std) over every turn of every trajectory in the
    group, so trajectories of different lengths share one baseline.
    """
    if not turn_rewards or any(len(turns) == 0 for turns in turn_rewards):
        raise ValueError("grpo_per_step needs a non-empty group of trajectories with >= 1 turn")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    returns = [returns_to_go(turns, gamma) for turns in turn_rewards]
    flat = torch.tensor([g for traj in returns for g in traj], dtype=torch.float64)
    if not torch.isfinite(flat).all():
        raise ValueError("rewards must be finite")
    centred = _centred(flat)
    if normalize_std:
        centred = centred / (flat.std(unbiased=False) + eps)
    values = iter(centred.tolist())
    return [[next(values) for _ in traj] for traj in returns]


@dataclass
class Turn:
    """One exchange: what the model was shown, then what it generated."""

    observation: list[int]
    """Prompt / environment / tool tokens before the action (no loss)."""
    action: list[int]
    """Model-generated tokens (carry loss)."""
    action_logprobs: list[float]
    """Sampler log-probability of each action token."""
    reward: float = 0.0
    """Reward received after this turn."""

    def __post_init__(self) -> None:
        if len(self.action_logprobs) != len(self.action):
            raise ValueError(
                f"turn has {len(self.action)} action tokens but "
                f"{len(self.action_logprobs)} logprobs"
            )


@dataclass
class Trajectory:
    turns: list[Turn] = field(default_factory=list)

    @property
    def total_reward(self) -> float:
        return sum(turn.reward for turn in self.turns)

    @property
    def turn_rewards(self) -> list[float]:
        return [turn.reward for turn in self.turns]


def trajectory_to_datum(trajectory: Trajectory, advantages: float | Sequence[float]) -> Datum:
    """One datum over the whole conversation; `advantages` is one number or one per turn.

    The sequence is obs_0 act_0 obs_1 act_1 ...; target position j predicts token j+1, which
    carries loss (mask 1, the sampler logprob, the turn's advantage) only if it is an action token.
    """
    turns = trajectory.turns
    if not turns:
        raise ValueError("trajectory has no turns")
    if isinstance(advantages, (int, float)):
        per_turn = [float(advantages)] * len(turns)
    else:
        per_turn = [float(a) for a in advantages]
        if len(per_turn) != len(turns):
            raise ValueError(f"{len(per_turn)} advantages for {len(turns)} turns")
    if not turns[0].observation:
        raise ValueError("the first turn needs a non-empty observation (the prompt)")
    tokens: list[int] = []
    logprobs: list[float] = []
    advantage: list[float] = []
    mask: list[float] = []
    for turn, adv in zip(turns, per_turn, strict=True):
        tokens.extend(turn.observation)
        logprobs.extend([0.0] * len(turn.observation))
        advantage.extend([0.0] * len(turn.observation))
        mask.extend([0.0] * len(turn.observation))
        tokens.extend(turn.action)
        logprobs.extend(float(lp) for lp in turn.action_logprobs)
        advantage.extend([adv] * len(turn.action))
        mask.extend([1.0] * len(turn.action))
    if len(tokens) < 2:
        raise ValueError("trajectory must hold at least two tokens")
    # Shift by one: the value attached to token k belongs to target position k - 1.
    return Datum(
        model_input=torch.tensor(tokens[:-1], dtype=torch.long),
        loss_fn_inputs={
            "target_tokens": torch.tensor(tokens[1:], dtype=torch.long),
            "logprobs": torch.tensor(logprobs[1:]),
            "advantages": torch.tensor(advantage[1:]),
            "mask": torch.tensor(mask[1:]),
        },
    )


def trajectories_to_datums(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float] | Sequence[Sequence[float]] | torch.Tensor,
) -> list[Datum]:
    """`advantages[i]` is one number for trajectory i or a list with one per turn."""
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
    out = []
    for trajectory, adv in zip(trajectories, advantages, strict=True):
        if isinstance(adv, torch.Tensor):
            adv = adv.item() if adv.dim() == 0 else adv.tolist()
        out.append(trajectory_to_datum(trajectory, adv))
    return out


def sample_to_datum(prompt: Sequence[int], sample: SampledSequence, advantage: float) -> Datum:
    """Single-turn shortcut: prompt tokens then one sampled completion."""
    turn = Turn(list(prompt), list(sample.tokens), list(sample.logprobs))
    return trajectory_to_datum(Trajectory([turn]), advantage)
