"""Drive episodes with a policy: the one loop used by training rollouts and by inference.

`policy_fn` receives a `PolicyInput` (the conversation, its tokens so far when a renderer is
given, the stop condition) and returns a `PolicyOutput` (sampled tokens with their logprobs, or
just text) or a plain string. The loop records a `Trajectory` whose observation tokens are
masked and whose action tokens are exactly what the policy returned.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from environments.renderer import Renderer
from environments.types import (
    Episode,
    GroupBuilder,
    Message,
    StepResult,
    StopCondition,
    Trajectory,
    Turn,
)

DEFAULT_MAX_TURNS = 64


@dataclass
class PolicyInput:
    messages: list[Message]
    """The conversation so far, ending with the latest observation."""
    tokens: list[int]
    """The same conversation as tokens ending in the generation prompt (empty without renderer)."""
    stop: StopCondition


@dataclass
class PolicyOutput:
    text: str | None = None
    tokens: list[int] | None = None
    logprobs: list[float] | None = None
    """Sampler logprobs of `tokens`; zeros are recorded when a text-only policy gives none."""
    metrics: dict[str, float] = field(default_factory=dict)


PolicyFn = Callable[[PolicyInput], "PolicyOutput | str"]


def _normalise(
    out: PolicyOutput | str, renderer: Renderer | None
) -> tuple[str, list[int], list[float]]:
    if isinstance(out, str):
        out = PolicyOutput(text=out)
    if not isinstance(out, PolicyOutput):
        raise TypeError(f"policy_fn must return PolicyOutput or str, got {type(out).__name__}")
    tokens = list(out.tokens) if out.tokens is not None else None
    if tokens is None:
        if out.text is None:
            raise ValueError("policy_fn returned neither text nor tokens")
        tokens = renderer.encode(out.text) if renderer else []
    if out.text is not None:
        text = out.text
    elif renderer is not None:
        text = renderer.action_text(tokens)
    else:
        raise ValueError("policy_fn returned tokens only; a renderer is needed to decode them")
    logprobs = list(out.logprobs) if out.logprobs is not None else [0.0] * len(tokens)
    if len(logprobs) != len(tokens):
        raise ValueError(f"policy_fn returned {len(tokens)} tokens but {len(logprobs)} logprobs")
    return text, tokens, logprobs


class EpisodeRecorder:
    """Builds one Trajectory from observations, policy outputs and step results.

    Shared by `run_episode` (episode in this process) and the env-queue driver
    (environments.remote), so both produce identical token layouts and masks.
    """

    def __init__(self, renderer: Renderer | None, env_name: str = "") -> None:
        self.renderer = renderer
        self.trajectory = Trajectory(turns=[], env_name=env_name)
        self.conversation: list[Message] = []
        self.context: list[int] = []
        self.obs_tokens: list[int] = []
        self.obs_messages: list[Message] = []
        self.stop = StopCondition()
        self.done = False
        self._pending: tuple[str, list[int], list[float]] | None = None

    def begin(self, messages: list[Message], stop: StopCondition) -> None:
        self.conversation = list(messages)
        self.obs_messages = list(messages)
        self.stop = stop
        if self.renderer is not None:
            self.context = self.renderer.prompt_tokens(self.conversation)
        self.obs_tokens = list(self.context)

    def policy_input(self) -> PolicyInput:
        stop = self.stop
        if self.renderer is not None:
            # The sampler must also stop at the chat template's end-of-turn token.
            ids = sorted({*stop.stop_token_ids, *self.renderer.stop_token_ids()})
            stop = replace(stop, stop_token_ids=tuple(ids))
        return PolicyInput(messages=list(self.conversation), tokens=list(self.context), stop=stop)

    def take_action(self, out: PolicyOutput | str) -> str:
        """Record the policy's output; returns the action text to step the episode with."""
        self._pending = _normalise(out, self.renderer)
        return self._pending[0]

    def fail(self, error: str, turn_error: str | None = None) -> None:
        """End the trajectory abnormally (the pending action, if any, is kept unrewarded)."""
        if self._pending is not None and turn_error is not None:
            text, tokens, logprobs = self._pending
            self.trajectory.turns.append(
                Turn(
                    self.obs_tokens,
                    tokens,
                    logprobs,
                    0.0,
                    self.obs_messages,
                    text,
                    error=turn_error,
                )
            )
        self._pending = None
        self.trajectory.error = error
        self.done = True

    def record(self, result: StepResult) -> None:
        if self._pending is None:
            raise RuntimeError("record() without take_action()")
        text, action_tokens, logprobs = self._pending
        self._pending = None
        self.trajectory.turns.append(
            Turn(
                observation_tokens=self.obs_tokens,
                action_tokens=action_tokens,
                action_logprobs=logprobs,
                reward=float(result.reward),
                observation_messages=self.obs_messages,
                action_text=text,
                error=result.error,
                metrics=dict(result.metrics),
                info=dict(result.info),
            )
        )
        if result.done:
            self.done = True
            return
        history = list(self.conversation)
        self.conversation.append({"role": "assistant", "content": text})
        self.obs_messages = list(result.next_messages)
        self.conversation.extend(self.obs_messages)
        if self.renderer is not None:
            self.context.extend(action_tokens)
            self.obs_tokens = self.renderer.observation_tokens(
                history, self.obs_messages, action_tokens
            )
            self.context.extend(self.obs_tokens)
        else:
            self.obs_tokens = []
        if result.stop is not None:
            self.stop = result.stop


def run_episode(
    policy_fn: PolicyFn,
    episode: Episode,
    renderer: Renderer | None = None,
    *,
    env_name: str = "",
    max_turns: int = DEFAULT_MAX_TURNS,
) -> Trajectory:
    """Play one episode to the end. Environment crashes end the trajectory with `error` set."""
    rec = EpisodeRecorder(renderer, env_name)
    try:
        try:
            messages, stop = episode.initial_observation()
        except Exception as exc:
            rec.fail(f"initial_observation failed: {type(exc).__name__}: {exc}")
            return rec.trajectory
        rec.begin(messages, stop)
        for _ in range(max_turns):
            action = rec.take_action(policy_fn(rec.policy_input()))
            try:
                result = episode.step(action)
            except Exception as exc:
                rec.fail(
                    f"step failed: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}",
                    turn_error="env_exception",
                )
                return rec.trajectory
            rec.record(result)
            if rec.done:
                return rec.trajectory
        rec.fail(f"max_turns ({max_turns}) reached before the episode ended")
        return rec.trajectory
    finally:
        episode.close()


def run_group(
    policy_fn: PolicyFn,
    builder: GroupBuilder,
    renderer: Renderer | None = None,
    *,
    max_turns: int = DEFAULT_MAX_TURNS,
    opponent_fn: PolicyFn | None = None,
) -> list[Trajectory]:
    """Play the G episodes of one group and add the builder's group rewards.

    Episodes that share state (self-play) must run at the same time, each waiting for the
    other's move, so a builder with `concurrent = True` gets one thread per episode. The
    builder's `opponent_episodes` are played by `opponent_fn` and left out of the result.
    """
    if getattr(builder, "concurrent", False):
        return play_concurrent(
            builder,
            renderer,
            max_turns,
            lambda e, frozen: _opponent_or_raise(opponent_fn, builder) if frozen else policy_fn,
        )
    name = builder.env_name
    trajectories = [
        run_episode(policy_fn, ep, renderer, env_name=name, max_turns=max_turns)
        for ep in builder.make_episodes()
    ]
    return apply_group_rewards(builder, trajectories)


def _opponent_or_raise(opponent_fn: PolicyFn | None, builder: GroupBuilder) -> PolicyFn:
    if opponent_fn is None:
        raise ValueError(f"{builder.env_name!r} plays a frozen opponent: give its policy")
    return opponent_fn


def play_concurrent(
    builder: GroupBuilder,
    renderer: Renderer | None,
    max_turns: int,
    policy_of: Callable[[int, bool], PolicyFn],
) -> list[Trajectory]:
    """One thread per episode, for episodes that wait for each other (self-play, a frozen
    opponent): `policy_of(episode, frozen)` plays episode e, `frozen` when the builder lists
    it among its `opponent_episodes`, whose trajectories are then dropped."""
    episodes = builder.make_episodes()
    name = builder.env_name
    frozen = builder.opponent_episodes()
    fns = [policy_of(e, e in frozen) for e in range(len(episodes))]
    results: list[Trajectory | None] = [None] * len(episodes)

    def play(e: int) -> None:
        results[e] = run_episode(fns[e], episodes[e], renderer, env_name=name, max_turns=max_turns)

    threads = [threading.Thread(target=play, args=(e,), daemon=True) for e in range(len(episodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trajectories = [
        r if r is not None else Trajectory(turns=[], env_name=name, error="episode thread died")
        for e, r in enumerate(results)
        if e not in frozen
    ]
    return apply_group_rewards(builder, trajectories)


def apply_group_rewards(builder: GroupBuilder, trajectories: list[Trajectory]) -> list[Trajectory]:
    """Add the builder's group rewards to each trajectory's last turn."""
    bonus = builder.compute_group_rewards(trajectories)
    if len(bonus) != len(trajectories):
        raise ValueError(
            f"{type(builder).__name__}.compute_group_rewards returned {len(bonus)} "
            f"rewards for {len(trajectories)} trajectories"
        )
    for traj, extra in zip(trajectories, bonus):
        if extra and traj.turns:
            traj.turns[-1].reward += float(extra)
    return trajectories
