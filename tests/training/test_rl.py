"""Advantage estimators and trajectory -> datum conversion."""

from __future__ import annotations

import pytest
import torch

from training.rl import (
    Trajectory,
    Turn,
    baseline,
    grpo,
    grpo_per_step,
    returns_to_go,
    rloo,
    sample_to_datum,
    trajectories_to_datums,
    trajectory_to_datum,
)
from training.types import SampledSequence


def test_it_centres_grpo_on_the_group_mean():
    adv = grpo([1.0, 0.0, 0.0, 1.0])
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]
    normed = grpo([1.0, 0.0, 0.0, 1.0], normalize_std=True)
    torch.testing.assert_close(normed, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    # A group with identical rewards carries no signal.
    assert grpo([3.0, 3.0], normalize_std=True).tolist() == [0.0, 0.0]
    stacked = grpo([[1.0, 3.0], [0.0, 0.0]])
    assert stacked.tolist() == [[-1.0, 1.0], [0.0, 0.0]]


def test_it_leaves_one_out_in_rloo():
    assert rloo([1.0, 0.0, 2.0]).tolist() == [0.0, -1.5, 1.5]
    with pytest.raises(ValueError, match="two samples"):
        rloo([1.0])


def test_it_subtracts_a_plain_baseline():
    assert baseline([1.0, 0.5], value=0.5).tolist() == [0.5, 0.0]


def test_it_normalises_returns_to_go_within_the_group():
    assert returns_to_go([1.0, 0.0, 2.0], gamma=0.5) == [1.5, 1.0, 2.0]
    adv = grpo_per_step([[0.0, 1.0], [0.0, 0.0, 0.0]], normalize_std=False)
    # Returns-to-go: [1, 1] and [0, 0, 0]; group mean 0.4.
    assert adv[0] == pytest.approx([0.6, 0.6]) and adv[1] == pytest.approx([-0.4, -0.4, -0.4])
    normed = grpo_per_step([[0.0, 1.0], [0.0, 0.0, 0.0]])
    flat = torch.tensor([a for traj in normed for a in traj])
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert flat.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError):
        grpo_per_step([[]])


def test_it_puts_loss_only_on_model_tokens_of_a_multi_turn_trajectory():
    trajectory = Trajectory(
        [
            Turn(
                observation=[10, 11, 12], action=[20, 21], action_logprobs=[-0.1, -0.2], reward=0.0
            ),
            Turn(
                observation=[13],
                action=[22, 23, 24],
                action_logprobs=[-0.3, -0.4, -0.5],
                reward=1.0,
            ),
        ]
    )
    datum = trajectory_to_datum(trajectory, [0.5, -2.0])
    assert datum.model_input.tolist() == [10, 11, 12, 20, 21, 13, 22, 23]
    inputs = datum.loss_fn_inputs
    assert inputs["target_tokens"].tolist() == [11, 12, 20, 21, 13, 22, 23, 24]
    assert inputs["mask"].tolist() == [0, 0, 1, 1, 0, 1, 1, 1]
    assert inputs["advantages"].tolist() == [0, 0, 0.5, 0.5, 0, -2.0, -2.0, -2.0]
    torch.testing.assert_close(
        inputs["logprobs"], torch.tensor([0, 0, -0.1, -0.2, 0, -0.3, -0.4, -0.5])
    )
    assert trajectory.total_reward == 1.0


def test_it_keeps_the_mask_where_the_advantage_is_zero():
    datums = trajectories_to_datums(
        [Trajectory([Turn([1, 2], [3, 4], [-1.0, -1.0])])], torch.tensor([0.0])
    )
    assert datums[0].loss_fn_inputs["mask"].tolist() == [0, 1, 1]
    assert datums[0].loss_fn_inputs["advantages"].tolist() == [0, 0, 0]


def test_it_converts_a_sample():
    seq = SampledSequence(tokens=[7, 8], logprobs=[-0.5, -0.25], stop_reason="stop")
    datum = sample_to_datum([1, 2, 3], seq, advantage=1.5)
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 7, 8]
    assert datum.loss_fn_inputs["mask"].tolist() == [0, 0, 1, 1]
    assert datum.loss_fn_inputs["advantages"].tolist() == [0, 0, 1.5, 1.5]


def test_it_rejects_inconsistent_trajectories():
    with pytest.raises(ValueError, match="logprobs"):
        Turn([1], [2, 3], [-1.0])
    with pytest.raises(ValueError, match="non-empty observation"):
        trajectory_to_datum(Trajectory([Turn([], [2, 3], [-1.0, -1.0])]), 1.0)
    with pytest.raises(ValueError, match="advantages for 1 turns"):
        trajectory_to_datum(Trajectory([Turn([1], [2], [-1.0])]), [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        grpo([1.0, float("nan")])


def test_rewards_equal_but_for_rounding_give_no_advantage():
    # Two illegal moves and a forfeit summed in two orders: equal rewards, different floats.
    a, b = sum([-0.1, -0.1, -1.0]), sum([-1.0, -0.1, -0.1])
    assert a != b and a == pytest.approx(b)
    group = [a, b, a, b, a, b, a, b]
    # The float32 group mean of these is an ulp off; divided by a std of ~0 that ulp used to
    # become an advantage of -0.11 on every episode of the group.
    for normalize_std in (True, False):
        assert grpo(group, normalize_std=normalize_std).tolist() == [0.0] * 8
    assert rloo(group).tolist() == [0.0] * 8
    assert grpo_per_step([[a], [b], [a]]) == [[0.0], [0.0], [0.0]]
    # A real difference, small against the rewards' size, still counts.
    small = grpo([-1.2, -1.2 + 1e-3], normalize_std=True)
    assert small.tolist() == pytest.approx([-1.0, 1.0], abs=1e-2)
