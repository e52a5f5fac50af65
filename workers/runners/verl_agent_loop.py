"""The verl agent loop that plays multi-turn episodes of our environments.

verl's rollout workers instantiate ``OpenTinkerEnvAgentLoop`` (registered under
``AGENT_NAME`` through the agent-loop config file the verl runner writes) for every row whose
``agent_name`` is ``opentinker_env``. The loop rebuilds the row's episode from
``extra_info["group_spec"]``, asks verl's vLLM server for each action and steps the episode
with the decoded text, recording tokens exactly as ``environments.rollouts.EpisodeRecorder``
does for the native runner: observation tokens masked (0), sampled tokens trained on (1).
The episode's total reward goes back as ``reward_score``; per-turn rewards ride along in
``extra_fields["turn_scores"]``.

``play_episode`` holds all of that and needs no verl, so it is tested on CPU with a plain
async ``generate`` function. The verl subclass is built on first attribute access (PEP 562
``__getattr__``): importing this module never imports verl, and a worker without verl only
fails when verl asks for the class.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from environments.registry import build_group
from environments.renderer import Renderer
from environments.rollouts import EpisodeRecorder, PolicyOutput

AGENT_NAME = "opentinker_env"
CLASS_NAME = "OpenTinkerEnvAgentLoop"
CLASS_PATH = f"{__name__}.{CLASS_NAME}"

# (prompt token ids, sampling params) -> (sampled token ids, their logprobs or None)
GenerateFn = Callable[[list[int], dict[str, Any]], Awaitable[tuple[list[int], list[float] | None]]]


@dataclass
class EpisodeOutput:
    """One played episode in verl's layout: prompt, then everything after it."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    reward_score: float
    num_turns: int
    turn_scores: list[float] = field(default_factory=list)
    error: str | None = None


async def play_episode(
    group_spec: dict[str, Any],
    tokenizer: Any,
    generate: GenerateFn,
    *,
    sampling_params: dict[str, Any],
    max_turns: int,
    response_length: int,
    max_tokens: int | None = None,
) -> EpisodeOutput:
    """Play one episode of ``group_spec`` with ``generate`` as the policy.

    The response (actions and the observations between them) never exceeds
    ``response_length`` tokens, verl's fixed response width: when the budget runs out the
    episode ends unfinished and keeps the rewards it earned so far. ``max_tokens`` caps each
    action on top of the env's own stop condition (the JobSpec's ``rollout.max_tokens``).
    """
    if max_turns < 1 or response_length < 1:
        raise ValueError("max_turns and response_length must be >= 1")
    builder = build_group({**group_spec, "group_size": 1})
    (episode,) = builder.make_episodes()
    rec = EpisodeRecorder(Renderer(tokenizer), builder.env_name)
    loop = asyncio.get_running_loop()
    prompt_len = 0
    try:
        try:
            messages, stop = episode.initial_observation()
        except Exception as exc:  # an env crash is a value, as in run_episode
            rec.fail(f"initial_observation failed: {type(exc).__name__}: {exc}")
        else:
            rec.begin(messages, stop)
            prompt_len = len(rec.context)
            for _ in range(max_turns):
                budget = response_length - (len(rec.context) - prompt_len)
                if budget <= 0:
                    rec.fail(f"response_length ({response_length} tokens) reached")
                    break
                inp = rec.policy_input()
                limit = min(inp.stop.max_tokens, budget, max_tokens or budget)
                params = {**sampling_params, "max_tokens": limit}
                if inp.stop.stop:
                    params["stop"] = list(inp.stop.stop)
                if inp.stop.stop_token_ids:
                    params["stop_token_ids"] = list(inp.stop.stop_token_ids)
                tokens, logprobs = await generate(list(inp.tokens), params)
                action = rec.take_action(PolicyOutput(tokens=list(tokens), logprobs=logprobs))
                try:
                    # Env steps may block (code sandbox, opponent): keep the event loop free.
                    result = await loop.run_in_executor(None, episode.step, action)
                except Exception as exc:  # an env crash is a value
                    rec.fail(f"step failed: {type(exc).__name__}: {exc}", "env_exception")
                    break
                rec.record(result)
                if rec.done:
                    break
            else:
                rec.fail(f"max_turns ({max_turns}) reached before the episode ended")
    finally:
        episode.close()

    traj = rec.trajectory
    tokens_T = traj.tokens()
    if not traj.turns:
        # Nothing was sampled: verl still needs a (tiny) response; it carries no gradient.
        tokens_T = list(rec.context)
        prompt_len = len(tokens_T)
    mask_T = traj.mask() if traj.turns else [0] * len(tokens_T)
    logprobs_T = traj.logprobs() if traj.turns else [0.0] * len(tokens_T)
    response = tokens_T[prompt_len:][:response_length]
    return EpisodeOutput(
        prompt_ids=tokens_T[:prompt_len],
        response_ids=response,
        response_mask=mask_T[prompt_len:][: len(response)],
        response_logprobs=logprobs_T[prompt_len:][: len(response)],
        reward_score=traj.total_reward,
        num_turns=len(traj.turns),
        turn_scores=traj.rewards_per_turn,
        error=traj.error,
    )


def _build_class() -> type:
    from uuid import uuid4

    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopBase,
        AgentLoopMetrics,
        AgentLoopOutput,
        register,
    )

    class OpenTinkerEnvAgentLoop(AgentLoopBase):  # type: ignore[misc, valid-type]
        """Plays the row's episode of our environment protocol against verl's vLLM server."""

        async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
            extra = kwargs.get("extra_info") or {}
            if "group_spec" not in extra:
                raise ValueError(
                    f"agent loop {AGENT_NAME!r} needs rows written by the verl runner "
                    "(extra_info.group_spec is missing)"
                )
            multi_turn = self.rollout_config.multi_turn
            max_turns = int(multi_turn.max_assistant_turns or 1)

            async def generate(
                prompt_ids: list[int], params: dict[str, Any]
            ) -> tuple[list[int], list[float] | None]:
                out = await self.server_manager.generate(
                    request_id=uuid4().hex, prompt_ids=prompt_ids, sampling_params=params
                )
                return list(out.token_ids), (list(out.log_probs) if out.log_probs else None)

            ep = await play_episode(
                json.loads(extra["group_spec"]),
                self.tokenizer,
                generate,
                sampling_params=dict(sampling_params),
                max_turns=max_turns,
                response_length=int(self.rollout_config.response_length),
                max_tokens=extra.get("max_tokens"),
            )
            return AgentLoopOutput(
                prompt_ids=ep.prompt_ids,
                response_ids=ep.response_ids,
                response_mask=ep.response_mask,
                response_logprobs=ep.response_logprobs if sampling_params.get("logprobs") else None,
                reward_score=ep.reward_score,
                # verl counts user and assistant messages alike.
                num_turns=2 * ep.num_turns,
                metrics=AgentLoopMetrics(),
                extra_fields={"turn_scores": ep.turn_scores, "tool_rewards": []},
            )

    OpenTinkerEnvAgentLoop.__name__ = CLASS_NAME
    OpenTinkerEnvAgentLoop.__qualname__ = CLASS_NAME
    OpenTinkerEnvAgentLoop.__module__ = __name__
    # Registered after renaming, so verl's registry records the importable path CLASS_PATH.
    return register(AGENT_NAME)(OpenTinkerEnvAgentLoop)


_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    global _CLASS
    if name != CLASS_NAME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _CLASS is None:
        _CLASS = _build_class()
    return _CLASS


def agent_loop_config() -> list[dict[str, str]]:
    """The entries of verl's ``rollout.agent.agent_loop_config_path`` file for this loop."""
    return [{"name": AGENT_NAME, "_target_": CLASS_PATH}]
