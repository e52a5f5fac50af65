"""`bandit` (generator x single turn): pick one of K arms; the reward is that arm's payoff.

The arm means are hidden and fixed by the environment's `env_seed` (so a policy can learn which
arm is best); each episode draws its Bernoulli payoff from its own seed, so the whole run is
deterministic per seed. Arms are numbered from 0 and named as `\\boxed{2}` or "arm 2".
Reward scale: the payoff, 0 or 1; naming no valid arm earns `invalid_reward` (default 0).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from pydantic import Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from environments.types import (
    STRICT_CONFIG,
    Episode,
    GroupBuilder,
    Message,
    StepResult,
    StopCondition,
)

_BOXED = re.compile(r"\\boxed\{\s*(?:arm\s*)?(-?\d+)\s*\}", re.IGNORECASE)
_ARM = re.compile(r"\barm\s*#?\s*(-?\d+)\b", re.IGNORECASE)


@pydantic_dataclass(frozen=True, config=STRICT_CONFIG)
class BanditConfig:
    n_arms: int = Field(default=5, ge=2, le=100)
    env_seed: int = 0
    """Fixes the hidden arm means for the whole environment."""
    invalid_reward: float = 0.0
    max_tokens: int = Field(default=16, ge=1)


def arm_means(config: BanditConfig) -> list[float]:
    rng = random.Random(f"bandit-means-{config.env_seed}-{config.n_arms}")
    return [round(rng.random(), 4) for _ in range(config.n_arms)]


def parse_arm(text: str) -> int | None:
    for pattern in (_BOXED, _ARM):
        found = pattern.findall(text)
        if found:
            return int(found[-1])
    stripped = text.strip()
    return int(stripped) if re.fullmatch(r"-?\d+", stripped) else None


def prompt(n_arms: int) -> str:
    # Same wording as the tiny base model's training data (training/data.py).
    return (
        f"You are playing a multi-armed bandit with {n_arms} arms numbered 0 to {n_arms - 1}. "
        "Choose one arm. Answer with \\boxed{arm}."
    )


class BanditEpisode(Episode):
    def __init__(self, config: BanditConfig, seed: int) -> None:
        super().__init__()
        self.config = config
        self.seed = seed
        # The payoff of every arm for this episode, drawn up front from the episode seed.
        rng = random.Random(f"bandit-episode-{config.env_seed}-{seed}")
        self.payoffs = [1.0 if rng.random() < m else 0.0 for m in arm_means(config)]

    def _initial(self) -> tuple[list[Message], StopCondition]:
        return (
            [{"role": "user", "content": prompt(self.config.n_arms)}],
            StopCondition(max_tokens=self.config.max_tokens),
        )

    def _step(self, action: str) -> StepResult:
        arm = parse_arm(action)
        if arm is None or not 0 <= arm < self.config.n_arms:
            return StepResult(
                reward=self.config.invalid_reward,
                done=True,
                error="invalid_arm",
                metrics={"valid": 0.0},
                info={"arm": arm},
            )
        best = max(range(self.config.n_arms), key=lambda i: arm_means(self.config)[i])
        return StepResult(
            reward=self.payoffs[arm],
            done=True,
            metrics={"valid": 1.0, "best_arm": float(arm == best)},
            info={"arm": arm},
        )


@dataclass
class BanditGroupBuilder(GroupBuilder):
    config: BanditConfig
    seed: int
    group_size: int
    env_name: str = "bandit"

    def make_episodes(self) -> list[Episode]:
        return [
            BanditEpisode(self.config, self.seed * 1_000_003 + i) for i in range(self.group_size)
        ]
