"""The verl agent loop's episode driver, checked against the native rollout loop (no verl)."""

from __future__ import annotations

import asyncio
import importlib
import sys
from itertools import count
from typing import Any

import pytest

from environments.registry import build_group, group_specs
from environments.renderer import Renderer
from environments.rollouts import PolicyInput, PolicyOutput, run_episode
from tests.environments.conftest import build_chatml_tokenizer
from workers.runners import verl_agent_loop
from workers.runners.verl_agent_loop import play_episode

TOKENIZER = build_chatml_tokenizer()


def _moves() -> list[str]:
    # Legal moves, an unparsable one and a repeat: the game goes on for several turns.
    return ["\\boxed{0,0}", "hmm", "\\boxed{0,0}", "\\boxed{1,1}", "\\boxed{2,2}"] + [
        f"\\boxed{{{r},{c}}}" for r in range(5) for c in range(5)
    ]


def _tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text + "<|im_end|>", add_special_tokens=False)


def _gomoku_spec(seed: int = 4) -> dict[str, Any]:
    (spec,) = group_specs("gomoku", n_groups=1, group_size=1, seed=seed)
    return spec


def _play(spec: dict[str, Any], **kw: Any) -> tuple[Any, list[tuple[list[int], dict[str, Any]]]]:
    moves = iter(_moves())
    calls: list[tuple[list[int], dict[str, Any]]] = []
    step = count()

    async def generate(prompt_ids: list[int], params: dict[str, Any]) -> Any:
        calls.append((prompt_ids, params))
        toks = _tokens(next(moves))
        return toks, [-0.25 - 0.001 * next(step)] * len(toks)

    out = asyncio.run(
        play_episode(spec, TOKENIZER, generate, sampling_params={"temperature": 1.0}, **kw)
    )
    return out, calls


def test_it_lays_out_an_episode_like_the_native_rollout() -> None:
    spec = _gomoku_spec()
    out, calls = _play(spec, max_turns=12, response_length=4096, max_tokens=10)

    moves = iter(_moves())
    step = count()

    def policy(inp: PolicyInput) -> PolicyOutput:
        toks = _tokens(next(moves))
        return PolicyOutput(tokens=toks, logprobs=[-0.25 - 0.001 * next(step)] * len(toks))

    (episode,) = build_group(spec).make_episodes()
    native = run_episode(policy, episode, Renderer(TOKENIZER), env_name="gomoku", max_turns=12)

    assert out.num_turns == len(native.turns) >= 3
    prompt = native.turns[0].observation_tokens
    assert out.prompt_ids == prompt
    assert out.prompt_ids + out.response_ids == native.tokens()
    assert out.response_mask == native.mask()[len(prompt) :]
    assert out.response_logprobs == native.logprobs()[len(prompt) :]
    assert out.reward_score == pytest.approx(native.total_reward)
    assert out.turn_scores == native.rewards_per_turn
    assert out.error == native.error
    # Each call saw the whole context so far and the tighter of the two token limits.
    mask = out.response_mask
    for k, (prompt_ids, params) in enumerate(calls):
        start = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])][k]
        assert prompt_ids == out.prompt_ids + out.response_ids[:start]
        assert params["max_tokens"] == 10 and params["temperature"] == 1.0
        assert TOKENIZER.convert_tokens_to_ids("<|im_end|>") in params["stop_token_ids"]


def test_it_ends_an_episode_at_the_response_budget() -> None:
    out, calls = _play(_gomoku_spec(), max_turns=12, response_length=60)
    assert 0 < len(out.response_ids) <= 60 and len(out.response_mask) == len(out.response_ids)
    assert out.error is not None and "response_length" in out.error
    # The last call was never allowed more tokens than the budget had left.
    for prompt_ids, params in calls:
        used = len(prompt_ids) - len(out.prompt_ids)
        assert params["max_tokens"] <= 60 - used


def test_it_refuses_nonsense_limits() -> None:
    with pytest.raises(ValueError, match="max_turns"):
        _play(_gomoku_spec(), max_turns=0, response_length=10)


def test_it_builds_the_verl_class_only_on_demand(monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing the module never imports verl; asking for the class does.
    monkeypatch.delitem(sys.modules, "verl", raising=False)
    importlib.reload(verl_agent_loop)
    assert "verl" not in sys.modules
    if importlib.util.find_spec("verl") is None:
        with pytest.raises(ModuleNotFoundError, match="verl"):
            verl_agent_loop.OpenTinkerEnvAgentLoop  # noqa: B018
    with pytest.raises(AttributeError):
        verl_agent_loop.NoSuchLoop  # noqa: B018


def test_it_runs_math_code_in_the_sandbox_like_the_native_rollout() -> None:
    """math_code through the agent loop's driver: the action's code runs in the real sandbox,
    its output comes back as a masked observation, and the boxed answer is graded."""
    from environments.datasets import load_rows, resolve

    row = load_rows(resolve("builtin:arith_train"), "math")[0]
    (spec,) = group_specs("math_code", rows=[row], n_groups=1, group_size=1, seed=0)
    # The code prints a marker the prompt cannot contain: it only reaches the context by
    # running.
    actions = [
        f"```python\nprint('sandbox', 6 * 7, {row['answer']!r})\n```",
        f"\\boxed{{{row['answer']}}}",
    ]

    def replies() -> Any:
        return iter(actions)

    served = replies()

    async def generate(prompt_ids: list[int], params: dict[str, Any]) -> Any:
        toks = _tokens(next(served))
        return toks, [-0.5] * len(toks)

    out = asyncio.run(
        play_episode(
            spec,
            TOKENIZER,
            generate,
            sampling_params={},
            max_turns=4,
            response_length=4096,
            max_tokens=64,
        )
    )
    native_actions = replies()

    def policy(inp: PolicyInput) -> PolicyOutput:
        toks = _tokens(next(native_actions))
        return PolicyOutput(tokens=toks, logprobs=[-0.5] * len(toks))

    (episode,) = build_group(spec).make_episodes()
    native = run_episode(policy, episode, Renderer(TOKENIZER), env_name="math_code", max_turns=4)

    assert out.num_turns == len(native.turns) == 2
    assert out.reward_score == pytest.approx(native.total_reward) == 1.0
    assert out.prompt_ids + out.response_ids == native.tokens()
    assert out.response_mask == native.mask()[len(out.prompt_ids) :]
    observed = TOKENIZER.decode([t for t, m in zip(out.response_ids, out.response_mask) if not m])
    assert f"sandbox 42 {row['answer']}" in observed
    assert out.error is None
