"""Drive groups through the env queue: the isolated path next to `rollouts.run_group`.

The policy runs here (the trainer's process); the environment runs on an env worker, one
`step_group` task per turn for the whole group. The trajectories are built by the same
`EpisodeRecorder` as inline rollouts, so both paths give identical tokens and masks.

`run_group_remote` plays one group with a per-row policy function; `RemoteGroups` holds many
groups on env workers for a trainer that samples all their live episodes in one batch per turn
(the native runner with ``rollout.env_execution: queue``): each call has one task per group in
flight at once, so env workers step the groups in parallel while the trainer waits once.

These calls wait for task results, also from inside the trainer's own Celery task. That is
safe only where env tasks run in other processes than the waiting trainer: the `worker-env`
service, not the `gpu` workers (docker-compose's `worker-gpu` does not consume `env`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from environments.registry import build_group
from environments.renderer import Renderer
from environments.rollouts import (
    DEFAULT_MAX_TURNS,
    EpisodeRecorder,
    PolicyFn,
    apply_group_rewards,
)
from environments.tasks import ENV_QUEUE, close_group, start_group, step_group
from environments.types import Message, StepResult, StopCondition, Trajectory

# How long one env task may take, queueing included, before the trainer gives up on it.
TASK_TIMEOUT_S = 120.0


class RemoteEnvError(RuntimeError):
    pass


def _stop_from_json(data: dict[str, Any]) -> StopCondition:
    return StopCondition(
        max_tokens=int(data["max_tokens"]),
        stop=tuple(data["stop"]),
        stop_token_ids=tuple(data["stop_token_ids"]),
    )


def _reply(result: Any, timeout: float) -> dict[str, Any]:
    # disable_sync_subtasks: the trainer waits from inside its own task (see the module doc).
    reply: dict[str, Any] = result.get(timeout=timeout, disable_sync_subtasks=False)
    if "error" in reply:
        err = reply["error"]
        raise RemoteEnvError(f"{err.get('field')}: {err.get('reason')}")
    return reply


def _call(task: Any, args: list[Any], timeout: float) -> dict[str, Any]:

    return _reply(task.apply_async(args=args, queue=ENV_QUEUE), timeout)


def _step_result(res: dict[str, Any]) -> StepResult:
    stop = res.pop("stop")
    return StepResult(**res, stop=None if stop is None else _stop_from_json(stop))


Observation = tuple[list[Message], StopCondition]


class RemoteGroups:
    """Groups (JSON group specs) whose episodes live on env workers, stepped in lockstep.

    `start()` gives each episode's initial observation, `step(actions)` each episode's
    `StepResult`; an episode that raised is the string ``"ExcType: message"`` instead, as
    `rollouts` words it for inline episodes, and an episode given no action gets None.
    `close()` drops the sessions of groups that did not play to the end.
    """

    def __init__(
        self, group_specs: Sequence[dict[str, Any]], *, timeout: float = TASK_TIMEOUT_S
    ) -> None:
        self.group_specs = list(group_specs)
        self.timeout = timeout
        self.sessions: list[str] = []
        self._live: list[set[int]] = []

    def _gather(self, results: list[Any]) -> list[dict[str, Any]]:
        """Every reply (so no started session goes unrecorded), then the first error."""
        replies: list[dict[str, Any]] = []
        error: Exception | None = None
        for result in results:
            try:
                replies.append(_reply(result, self.timeout))
            except Exception as exc:
                replies.append({})
                error = error or exc
        for reply in replies:
            if "session" in reply:
                self.sessions.append(reply["session"])
                self._live.append(set(range(len(reply["observations"]))))
        if error is not None:
            raise error
        return replies

    def start(self) -> list[list[Observation | str]]:

        if self.sessions:
            raise RuntimeError("these groups were started already")
        replies = self._gather(
            [start_group.apply_async(args=[spec], queue=ENV_QUEUE) for spec in self.group_specs]
        )
        return [
            [
                o["exception"]
                if "exception" in o
                else (list(o["messages"]), _stop_from_json(o["stop"]))
                for o in reply["observations"]
            ]
            for reply in replies
        ]

    def step(self, actions: Sequence[Sequence[str | None]]) -> list[list[StepResult | str | None]]:

        if len(actions) != len(self.sessions):
            raise ValueError(f"{len(actions)} action lists for {len(self.sessions)} groups")
        out: list[list[StepResult | str | None]] = [[None] * len(a) for a in actions]
        sent = [
            (g, step_group.apply_async(args=[self.sessions[g], list(a)], queue=ENV_QUEUE))
            for g, a in enumerate(actions)
            if any(action is not None for action in a)
        ]
        for g, result in sent:
            for e, res in enumerate(_reply(result, self.timeout)["results"]):
                if res is None:
                    continue
                if "exception" in res:
                    self._live[g].discard(e)  # the worker ended it
                    out[g][e] = str(res["exception"])
                    continue
                if res["done"]:
                    self._live[g].discard(e)
                out[g][e] = _step_result(res)
        return out

    def close(self) -> None:

        # An env worker drops a session itself once all its episodes are done.
        for session, live in zip(self.sessions, self._live, strict=True):
            if live:
                close_group.apply_async(args=[session], queue=ENV_QUEUE)
        self.sessions, self._live = [], []


def run_group_remote(
    policy_fn: PolicyFn,
    group_spec: dict[str, Any],
    renderer: Renderer | None = None,
    *,
    timeout: float = 60.0,
    max_turns: int = DEFAULT_MAX_TURNS,
) -> list[Trajectory]:

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
                    recorders[i].record(_step_result(res))
        else:
            for rec in recorders:
                if not rec.done:
                    rec.fail(f"max_turns ({max_turns}) reached before the episode ended")
            close_group.apply_async(args=[session], queue=ENV_QUEUE)
    except BaseException:
        close_group.apply_async(args=[session], queue=ENV_QUEUE)
        raise
    return apply_group_rewards(builder, [rec.trajectory for rec in recorders])
