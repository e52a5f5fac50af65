"""`math` (dataset x single turn): answer a problem; the reward checks the final answer.

Reward: 1.0 when the last `\\boxed{}` (or, failing that, the last number) equals the ground truth
(environments.grading), else 0.0; plus `format_reward` when the answer is boxed.

A row may carry `context`: a conversation shown before the question (user and assistant turns,
e.g. worked examples, or the earlier turns of a game for SFT on a multi-turn env's
demonstrations); it is prompt only, never trained on. A row may also carry `completion`: the
assistant reply an SFT job teaches verbatim, where the default is the answer boxed (a game's
move written as the game itself asks for it, `[check]`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from environments.grading import answers_match, extract_answer, has_format
from environments.types import (
    STRICT_CONFIG,
    Episode,
    GroupBuilder,
    Message,
    StepResult,
    StopCondition,
)


@pydantic_dataclass(frozen=True, config=STRICT_CONFIG)
class MathConfig:
    format_reward: float = 0.0
    """Added when the answer is inside \\boxed{} (0 disables the format reward)."""
    prompt_suffix: str = ""
    """Appended to the question, e.g. " Give the answer in \\boxed{}."."""
    system_prompt: str = ""
    max_tokens: int = Field(default=128, ge=1)


class MathEpisode(Episode):
    def __init__(
        self, question: str, answer: str, config: MathConfig, context: tuple[Message, ...] = ()
    ) -> None:
        super().__init__()
        self.question = question
        self.answer = answer
        self.config = config
        self.context = context

    def _initial(self) -> tuple[list[Message], StopCondition]:
        messages: list[Message] = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        messages.extend(dict(m) for m in self.context)  # type: ignore[misc]
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
    context: tuple[Message, ...] = ()
    env_name: str = "math"

    def make_episodes(self) -> list[Episode]:
        return [
            MathEpisode(self.question, self.answer, self.config, self.context)
            for _ in range(self.group_size)
        ]


def sft_completion(row: dict[str, object]) -> str:
    """The assistant reply an SFT job teaches for a row: its own `completion`, else the answer
    as this env grades it, boxed."""
    completion = row.get("completion")
    if isinstance(completion, str):
        return completion
    return f"\\boxed{{{row['answer']}}}"


def row_context(value: object) -> tuple[Message, ...]:
    """A row's `context` (absent: none), checked: a list of {"role": "user" | "assistant",
    "content": str} turns ending with the assistant's, since the question follows it."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(m, dict)
        and set(m) == {"role", "content"}
        and m["role"] in ("user", "assistant")
        and isinstance(m["content"], str)
        for m in value
    ):
        raise ValueError('must be a list of {"role": "user" or "assistant", "content": text} turns')
    if value and value[-1]["role"] != "assistant":
        raise ValueError("must end with an assistant turn: the question is the next user turn")
    return tuple(Message(role=m["role"], content=m["content"]) for m in value)
