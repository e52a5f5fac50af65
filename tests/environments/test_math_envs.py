"""math and math_code: answer extraction, equivalence, rewards, multi-turn sandbox turns."""

from __future__ import annotations

import pytest

from environments.envs.math_code import MathCodeConfig, MathCodeEpisode, extract_code
from environments.envs.math_env import MathConfig, MathEpisode
from environments.grading import answers_match, extract_answer
from environments.registry import ContractError, make_group_builders
from environments.renderer import Renderer
from environments.rollouts import run_episode, run_group
from environments.sandbox import SandboxLimits


@pytest.mark.parametrize(
    ("text", "truth"),
    [
        ("\\boxed{42}", "42"),
        ("so it is 40, no wait: \\boxed{42}", "42"),
        ("The answer is 42.", "42"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{2/4}", "1/2"),
        ("\\boxed{\\dfrac{7}{8}}", "7/8"),
        ("\\boxed{1,234}", "1234"),
        ("\\boxed{-7}", "-7.0"),
        ("\\boxed{2\\sqrt{2}}", "sqrt(8)"),
        ("\\boxed{x + 1}", "1 + x"),
        ("\\boxed{\\text{dollars} 17}", "17"),
    ],
)
def test_it_accepts_equivalent_answers(text: str, truth: str) -> None:
    assert answers_match(extract_answer(text), truth)


@pytest.mark.parametrize(
    ("text", "truth"),
    [
        ("\\boxed{41}", "42"),
        ("\\boxed{42} then 43", "43"),  # the boxed answer wins over a later number
        ("no number here", "3"),
        ("\\boxed{}", "0"),
        ("\\boxed{9^9^9}", "1"),  # a power tower is refused, not evaluated
        ("\\boxed{__import__('os').system('true')}", "0"),
        ("\\boxed{1/0}", "0"),
    ],
)
def test_it_rejects_wrong_or_unsafe_answers(text: str, truth: str) -> None:
    assert not answers_match(extract_answer(text), truth)


def test_it_extracts_nested_boxed_content() -> None:
    assert extract_answer("\\boxed{\\frac{3}{4}} and earlier 5") == "\\frac{3}{4}"
    assert extract_answer("x = 3, y = 12.5") == "12.5"
    assert extract_answer("nothing") is None


def test_it_rewards_math_answers_with_optional_format_bonus() -> None:
    def play(action: str, config: MathConfig) -> tuple[float, dict]:
        ep = MathEpisode("What is 2+3?", "5", config)
        messages, _stop = ep.initial_observation()
        assert messages[-1]["content"].startswith("What is 2+3?")
        result = ep.step(action)
        assert result.done
        return result.reward, result.metrics

    plain = MathConfig()
    assert play("\\boxed{5}", plain)[0] == 1.0
    assert play("5", plain)[0] == 1.0
    assert play("\\boxed{6}", plain)[0] == 0.0
    fmt = MathConfig(format_reward=0.1)
    assert play("\\boxed{5}", fmt) == (1.1, {"correct": 1.0, "format": 1.0})
    assert play("5", fmt)[0] == 1.0
    assert play("\\boxed{4}", fmt)[0] == pytest.approx(0.1)
    ep = MathEpisode("q", "5", plain)
    ep.initial_observation()
    assert ep.step("I don't know").error == "no_answer"


def test_a_rows_context_comes_before_the_question_and_a_bad_one_is_named() -> None:
    context = [
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "\\boxed{2}"},
    ]
    row = {"question": "What is 2+3?", "answer": "5", "context": context}
    (builder,) = make_group_builders(
        "math", config={"system_prompt": "Be brief."}, rows=[row], n_groups=1, group_size=1, seed=0
    )
    messages, _ = builder.make_episodes()[0].initial_observation()
    assert messages == [
        {"role": "system", "content": "Be brief."},
        *context,
        {"role": "user", "content": "What is 2+3?"},
    ]
    for bad, words in [
        ("earlier", "list of"),
        ([{"role": "system", "content": "x"}], "list of"),
        ([{"role": "user", "content": 3}], "list of"),
        ([{"role": "user", "content": "What is 1+1?"}], "end with an assistant turn"),
    ]:
        with pytest.raises(ContractError) as err:
            make_group_builders("math", rows=[{**row, "context": bad}], n_groups=1, group_size=1)
        assert err.value.field == "row.context" and words in err.value.reason


def test_it_scores_a_math_group_from_the_builtin_dataset(renderer: Renderer) -> None:
    from environments.datasets import load_rows, resolve

    rows = load_rows(resolve("builtin:arith_test"), "math")
    builder = make_group_builders("math", rows=rows, n_groups=1, group_size=4, seed=3)[0]
    answers = iter([f"\\boxed{{{builder.answer}}}", "\\boxed{-1}", builder.answer, "none"])
    trajs = run_group(lambda inp: next(answers), builder, renderer)
    assert [t.total_reward for t in trajs] == [1.0, 0.0, 1.0, 0.0]
    assert all(t.mask().count(1) == len(t.turns[0].action_tokens) for t in trajs)


def test_it_finds_fenced_code() -> None:
    assert extract_code("try:\n```python\nprint(1)\n```\nok") == "print(1)\n"
    assert extract_code("```\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```python\nprint(3)") == "print(3)"
    assert extract_code("no code") is None


FAST = MathCodeConfig(max_turns=3, limits=SandboxLimits(cpu_seconds=1, wall_seconds=3.0))


def test_it_runs_code_and_feeds_the_output_back_masked(renderer: Renderer) -> None:
    actions = iter(["Let me compute.\n```python\nprint(123 * 45)\n```", "\\boxed{5535}"])
    traj = run_episode(
        lambda inp: next(actions), MathCodeEpisode("What is 123*45?", "5535", FAST), renderer
    )
    assert traj.error is None
    assert [t.reward for t in traj.turns] == [0.0, 1.0]
    assert traj.turns[1].observation_messages == [{"role": "user", "content": "Output:\n5535"}]
    masked = renderer.decode([t for t, m in zip(traj.tokens(), traj.mask()) if not m])
    trained = renderer.decode([t for t, m in zip(traj.tokens(), traj.mask()) if m])
    assert "Output:\n5535" in masked and "Output" not in trained
    assert "print(123 * 45)" in trained
    assert traj.turns[1].metrics["code_runs"] == 1.0


def test_it_reports_crashing_and_runaway_code_as_observations() -> None:
    ep = MathCodeEpisode("q", "1", FAST)
    ep.initial_observation()
    crash = ep.step("```python\n1/0\n```")
    assert not crash.done and crash.error == "code_error"
    assert "ZeroDivisionError" in crash.next_messages[0]["content"]
    loop = ep.step("```python\nwhile True:\n    pass\n```")
    assert loop.error == "code_error" and not loop.done
    assert "CPU-time limit" in loop.next_messages[0]["content"]
    assert loop.info["sandbox"]["killed_by"] == "cpu_time"
    # The third action is the last allowed one: code there ends the episode unanswered.
    last = ep.step("```python\nprint(1)\n```")
    assert last.done and last.reward == 0.0 and last.error == "max_turns"


def test_it_grades_a_direct_answer_without_code() -> None:
    ep = MathCodeEpisode("q", "7", FAST)
    ep.initial_observation()
    result = ep.step("The answer is \\boxed{7}")
    assert result.done and result.reward == 1.0 and result.metrics["code_runs"] == 0.0
