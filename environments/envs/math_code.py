"""`math_code` (dataset x multi turn): solve a problem, optionally running Python on the way.

Each turn the model either answers (a `\\boxed{}` answer ends the episode and is graded) or
writes Python in a ```python fenced block; the code runs in the sandbox and its output comes
back as the next user message ("Output:\\n..."), which the renderer masks. A turn with neither
is graded on its last number and ends the episode. After `max_turns` actions without an answer
the episode ends with reward 0 and error "max_turns".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from environments.grading import answers_match, extract_answer, last_boxed
from environments.sandbox import SandboxLimits, run_code
from environments.types import (
    STRICT_CONFIG,
    Episode,
    GroupBuilder,
    Message,
    StepResult,
    StopCondition,
)

_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
INSTRUCTION = " Write code in a ```python block, then give the answer in \\boxed{}."


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python ... ```); an unclosed final block counts too."""
    blocks = _CODE_BLOCK.findall(text)
    if blocks:
        return blocks[-1]
    open_block = re.search(r"```(?:python|py)[ \t]*\n(.*)$", text, re.DOTALL)
    return open_block.group(1) if open_block else None


# What a job's JSON may change of the sandbox budget, and the caps: never the isolation mode.
LIMIT_CAPS: dict[str, tuple[type, int]] = {
    "cpu_seconds": (int, 10),
    "wall_seconds": (float, 30),
    "memory_bytes": (int, 1024**3),
}


@pydantic_dataclass(frozen=True, config=STRICT_CONFIG)
class MathCodeConfig:
    max_turns: int = Field(default=4, ge=1)
    format_reward: float = 0.0
    max_output_chars: int = Field(default=1000, ge=1)
    """Tool output longer than this is cut before it goes back to the model."""
    max_tokens: int = Field(default=256, ge=1)
    limits: SandboxLimits = field(
        default_factory=lambda: SandboxLimits(
            cpu_seconds=2, wall_seconds=5.0, memory_bytes=256 * 1024**2
        )
    )
    """From JSON: an object of ``cpu_seconds``, ``wall_seconds`` and ``memory_bytes``."""

    @field_validator("limits", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        unknown = sorted(set(value) - set(LIMIT_CAPS))
        if unknown:
            raise ValueError(f"limits.{unknown[0]} cannot be set; allowed: {sorted(LIMIT_CAPS)}")
        for key, given in value.items():
            kind, cap = LIMIT_CAPS[key]
            number = (int, float) if kind is float else (int,)
            if isinstance(given, bool) or not isinstance(given, number):
                noun = "a number" if kind is float else "an integer"
                raise ValueError(f"limits.{key} must be {noun}, got {given!r}")
            if not 0 < given <= cap:
                raise ValueError(f"limits.{key} must be in (0, {cap}], got {given}")
        return SandboxLimits(**value)


def format_output(stdout: str, stderr: str, reason: str, ok: bool, limit: int) -> str:
    text = stdout
    if not ok:
        tail = stderr.strip().splitlines()[-3:] if stderr.strip() else []
        text += ("\n" if text and not text.endswith("\n") else "") + "\n".join(tail or [reason])
    text = text if text.strip() else "(no output)"
    if len(text) > limit:
        text = text[:limit] + "\n...(output truncated)"
    return "Output:\n" + text.rstrip("\n")


class MathCodeEpisode(Episode):
    def __init__(self, question: str, answer: str, config: MathCodeConfig) -> None:
        super().__init__()
        self.question = question
        self.answer = answer
        self.config = config
        self.turns = 0
        self.code_runs = 0

    def _initial(self) -> tuple[list[Message], StopCondition]:
        return (
            [{"role": "user", "content": self.question + INSTRUCTION}],
            StopCondition(max_tokens=self.config.max_tokens),
        )

    def _grade(self, action: str) -> StepResult:
        given = extract_answer(action)
        correct = answers_match(given, self.answer)
        boxed = last_boxed(action) is not None
        return StepResult(
            reward=float(correct) + (self.config.format_reward if boxed else 0.0),
            done=True,
            metrics={
                "correct": float(correct),
                "format": float(boxed),
                "code_runs": float(self.code_runs),
                "turns": float(self.turns),
            },
            error=None if given is not None else "no_answer",
            info={"given": given, "answer": self.answer},
        )

    def _step(self, action: str) -> StepResult:
        self.turns += 1
        code = extract_code(action)
        if last_boxed(action) is not None or code is None:
            return self._grade(action)
        if self.turns >= self.config.max_turns:
            return StepResult(
                reward=0.0,
                done=True,
                error="max_turns",
                metrics={
                    "correct": 0.0,
                    "format": 0.0,
                    "code_runs": float(self.code_runs),
                    "turns": float(self.turns),
                },
            )
        result = run_code(code, self.config.limits)
        self.code_runs += 1
        output = format_output(
            result.stdout, result.stderr, result.reason, result.ok, self.config.max_output_chars
        )
        return StepResult(
            reward=0.0,
            done=False,
            next_messages=[{"role": "user", "content": output}],
            metrics={"sandbox_wall_s": result.wall_seconds, "code_ok": float(result.ok)},
            error=None if result.ok else "code_error",
            info={
                "sandbox": {
                    "exit": result.exit,
                    "killed_by": result.killed_by,
                    "reason": result.reason,
                }
            },
        )


@dataclass
class MathCodeGroupBuilder(GroupBuilder):
    question: str
    answer: str
    group_size: int
    config: MathCodeConfig
    env_name: str = "math_code"

    def make_episodes(self) -> list[Episode]:
        return [
            MathCodeEpisode(self.question, self.answer, self.config) for _ in range(self.group_size)
        ]
