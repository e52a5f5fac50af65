from __future__ import annotations

from environments.envs.bandit import BanditConfig, BanditEpisode, arm_means, parse_arm
from environments.registry import make_group_builders
from environments.rollouts import run_group


def play(config: BanditConfig, seed: int, action: str):
    ep = BanditEpisode(config, seed)
    messages, _ = ep.initial_observation()
    assert f"{config.n_arms} arms numbered 0 to {config.n_arms - 1}" in messages[0]["content"]
    return ep, ep.step(action)


def test_it_parses_arm_names() -> None:
    assert parse_arm("\\boxed{3}") == 3
    assert parse_arm("I pick arm 2") == 2
    assert parse_arm("arm 1, no, \\boxed{4}") == 4
    assert parse_arm(" 0 ") == 0
    assert parse_arm("the third one") is None


def test_it_pays_the_named_arms_hidden_payoff() -> None:
    config = BanditConfig(n_arms=5, env_seed=11)
    for seed in range(20):
        for arm in range(5):
            ep, result = play(config, seed, f"\\boxed{{{arm}}}")
            assert result.done
            assert result.reward == ep.payoffs[arm]
            assert result.reward in (0.0, 1.0)


def test_it_is_deterministic_per_seed_and_varies_across_seeds() -> None:
    config = BanditConfig(n_arms=5, env_seed=3)
    first = [BanditEpisode(config, s).payoffs for s in range(50)]
    again = [BanditEpisode(config, s).payoffs for s in range(50)]
    assert first == again
    assert len({tuple(p) for p in first}) > 5
    assert arm_means(config) != arm_means(BanditConfig(n_arms=5, env_seed=4))


def test_it_rewards_the_best_arm_most_on_average() -> None:
    # The means are hidden but fixed for the env, so always picking the best arm pays most:
    # this is what a learning policy should discover.
    config = BanditConfig(n_arms=4, env_seed=5)
    means = arm_means(config)
    avg = [sum(play(config, s, f"arm {a}")[1].reward for s in range(400)) / 400 for a in range(4)]
    best = max(range(4), key=lambda a: means[a])
    assert max(range(4), key=lambda a: avg[a]) == best
    for a in range(4):
        assert abs(avg[a] - means[a]) < 0.1


def test_it_scores_invalid_arms_as_errors() -> None:
    config = BanditConfig(n_arms=3, invalid_reward=-0.5)
    for action in ("\\boxed{3}", "arm -1", "whatever"):
        _, result = play(config, 0, action)
        assert result.done and result.reward == -0.5 and result.error == "invalid_arm"


def test_it_builds_groups_with_distinct_episode_seeds() -> None:
    builder = make_group_builders(
        "bandit", config={"n_arms": 3, "env_seed": 9}, n_groups=1, group_size=16, seed=2
    )[0]
    trajs = run_group(lambda inp: "\\boxed{0}", builder)
    rewards = [t.total_reward for t in trajs]
    assert set(rewards) <= {0.0, 1.0}
    assert rewards == [t.total_reward for t in run_group(lambda inp: "\\boxed{0}", builder)]
