"""verl's custom reward function for jobs of the verl runner.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` once per
sampled response (``reward.custom_reward_function.path`` points at this file). It runs inside
verl's Ray workers, so it imports no Django and nothing from the control plane: only the
environment protocol.

Rows written by ``workers.runners.verl.write_datasets`` carry the group spec of their episode
in ``extra_info["group_spec"]`` (JSON); the score is the reward of a fresh single-turn episode
stepped with the response, so the verl runner grades exactly like the native runner. Rows from
other sources (verl's own example parquet files) fall back to the math grader.
"""

from __future__ import annotations

import json
from typing import Any

from environments.grading import answers_match, extract_answer
from environments.registry import build_group, get_env
from environments.types import Interaction


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    spec_json = (extra_info or {}).get("group_spec")
    if spec_json:
        return episode_reward(json.loads(spec_json), solution_str)
    if ground_truth is None:
        raise ValueError(
            f"row of data source {data_source!r} has neither extra_info.group_spec nor a "
            "reward_model.ground_truth to grade against"
        )
    return float(answers_match(extract_answer(solution_str), ground_truth))


def episode_reward(group_spec: dict[str, Any], action: str) -> float:
    """Reward of one single-turn episode of ``group_spec`` answered with ``action``."""
    env = get_env(str(group_spec.get("env")))
    if env.interaction is not Interaction.SINGLE_TURN:
        # Multi-turn episodes are scored by the agent loop (workers.runners.verl_agent_loop),
        # which hands verl the reward with the trajectory; reaching here means the agent loop
        # was not configured.
        raise ValueError(
            f"env {env.name!r} is multi-turn: its reward comes from the opentinker_env agent loop"
        )
    builder = build_group({**group_spec, "group_size": 1})
    (episode,) = builder.make_episodes()
    try:
        episode.initial_observation()
        result = episode.step(action)
    finally:
        episode.close()
    return float(result.reward)
