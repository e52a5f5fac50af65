"""Env workers: Celery tasks on the `env` queue that step a whole group per task.

One task per turn of a group, not one per episode or per token:
- `start_group(group_spec)` builds the group from its JSON spec (registry.group_specs), takes
  every episode's initial observation and parks the episodes in Redis under a session id;
- `step_group(session, actions)` steps every live episode of the group with its action
  (None for episodes that already ended) and returns the G step results;
- `close_group(session)` drops a session early (the trainer gave up on it).

Arguments and results are JSON. Between turns the episodes live in Redis as a pickle with a TTL;
Redis is the project's trusted internal broker, and the pickle never leaves the env workers.
Self-play groups (`concurrent` builders) need both players in one process and run inline only.
"""

from __future__ import annotations

import pickle
import uuid
from dataclasses import asdict
from typing import Any

from celery import shared_task

from environments.registry import ContractError, build_group
from environments.types import Episode, StepResult

SESSION_PREFIX = "opentinker:env:session:"
SESSION_TTL_SECONDS = 3600
ENV_QUEUE = "env"


def _redis() -> Any:
    import redis
    from django.conf import settings

    return redis.Redis.from_url(str(settings.REDIS_URL))


def _save(client: Any, session: str, episodes: list[Episode]) -> None:
    client.set(SESSION_PREFIX + session, pickle.dumps(episodes), ex=SESSION_TTL_SECONDS)


def step_result_json(result: StepResult) -> dict[str, Any]:
    return {
        "reward": float(result.reward),
        "done": bool(result.done),
        "next_messages": list(result.next_messages),
        "stop": asdict(result.stop) if result.stop is not None else None,
        "metrics": {k: float(v) for k, v in result.metrics.items()},
        "error": result.error,
        "info": result.info,
    }


@shared_task(name="environments.tasks.start_group", ignore_result=False)
def start_group(group_spec: dict[str, Any]) -> dict[str, Any]:
    try:
        builder = build_group(group_spec)
    except ContractError as exc:
        return {"error": exc.as_dict()}
    if getattr(builder, "concurrent", False):
        return {
            "error": {
                "field": "env",
                "reason": f"env {group_spec.get('env')!r} plays its "
                "episodes against each other and runs inline only",
            }
        }
    episodes = builder.make_episodes()
    observations: list[dict[str, Any]] = []
    for episode in episodes:
        try:
            messages, stop = episode.initial_observation()
            observations.append({"messages": list(messages), "stop": asdict(stop)})
        except Exception as exc:
            observations.append({"exception": f"{type(exc).__name__}: {exc}"})
    session = uuid.uuid4().hex
    _save(_redis(), session, episodes)
    return {"session": session, "observations": observations}


@shared_task(name="environments.tasks.step_group", ignore_result=False)
def step_group(session: str, actions: list[str | None]) -> dict[str, Any]:
    client = _redis()
    blob = client.get(SESSION_PREFIX + session)
    if blob is None:
        return {"error": {"field": "session", "reason": f"unknown or expired session {session!r}"}}
    episodes: list[Episode] = pickle.loads(blob)
    if len(actions) != len(episodes):
        return {
            "error": {
                "field": "actions",
                "reason": f"{len(actions)} actions for {len(episodes)} episodes",
            }
        }
    results: list[dict[str, Any] | None] = []
    for episode, action in zip(episodes, actions):
        if action is None or episode.done:
            results.append(None)
            continue
        try:
            results.append(step_result_json(episode.step(action)))
        except Exception as exc:
            # A crashed episode is over; later turns skip it.
            episode.end()
            results.append({"exception": f"{type(exc).__name__}: {exc}"})
    if all(ep.done for ep in episodes):
        for ep in episodes:
            ep.close()
        client.delete(SESSION_PREFIX + session)
    else:
        _save(client, session, episodes)
    return {"results": results}


@shared_task(name="environments.tasks.close_group", ignore_result=False)
def close_group(session: str) -> bool:
    client = _redis()
    blob = client.get(SESSION_PREFIX + session)
    if blob is not None:
        for episode in pickle.loads(blob):
            episode.close()
    return bool(client.delete(SESSION_PREFIX + session))
