"""Drive a group through the env queue: the isolated path next to `rollouts.run_group`.

The policy runs here (the trainer's process); the environment runs on an env worker, one
`step_group` task per turn for the whole group. The trajectories are built by the same
`EpisodeRecorder` as inline rollouts, so both paths give identical tokens and masks.
"""

from __future__ import annotations

from typing import Any

from environments.registry import build_group
from environments.renderer import Renderer
from environments.rollouts import (
    DEFAULT_MAX_TURNS,
    EpisodeRecorder,
    PolicyFn,
    apply_group_rewards,
)
from environments.types import StepResult, StopCondition, Trajectory


class RemoteEnvError(RuntimeError):
    pass


def _stop_from_json(data: dict[str, Any]) -> StopCondition:
    return StopCondition(
        max_tokens=int(data["max_tokens"]),
        stop=tuple(data["stop"]),
        stop_token_ids=tuple(data["stop_token_ids"]),
    )


def _call(task: Any, args: list[Any], timeout: float) -> dict[str, Any]:
    from environments.tasks import ENV_QUEUE

    reply = task.apply_async(args=args, queue=ENV_QUEUE).get(timeout=timeout)
    if "error" in reply:
        err = reply["error"]
        raise RemoteEnvError(f"{err.get('field')}: {err.get('reason')}")
    return reply


def run_group_remote(
    policy_fn: PolicyFn,
    group_spec: dict[str, Any],
    renderer: Renderer | None = None,
    *,
    timeout: float = 60.0,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[Trajectory]:
    from environments.tasks import ENV_QUEUE, close_group, start_group, step_group

    # Built locally too: the group rewards are computed where the trajectories are.
    builder = build_group(group_spec)
    started = _call(start_group, [group_spec], timeout)
    session = started["session"]
    recorders = [EpisodeRecorder(renderer, group_spec["env"]) for _ in started["observations"]]
    for rec, obs in zip(recorders, started["observations"]):
        if "exception" in obs:
            rec.fail(f"initial_observation failed: {obs['exception']}")
        else:
            rec.begin(obs["messages"], _stop_from_json(obs["stop"]))
    try:
        for _ in range(max_turns):
            live = [i for i, rec in enumerate(recorders) if not rec.done]
            if not live:
                break
            actions: list[str | None] = [None] * len(recorders)
            for i in live:
                actions[i] = recorders[i].take_action(policy_fn(recorders[i].policy_input()))
            results = _call(step_group, [session, actions], timeout)["results"]
            for i in live:
                res = results[i]
                if res is None:
                    recorders[i].fail("the env worker skipped a live episode")
                elif "exception" in res:
                    recorders[i].fail(
                        f"step failed: {res['exception']}", turn_error="env_exception"
                    )
                else:
                    stop = res.pop("stop")
                    recorders[i].record(
                        StepResult(**res, stop=None if stop is None else _stop_from_json(stop))
                    )
        else:
            for rec in recorders:
                if not rec.done:
                    rec.fail(f"max_turns ({max_turns}) reached before the episode ended")
            close_group.apply_async(args=[session], queue=ENV_QUEUE)
    except BaseException:
        close_group.apply_async(args=[session], queue=ENV_QUEUE)
        raise
    return apply_group_rewards(builder, [rec.trajectory for rec in recorders])
