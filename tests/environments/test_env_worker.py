"""A real Celery env worker on real Valkey steps batches of episodes of every environment.

The worker is started here with `--include environments.tasks` and only the `env` queue, so
this test needs neither the database nor `environments` in INSTALLED_APPS.
"""

from __future__ import annotations

import pytest

from environments.registry import group_specs
from environments.renderer import Renderer
from environments.rollouts import PolicyInput, run_group


def _scripted(env: str):
    """A deterministic policy per env: some right, some wrong, some multi-turn."""

    def policy(inp: PolicyInput) -> str:
        text = inp.messages[-1]["content"]
        if env == "bandit":
            return f"\\boxed{{{len(inp.tokens) % 3}}}"
        if env == "math":
            return "\\boxed{7}"
        if env == "math_code":
            if text.startswith("Output:"):
                value = text.split("\n", 1)[1].strip()
                return f"\\boxed{{{value}}}"
            return "```python\nprint(20 + 22)\n```"
        rows = [line.split()[1:] for line in text.splitlines() if line[:1].isdigit()]
        empty = [(r, c) for r, row in enumerate(rows) for c, v in enumerate(row) if v == "."]
        r, c = empty[0]
        return f"\\boxed{{{r},{c}}}"

    return policy


@pytest.mark.parametrize("env", ["math", "math_code", "bandit", "gomoku"])
def test_it_steps_a_batch_of_each_env_through_the_queue_like_inline(
    env: str, env_worker: str, renderer: Renderer
) -> None:
    from environments.registry import build_group
    from environments.remote import run_group_remote

    rows = None
    if env in ("math", "math_code"):
        rows = [
            {"question": "What is 20+22?", "answer": "42"},
            {"question": "What is 3+4?", "answer": "7"},
        ]
    specs = group_specs(env, rows=rows, n_groups=2, group_size=3, seed=5)
    for spec in specs:
        remote = run_group_remote(_scripted(env), spec, renderer, timeout=60)
        inline = run_group(_scripted(env), build_group(spec), renderer)
        assert len(remote) == 3
        for r, i in zip(remote, inline):
            assert r.error is None, r.error
            assert r.tokens() == i.tokens() and r.mask() == i.mask()
            assert r.rewards_per_turn == i.rewards_per_turn
    if env == "math_code":
        assert [len(t.turns) for t in remote] == [2, 2, 2]
        assert remote[0].turns[1].observation_messages[0]["content"] == "Output:\n42"
    if env == "gomoku":
        assert all(len(t.turns) > 2 for t in remote)


def test_it_reports_contract_errors_from_the_worker(env_worker: str) -> None:
    from environments.remote import RemoteEnvError, run_group_remote

    spec = group_specs("gomoku_selfplay", n_groups=1, group_size=2)[0]
    with pytest.raises(RemoteEnvError, match="runs inline only"):
        run_group_remote(lambda inp: "x", spec, timeout=30)
    from environments.tasks import ENV_QUEUE, step_group

    reply = step_group.apply_async(args=["nope", ["a"]], queue=ENV_QUEUE).get(timeout=30)
    assert reply["error"]["field"] == "session"
