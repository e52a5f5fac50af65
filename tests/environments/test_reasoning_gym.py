"""`reasoning_gym`: real reasoning-gym items played through `environments.rollouts`, inline and
on a real env worker, scored by the library's own scorers; bad settings named."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from environments.envs.reasoning_gym_env import (
    ReasoningGymGroupBuilder,
    dataset,
    format_answer,
    generator_names,
)
from environments.registry import (
    ContractError,
    build_group,
    get_env,
    group_specs,
    make_config,
    make_group_builders,
)
from environments.renderer import Renderer
from environments.rollouts import PolicyInput, run_group

pytest.importorskip("reasoning_gym")

ROOT = Path(__file__).resolve().parents[2]


def _builders(
    config: dict[str, Any], n: int = 3, group_size: int = 2, seed: int = 1
) -> list[ReasoningGymGroupBuilder]:
    builders = make_group_builders(
        "reasoning_gym", config=config, n_groups=n, group_size=group_size, seed=seed
    )
    assert all(isinstance(b, ReasoningGymGroupBuilder) for b in builders)
    return [b for b in builders if isinstance(b, ReasoningGymGroupBuilder)]


def _knows_the_answer(
    builder: ReasoningGymGroupBuilder, fmt: str = "answer_tag"
) -> Callable[[PolicyInput], str]:
    def policy(inp: PolicyInput) -> str:
        return "Let me think.\n" + format_answer(str(builder.entry["answer"]), fmt)

    return policy


@pytest.mark.parametrize(
    "config",
    [
        {"dataset": "chain_sum", "options": {"min_terms": 2, "max_terms": 3}},
        {"dataset": "leg_counting"},
        {"dataset": "arc_agi"},
        {"dataset": "basic_arithmetic", "answer_format": "last_line"},
        {"dataset": "chain_sum", "answer_format": "boxed"},
        {
            "dataset": "composite",
            "datasets": [
                {"name": "chain_sum", "weight": 1.0},
                {"name": "leg_counting", "weight": 2.0, "config": {"max_animals": 3}},
            ],
        },
    ],
)
def test_it_rewards_the_right_answer_and_nothing_else(config: dict[str, Any]) -> None:
    fmt = config.get("answer_format", "answer_tag")
    for builder in _builders(config):
        question = builder.make_episodes()[0].initial_observation()[0][-1]["content"]
        assert question.startswith(str(builder.entry["question"]))
        good = run_group(_knows_the_answer(builder, fmt), builder)
        assert [t.rewards_per_turn for t in good] == [[1.0], [1.0]]
        assert all(t.error is None and t.turns[0].error is None for t in good)
        assert good[0].turns[0].metrics["correct"] == 1.0
        bad = run_group(lambda inp: format_answer("no idea at all", fmt), builder)
        assert [t.rewards_per_turn for t in bad] == [[0.0], [0.0]]
        assert bad[0].turns[0].metrics["correct"] == 0.0
    sources = {b.entry["metadata"]["source_dataset"] for b in _builders(config, n=12)}
    if config["dataset"] == "composite":
        assert sources == {"chain_sum", "leg_counting"}
    else:
        assert sources == {config["dataset"]}


def test_it_reads_only_the_configured_answer_format() -> None:
    (builder,) = _builders({"dataset": "chain_sum"}, n=1, group_size=1)
    answer = str(builder.entry["answer"])
    untagged = run_group(lambda inp: f"The answer is\n{answer}", builder)[0]
    assert untagged.rewards_per_turn == [0.0] and untagged.turns[0].error == "no_answer"
    # The last of several tags counts, as in reasoning-gym's own extract_answer.
    two = run_group(lambda inp: f"<answer>0</answer> no: <answer>{answer}</answer>", builder)
    assert two[0].rewards_per_turn == [1.0]
    (lines,) = _builders({"dataset": "chain_sum", "answer_format": "last_line"}, n=1)
    answer = str(lines.entry["answer"])
    assert run_group(lambda inp: f"working...\n{answer}\n", lines)[0].rewards_per_turn == [1.0]
    prompt = lines.make_episodes()[0].initial_observation()[0][-1]["content"]
    assert prompt.endswith("Give your final answer alone on the last line.")
    (boxed,) = _builders({"dataset": "chain_sum", "answer_format": "boxed"}, n=1)
    answer = str(boxed.entry["answer"])
    assert run_group(lambda inp: f"1+2=\\boxed{{{answer}}}", boxed)[0].rewards_per_turn == [1.0]
    assert run_group(lambda inp: f"<answer>{answer}</answer>", boxed)[0].rewards_per_turn == [0.0]


def test_it_gives_partial_credit_only_when_asked() -> None:
    # countdown scores any wrong expression 0.01-0.05.
    config = {"dataset": "countdown", "size": 50}
    (strict,) = _builders(config, n=1, group_size=1)
    (lenient,) = _builders({**config, "partial_credit": True}, n=1, group_size=1)
    assert strict.entry == lenient.entry
    wrong = lambda inp: "<answer>1 + 1</answer>"  # noqa: E731
    score = dataset(lenient.config).score_answer(answer="1 + 1", entry=lenient.entry)
    assert 0.0 < score < 1.0
    strict_turn = run_group(wrong, strict)[0].turns[0]
    lenient_turn = run_group(wrong, lenient)[0].turns[0]
    assert strict_turn.reward == 0.0 and strict_turn.metrics["score"] == score
    assert lenient_turn.reward == score
    assert run_group(_knows_the_answer(lenient), lenient)[0].rewards_per_turn == [1.0]


def test_it_turns_a_scorer_exception_into_an_error_value() -> None:
    (builder,) = _builders({"dataset": "prime_factorization"}, n=1, group_size=2)
    trajectories = run_group(lambda inp: "<answer>seven</answer>", builder)
    for traj in trajectories:
        assert traj.error is None  # the episode ended normally, not as a crash
        assert traj.rewards_per_turn == [0.0]
        turn = traj.turns[0]
        assert turn.error == "scorer_error"
        assert turn.info["scorer_error"].startswith("ValueError")
    assert run_group(_knows_the_answer(builder), builder)[0].rewards_per_turn == [1.0]


def test_it_carries_the_generated_item_inside_the_picklable_builder() -> None:
    config = {"dataset": "arc_agi", "size": 20}
    first = _builders(config, n=2, seed=4)
    again = _builders(config, n=2, seed=4)
    assert pickle.dumps(first) == pickle.dumps(again)
    restored = pickle.loads(pickle.dumps(first))
    assert restored[0].entry == first[0].entry
    assert run_group(_knows_the_answer(restored[0]), restored[0])[0].rewards_per_turn == [1.0]
    # Why the entry is never rebuilt from JSON: arc_agi's tuples come back as lists and its
    # scorer no longer recognises its own answer.
    rebuilt = json.loads(json.dumps(first[0].entry))
    truth = first[0].entry["answer"]
    assert dataset(first[0].config).score_answer(answer=truth, entry=rebuilt) < 1.0


def test_it_keeps_a_hash_seed_dependent_item_in_another_process() -> None:
    """isomorphic_strings gives another item under another PYTHONHASHSEED: the builder made in
    one process is scored in another as it was generated."""
    script = (
        "import json, pickle, sys\n"
        "from environments.registry import make_group_builders\n"
        "from environments.rollouts import run_group\n"
        "cfg = {'dataset': 'isomorphic_strings', 'size': 50}\n"
        "if sys.argv[1] == 'make':\n"
        "    builders = make_group_builders('reasoning_gym', config=cfg, n_groups=6,"
        " group_size=1, seed=3)\n"
        "    sys.stdout.buffer.write(pickle.dumps(builders))\n"
        "else:\n"
        "    builders = pickle.loads(sys.stdin.buffer.read())\n"
        "    fresh = make_group_builders('reasoning_gym', config=cfg, n_groups=6,"
        " group_size=1, seed=3)\n"
        "    rewards = [run_group(lambda inp, b=b: '<answer>' + str(b.entry['answer'])"
        " + '</answer>', b)[0].total_reward for b in builders]\n"
        "    same = [a.entry == b.entry for a, b in zip(builders, fresh)]\n"
        "    print(json.dumps([rewards, same]))\n"
    )

    def run(hash_seed: str, arg: str, stdin: bytes = b"") -> bytes:
        env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
        env["PYTHONHASHSEED"] = hash_seed
        proc = subprocess.run(
            [sys.executable, "-c", script, arg],
            cwd=ROOT,
            env=env,
            input=stdin,
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr.decode()
        return proc.stdout

    made = run("1", "make")
    rewards, same = json.loads(run("2", "play", made))
    assert rewards == [1.0] * 6
    assert not all(same), "isomorphic_strings no longer depends on the hash seed"


@pytest.mark.parametrize(
    "config, field, words",
    [
        ({"dataset": "chain_sums"}, "env_config.dataset", "did you mean 'chain_sum'"),
        ({"dataset": 3}, "env_config.dataset", "string"),
        ({"options": {"bogus": 1}}, "env_config.options", "no option 'bogus'"),
        ({"options": {"min_terms": -1}}, "env_config.options", "min_terms must be positive"),
        ({"options": {"seed": 3}}, "env_config.options", "top level"),
        ({"dataset": "composite"}, "env_config.datasets", "at least one generator"),
        (
            {"dataset": "composite", "datasets": [{"name": "nope"}]},
            "env_config.datasets",
            "datasets[0]: unknown reasoning-gym generator 'nope'",
        ),
        (
            {"dataset": "composite", "datasets": [{"name": "chain_sum", "weight": 0}]},
            "env_config.datasets",
            "weight must be > 0",
        ),
        (
            {"dataset": "composite", "datasets": [{"name": "chain_sum", "config": {"x": 1}}]},
            "env_config.datasets",
            "no option 'x'",
        ),
        ({"datasets": [{"name": "chain_sum"}]}, "env_config.datasets", "for dataset 'composite'"),
        ({"size": 0}, "env_config.size", "greater than or equal to 1"),
        ({"seed": -2}, "env_config.seed", "greater than or equal to 0"),
        ({"partial_credit": "sometimes"}, "env_config.partial_credit", "boolean"),
        (
            {"answer_format": "xml"},
            "env_config.answer_format",
            "'answer_tag', 'last_line' or 'boxed'",
        ),
        ({"temperature": 1}, "env_config.temperature", "unknown setting"),
    ],
)
def test_it_names_the_setting_of_a_bad_config(
    config: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(ContractError) as err:
        make_config("reasoning_gym", config)
    assert err.value.field == field
    assert words in err.value.reason


def test_it_lists_the_generators_in_its_description() -> None:
    info = get_env("reasoning_gym").describe()
    names = info["choices"]["dataset"]
    assert names == generator_names()
    assert {"chain_sum", "arc_agi", "countdown", "composite"} <= set(names)
    assert len(names) > 100
    props = info["config_schema"]["properties"]
    assert props["partial_credit"]["default"] is False
    assert "below 1.0" in props["partial_credit"]["description"]
    assert (info["data_source"], info["interaction"]) == ("generator", "single_turn")


def test_it_scores_the_same_on_an_env_worker_as_inline(env_worker: str, renderer: Renderer) -> None:
    from environments.remote import run_group_remote

    for config in (
        {"dataset": "chain_sum", "options": {"max_terms": 3}},
        {
            "dataset": "composite",
            "datasets": [{"name": "leg_counting"}, {"name": "basic_arithmetic"}],
            "partial_credit": True,
        },
    ):
        specs = group_specs("reasoning_gym", config=config, n_groups=3, group_size=2, seed=9)
        for i, spec in enumerate(specs):
            builder = build_group(spec)
            assert isinstance(builder, ReasoningGymGroupBuilder)
            answer = str(builder.entry["answer"])

            def policy(inp: PolicyInput, answer: str = answer, i: int = i) -> str:
                # Right on some groups, wrong on others: both paths must agree on each.
                return f"<answer>{answer if i % 2 == 0 else 'x' + answer}</answer>"

            remote = run_group_remote(policy, spec, renderer, timeout=60)
            inline = run_group(policy, builder, renderer)
            assert [t.rewards_per_turn for t in remote] == [t.rewards_per_turn for t in inline]
            assert [t.tokens() for t in remote] == [t.tokens() for t in inline]
            if i % 2 == 0:
                assert remote[0].rewards_per_turn == [1.0]
            else:
                assert remote[0].total_reward < 1.0


@pytest.mark.django_db
def test_it_answers_400_naming_the_setting_of_a_bad_job_config(owner_client: Any) -> None:
    from jobs.models import Job

    spec = {"method": "rl", "env": "reasoning_gym", "env_config": {"options": {"bogus": 1}}}
    response = owner_client.post("/api/v1/jobs", {"spec": spec}, format="json")
    assert response.status_code == 400
    body = response.json()
    assert body["detail"] == "invalid job spec"
    assert [e["field"] for e in body["errors"]] == ["env_config.options"]
    assert "no option 'bogus'" in body["errors"][0]["reason"]
    assert not Job.objects.exists()
    spec["env_config"] = {"dataset": "leg_counting", "options": {"max_animals": 3}}
    assert owner_client.post("/api/v1/jobs", {"spec": spec}, format="json").status_code == 201


@pytest.mark.django_db
def test_it_lists_the_generators_through_the_api(owner_client: Any) -> None:
    body = owner_client.get("/api/v1/environments/reasoning_gym").json()
    assert "chain_sum" in body["choices"]["dataset"]
    listed = {env["name"]: env for env in owner_client.get("/api/v1/environments").json()}
    assert listed["reasoning_gym"]["choices"] == body["choices"]
    assert "TicTacToe-v0" in listed["textarena"]["choices"]["game"]
    assert listed["math"]["choices"] == {}
