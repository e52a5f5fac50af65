"""The renderer and the episode driver: token layout, masks, logprobs, per-turn rewards."""

from __future__ import annotations

import pytest

from environments.renderer import Renderer, RendererError
from environments.rollouts import PolicyInput, PolicyOutput, run_episode
from environments.types import (
    Episode,
    EpisodeError,
    Message,
    StepResult,
    StopCondition,
    Trajectory,
)


class EchoEpisode(Episode):
    """Three turns; each observation is a tool message; reward = turn number."""

    def __init__(self, turns: int = 3) -> None:
        super().__init__()
        self.turns = turns
        self.n = 0

    def _initial(self) -> tuple[list[Message], StopCondition]:
        return [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "start"},
        ], StopCondition(max_tokens=8)

    def _step(self, action: str) -> StepResult:
        self.n += 1
        done = self.n >= self.turns
        return StepResult(
            reward=float(self.n),
            done=done,
            next_messages=[] if done else [{"role": "tool", "content": f"obs{self.n}"}],
        )


def scripted_token_policy(renderer: Renderer, texts: list[str]):
    """Returns pre-written actions as tokens ending in the end-of-turn token, with logprobs."""
    calls: list[PolicyInput] = []

    def policy(inp: PolicyInput) -> PolicyOutput:
        calls.append(inp)
        tokens = renderer.encode(texts[len(calls) - 1] + "<|im_end|>")
        return PolicyOutput(tokens=tokens, logprobs=[-0.5 - i for i in range(len(tokens))])

    return policy, calls


def test_it_renders_the_prompt_with_the_chat_template(renderer: Renderer, chatml_tokenizer) -> None:
    tokens = renderer.prompt_tokens([{"role": "user", "content": "hi"}])
    assert (
        chatml_tokenizer.decode(tokens) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert renderer.turn_end_text == "<|im_end|>\n"
    assert renderer.stop_token_ids() == [chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_it_masks_observations_and_trains_only_sampled_tokens(renderer: Renderer) -> None:
    policy, calls = scripted_token_policy(renderer, ["a1", "a2", "a3"])
    traj = run_episode(policy, EchoEpisode(), renderer)
    assert traj.error is None and len(traj.turns) == 3
    tokens, mask, logprobs = traj.tokens(), traj.mask(), traj.logprobs()
    assert len(tokens) == len(mask) == len(logprobs) == len(traj.turn_index())
    # Trainable positions are exactly the sampled tokens, in order, with their logprobs.
    sampled = [t for turn in traj.turns for t in turn.action_tokens]
    assert [t for t, m in zip(tokens, mask) if m] == sampled
    assert [lp for lp, m in zip(logprobs, mask) if m] == [
        lp for t in traj.turns for lp in t.action_logprobs
    ]
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)
    # Observation text (the tool outputs) never sits in a trainable position.
    masked_text = renderer.decode(
        [t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False
    )
    assert "obs1" in masked_text and "obs2" in masked_text
    trained_text = renderer.decode(sampled, skip_special_tokens=False)
    assert trained_text == "a1<|im_end|>a2<|im_end|>a3<|im_end|>"
    # The whole sequence is what the chat template renders for the full conversation.
    convo = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "start"},
        {"role": "assistant", "content": "a1"},
        {"role": "tool", "content": "obs1"},
        {"role": "assistant", "content": "a2"},
        {"role": "tool", "content": "obs2"},
        {"role": "assistant", "content": "a3"},
    ]
    full = renderer.encode(renderer.tokenizer.apply_chat_template(convo, tokenize=False))
    assert tokens == full[: len(tokens)]
    # The policy saw the growing context: each input is a prefix of the final sequence.
    for inp in calls:
        assert tokens[: len(inp.tokens)] == inp.tokens
    assert calls[1].messages[-1] == {"role": "tool", "content": "obs1"}
    assert calls[0].stop.max_tokens == 8
    assert calls[0].stop.stop_token_ids == tuple(renderer.stop_token_ids())
    assert traj.rewards_per_turn == [1.0, 2.0, 3.0] and traj.total_reward == 6.0
    assert traj.turns[1].observation_messages == [{"role": "tool", "content": "obs1"}]


def test_it_closes_a_turn_the_model_left_open(renderer: Renderer) -> None:
    # A policy cut at max_tokens produces no end-of-turn token; the glue adds it, masked.
    texts = iter(["cut", "done"])

    def policy(inp: PolicyInput) -> PolicyOutput:
        return PolicyOutput(tokens=renderer.encode(next(texts)))

    traj = run_episode(policy, EchoEpisode(turns=2), renderer)
    obs = renderer.decode(traj.turns[1].observation_tokens, skip_special_tokens=False)
    assert obs == "<|im_end|>\n<|im_start|>tool\nobs1<|im_end|>\n<|im_start|>assistant\n"
    assert traj.turns[0].action_text == "cut"


def test_it_accepts_text_only_policies(renderer: Renderer) -> None:
    traj = run_episode(lambda inp: "hello", EchoEpisode(turns=1), renderer)
    assert traj.turns[0].action_tokens == renderer.encode("hello")
    assert traj.turns[0].action_logprobs == [0.0] * 5
    no_tokens = run_episode(lambda inp: "hello", EchoEpisode(turns=1))
    assert no_tokens.tokens() == [] and no_tokens.total_reward == 1.0


def test_it_round_trips_trajectories_through_json(renderer: Renderer) -> None:
    policy, _ = scripted_token_policy(renderer, ["x", "y", "z"])
    traj = run_episode(policy, EchoEpisode(), renderer)
    again = Trajectory.from_json(traj.to_json())
    assert again.tokens() == traj.tokens() and again.mask() == traj.mask()
    assert again.rewards_per_turn == traj.rewards_per_turn


def test_it_turns_env_crashes_into_values(renderer: Renderer) -> None:
    class Broken(EchoEpisode):
        def _step(self, action: str) -> StepResult:
            raise ZeroDivisionError("boom")

    traj = run_episode(lambda inp: "a", Broken(), renderer)
    assert traj.error is not None and "ZeroDivisionError: boom" in traj.error
    assert traj.turns[0].error == "env_exception"

    class Endless(EchoEpisode):
        def _step(self, action: str) -> StepResult:
            return StepResult(0.0, False, [{"role": "user", "content": "again"}])

    traj = run_episode(lambda inp: "a", Endless(), renderer, max_turns=3)
    assert len(traj.turns) == 3 and "max_turns" in traj.error


def test_it_enforces_single_use_episodes() -> None:
    ep = EchoEpisode(turns=1)
    with pytest.raises(EpisodeError):
        ep.step("early")
    ep.initial_observation()
    with pytest.raises(EpisodeError):
        ep.initial_observation()
    assert ep.step("x").done
    with pytest.raises(EpisodeError):
        ep.step("again")


def test_it_refuses_a_tokenizer_without_chat_template(chatml_tokenizer) -> None:
    import copy

    bare = copy.deepcopy(chatml_tokenizer)
    bare.chat_template = None
    with pytest.raises(RendererError, match="no chat template"):
        Renderer(bare)


def test_it_rejects_mismatched_logprobs(renderer: Renderer) -> None:
    with pytest.raises(ValueError, match="logprobs"):
        run_episode(
            lambda inp: PolicyOutput(tokens=[1, 2], logprobs=[0.0]), EchoEpisode(), renderer
        )


def test_it_hands_the_engine_trajectories_it_turns_into_masked_datums(renderer: Renderer) -> None:
    torch = pytest.importorskip("torch")
    from training.rl import grpo_per_step, trajectory_to_datum

    torch.set_num_threads(1)
    policy, _ = scripted_token_policy(renderer, ["a1", "a2", "a3"])
    traj = run_episode(policy, EchoEpisode(), renderer)
    engine_traj = traj.to_engine()
    assert engine_traj.turn_rewards == traj.rewards_per_turn
    advantages = grpo_per_step([engine_traj.turn_rewards])[0]
    datum = trajectory_to_datum(engine_traj, advantages)
    inputs = datum.loss_fn_inputs
    assert datum.model_input.tolist() == traj.tokens()[:-1]
    assert inputs["mask"].tolist() == [float(m) for m in traj.mask()[1:]]
    assert inputs["logprobs"].tolist() == pytest.approx(traj.logprobs()[1:])
    # Each action token carries its own turn's advantage; observations carry none.
    turn_of = traj.turn_index()[1:]
    for adv, m, turn in zip(inputs["advantages"].tolist(), traj.mask()[1:], turn_of):
        assert adv == pytest.approx(advantages[turn] if m else 0.0)
