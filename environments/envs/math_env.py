"""`math` (dataset x single turn): answer a problem; the reward checks the final answer.

Reward: 1.0 when the last `\\boxed{}` (or, failing that, the last number) equals the ground truth
(environments.grading), else 0.0; plus `format_reward` when the answer is boxed.
"""

from __future__ import annotations

from dataclasses import dataclass

from environments.grading import answers_match, extract_answer, has_format
from environments.types import Episode, GroupBuilder, Message, StepResult, StopCondition


@dataclass(frozen=True)
class MathConfig:
    format_reward: float = 0.0
    """Added when the answer is inside \\boxed{} (0 disables the format reward)."""
    prompt_suffix: str = ""
    """Appended to the question, e.g. " Give the answer in \\boxed{}."."""
    system_prompt: str = ""
    max_tokens: int = 128


class MathEpisode(Episode):
    def __init__(self, question: str, answer: str, config: MathConfig) -> None:
        super().__init__()
        self.question = question
        self.answer = answer
        self.config = config

    def _initial(self) -> tuple[list[Message], StopCondition]:
        messages: list[Message] = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        messages.append({"role": "user", "content": self.question + self.config.prompt_suffix})
        return messages, StopCondition(max_tokens=self.config.max_tokens)

    def _step(self, action: str) -> StepResult:
        given = extract_answer(action)
        correct = answers_match(given, self.answer)
        formatted = has_format(action)
        reward = float(correct) + (self.config.format_reward if formatted else 0.0)
        return StepResult(
            reward=reward,
            done=True,
            metrics={"correct": float(correct), "format": float(formatted)},
            error=None if given is not None else "no_answer",
            info={"given": given, "answer": self.answer},
        )


@dataclass
class MathGroupBuilder(GroupBuilder):
    question: str
    answer: str
    group_size: int
    config: MathConfig
    env_name: str = "math"

    def make_episodes(self) -> list[Episode]:
        return [
            MathEpisode(self.question, self.answer, self.config) for _ in range(self.group_size)
        ]
