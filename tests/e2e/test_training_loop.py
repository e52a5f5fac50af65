"""The native training loop in-process (no Django, no worker): resume replays exactly.

A run interrupted after a checkpoint and resumed by a fresh loop (a new policy object, as on a
new worker) logs the same metrics and ends with the same adapter, bit for bit, as a run that
was never interrupted: the checkpoint plus the data cursor is the whole state.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from jobs.spec import parse_spec
from tests.e2e.rows import addition_rows
from training import peft_io
from training.engine import Engine
from workers.runners.loop import TrainingLoop

pytestmark = pytest.mark.timeout(90)


class Recorder:
    """A LoopContext that keeps what the loop reports; `stop_after` steps, it says stop."""

    def __init__(self, workdir: Path, stop_after: int | None = None, attempt: int = 1) -> None:
        self.workdir = workdir
        self.attempt = attempt
        self.stop_after = stop_after
        self.metrics: dict[int, dict[str, float]] = {}
        self.events: list[tuple[str, Any]] = []

    def cancelled(self) -> bool:
        trained = [s for s in self.metrics if s > 0]
        return self.stop_after is not None and len(trained) >= self.stop_after

    def heartbeat(self, step: int | None = None, *, force: bool = False) -> None:
        pass

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.metrics.setdefault(step, {}).update(metrics)

    def flush_metrics(self) -> None:
        pass

    def discard_metrics_after(self, step: int) -> None:
        self.metrics = {s: m for s, m in self.metrics.items() if s <= step}

    def event(self, message: str, data: Mapping[str, Any] | None = None) -> None:
        self.events.append((message, data))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    torch.set_num_threads(1)
    return Engine(tiny_model_dir)


def run_loop(engine: Engine, ctx: Recorder, spec: Any, policy_id: str) -> bool:
    loop = TrainingLoop(
        ctx,
        spec,
        engine,
        rows=addition_rows(200),
        eval_rows=addition_rows(8, 300),
        policy_id=policy_id,
    )
    try:
        return loop.run()
    finally:
        loop.close()


def test_it_resumes_from_a_checkpoint_exactly_where_the_run_stopped(
    engine: Engine, tmp_path: Path
) -> None:
    spec = parse_spec(
        {
            "method": "rl",
            "env": "math",
            "dataset": "builtin:unused",
            "steps": 4,
            "seed": 11,
            "checkpoint_every": 2,
            "rollout": {"group_size": 4, "prompts_per_step": 3, "max_tokens": 24},
            "lora": {"rank": 4, "alpha": 8},
            "optimizer": {"lr": 1e-3},
        }
    )
    straight = Recorder(tmp_path / "straight")
    assert run_loop(engine, straight, spec, "straight") is True

    broken = tmp_path / "broken"
    first = Recorder(broken, stop_after=3)
    assert run_loop(engine, first, spec, "first") is False
    assert sorted(first.metrics) == [1, 2, 3]
    second = Recorder(broken, attempt=2)
    # The store as the first attempt left it, step 3 included (after the last checkpoint).
    second.metrics = {s: {**m, "stale": 1.0} for s, m in first.metrics.items()}
    assert run_loop(engine, second, spec, "second") is True

    assert sorted(second.metrics) == [1, 2, 3, 4]
    assert [s for s, m in second.metrics.items() if "stale" in m] == [1, 2]
    assert second.events[0][1] == {"checkpoint": "step-000002", "step": 2, "cursor": 6}
    assert any(straight.metrics[s]["datums"] > 0 for s in (1, 2, 3, 4))
    for step in (3, 4):
        for name in ("reward/mean", "loss", "grad_norm", "entropy"):
            assert second.metrics[step][name] == straight.metrics[step][name], (step, name)
    a = load_file(tmp_path / "straight" / "adapter" / "adapter_model.safetensors")
    b = load_file(broken / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(t.abs().sum()) > 0 for k, t in a.items() if "lora_B" in k)


def test_it_evaluates_greedily_on_held_out_rows_and_trains_sft_on_answers(
    engine: Engine, tmp_path: Path
) -> None:
    spec = parse_spec(
        {
            "method": "sft",
            "env": "math",
            "dataset": "builtin:unused",
            "steps": 3,
            "batch_size": 8,
            "eval_every": 3,
            "eval_examples": 8,
            "checkpoint_every": 0,
            "lora": {"rank": 4, "alpha": 8},
        }
    )
    ctx = Recorder(tmp_path)
    assert run_loop(engine, ctx, spec, "sft") is True
    assert sorted(ctx.metrics) == [0, 1, 2, 3]
    assert ctx.metrics[0]["eval/episodes"] == ctx.metrics[3]["eval/episodes"] == 8
    assert 0.0 <= ctx.metrics[3]["eval/accuracy"] <= 1.0
    transcript = (tmp_path / "eval" / "step-000003.jsonl").read_text().splitlines()
    assert len(transcript) == 8
    assert all(ctx.metrics[s]["loss"] > 0 for s in (1, 2, 3))
    # The datum of a row: loss only on the boxed answer and the end-of-turn token.
    loop = TrainingLoop(ctx, spec, engine, rows=addition_rows(4), eval_rows=[], policy_id="probe")
    try:
        datum = loop.sft_datum({"question": "What is 12+30?", "answer": "42"})
        # A row's own completion is taught verbatim instead.
        move = loop.sft_datum({"question": "Your move?", "answer": "bet", "completion": "[bet]"})
    finally:
        loop.close()
    for taught, text in ((datum, "\\boxed{42}<|im_end|>"), (move, "[bet]<|im_end|>")):
        weights = taught.loss_fn_inputs["weights"]
        targets = taught.loss_fn_inputs["target_tokens"][weights > 0].tolist()
        assert engine.tokenizer.decode(targets) == text


@pytest.mark.parametrize(
    "env, extra",
    [
        (
            "gomoku",
            {
                "algorithm": {
                    "advantage": "grpo_per_step",
                    "loss": "ppo",
                    "kl_coef": 0.05,
                    "loss_aggregation": "sequence_mean",
                }
            },
        ),
        ("gomoku_selfplay", {"algorithm": {"advantage": "rloo", "loss": "cispo"}}),
        ("bandit", {"full_finetune": True, "algorithm": {"loss": "dro"}}),
    ],
)
def test_it_trains_on_generator_and_multi_turn_envs(
    engine: Engine, tmp_path: Path, env: str, extra: dict[str, Any]
) -> None:
    multi = env != "bandit"
    spec = parse_spec(
        {
            "method": "rl",
            "env": env,
            "steps": 2,
            "eval_every": 2,
            "eval_examples": 2,
            "checkpoint_every": 0,
            "rollout": {
                "group_size": 2,
                "prompts_per_step": 2,
                "max_tokens": 16,
                **({"max_turns": 3} if multi else {}),
            },
            "optimizer": {"lr": 1e-5},
            **extra,
        }
    )
    ctx = Recorder(tmp_path)
    loop = TrainingLoop(ctx, spec, engine, rows=None, eval_rows=None, policy_id=f"gen-{env}")
    try:
        assert loop.run() is True
    finally:
        loop.close()
    assert sorted(ctx.metrics) == [0, 1, 2]
    for step in (1, 2):
        metrics = ctx.metrics[step]
        assert metrics["episodes"] == 4
        assert metrics["sample/tokens"] > 0 and metrics["step_time_s"] > 0
    assert ctx.metrics[2]["eval/episodes"] == (4 if env == "gomoku_selfplay" else 2)
    if "kl_coef" in extra.get("algorithm", {}):
        assert "kl/base" in ctx.metrics[1]
    # Full fine-tuning exports a whole model, LoRA an adapter.
    if spec.full_finetune:
        assert (tmp_path / "model" / "config.json").is_file()
    else:
        assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    # The policy left the shared engine: the next job starts from a clean host.
    assert f"gen-{env}" not in engine.policies


def _pipelined_spec(ahead: int, steps: int = 4, **extra: Any) -> Any:
    return parse_spec(
        {
            "method": "rl",
            "env": "math",
            "dataset": "builtin:unused",
            "steps": steps,
            "seed": 5,
            "checkpoint_every": 2,
            "rollout": {
                "group_size": 4,
                "prompts_per_step": 3,
                "max_tokens": 24,
                "max_off_policy_steps": ahead,
            },
            "lora": {"rank": 4, "alpha": 8},
            "optimizer": {"lr": 1e-3},
            **extra,
        }
    )


def _adapter(workdir: Path) -> dict[str, torch.Tensor]:
    return load_file(workdir / "adapter" / "adapter_model.safetensors")


@pytest.mark.parametrize("ahead, behind", [(0, [0, 0, 0, 0]), (1, [0, 1, 1, 1]), (2, [0, 1, 2, 2])])
def test_pipelined_rollouts_sample_a_snapshot_at_most_the_allowed_steps_behind(
    engine: Engine, tmp_path: Path, ahead: int, behind: list[int]
) -> None:
    """Step k's rollouts are requested while earlier steps train, from the snapshot published
    when they were requested; the run is deterministic whatever the threads' timing."""
    spec = _pipelined_spec(ahead)
    runs = []
    for name in ("a", "b"):
        ctx = Recorder(tmp_path / name)
        assert run_loop(engine, ctx, spec, f"pipe-{ahead}-{name}") is True
        runs.append(ctx)
    first, second = runs
    assert [first.metrics[s]["rollout/off_policy_steps"] for s in (1, 2, 3, 4)] == behind
    # Snapshots a finished step no longer samples are dropped as it goes.
    loop = TrainingLoop(
        Recorder(tmp_path / "c"),
        spec,
        engine,
        rows=addition_rows(200),
        eval_rows=[],
        policy_id=f"pipe-{ahead}-c",
    )
    try:
        assert loop.run() is True
        assert loop.policy.versions == [loop.version]
    finally:
        loop.close()
    assert any(first.metrics[s]["datums"] > 0 for s in (1, 2, 3, 4))
    for step in (1, 2, 3, 4):
        for name in ("reward/mean", "loss", "grad_norm"):
            assert first.metrics[step][name] == second.metrics[step][name], (step, name)
    a, b = _adapter(tmp_path / "a"), _adapter(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_off_policy_rollouts_train_other_weights_than_on_policy_ones(
    engine: Engine, tmp_path: Path
) -> None:
    on, off = Recorder(tmp_path / "on"), Recorder(tmp_path / "off")
    assert run_loop(engine, on, _pipelined_spec(0), "on-policy") is True
    assert run_loop(engine, off, _pipelined_spec(1), "off-policy") is True
    # Step 1 samples the initial weights either way; step 2 samples other weights.
    assert on.metrics[1]["reward/mean"] == off.metrics[1]["reward/mean"]
    assert on.metrics[1]["loss"] == off.metrics[1]["loss"]
    a, b = _adapter(tmp_path / "on"), _adapter(tmp_path / "off")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_a_pipelined_run_resumes_at_its_checkpoints_data_cursor(
    engine: Engine, tmp_path: Path
) -> None:
    """The checkpoint after step 2 holds the cursor before step 3's prefetched groups, so the
    resumed run trains on the same rows; its first step samples on-policy (the snapshot step
    3 was prefetched from is not in the checkpoint)."""
    spec = _pipelined_spec(1)
    broken = tmp_path / "broken"
    first = Recorder(broken, stop_after=3)
    assert run_loop(engine, first, spec, "pipe-first") is False
    second = Recorder(broken, attempt=2)
    assert run_loop(engine, second, spec, "pipe-second") is True
    assert second.events[0][1] == {"checkpoint": "step-000002", "step": 2, "cursor": 6}
    assert [second.metrics[s]["rollout/off_policy_steps"] for s in (3, 4)] == [0, 1]
    assert sorted(second.metrics) == [3, 4]


def test_a_run_with_init_weights_starts_from_them_and_a_resumed_run_from_its_own_checkpoint(
    engine: Engine, tmp_path: Path
) -> None:
    sft = parse_spec(
        {
            "method": "sft",
            "env": "math",
            "dataset": "builtin:unused",
            "steps": 2,
            "batch_size": 8,
            "checkpoint_every": 1,
            "lora": {"rank": 4, "alpha": 8},
            "optimizer": {"lr": 1e-2},
        }
    )
    assert run_loop(engine, Recorder(tmp_path / "sft"), sft, "sft-source") is True
    trained = _adapter(tmp_path / "sft")
    source = "0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"
    rl = _pipelined_spec(0, steps=2, init={"from_job": source})

    def weights_of(loop: TrainingLoop) -> dict[str, torch.Tensor]:
        return {
            peft_io.peft_key(name, part): t.detach().clone()
            for name, (a, b) in loop.policy.lora_weights.items()
            for part, t in (("A", a), ("B", b))
        }

    adapter = tmp_path / "sft" / "adapter"
    state = tmp_path / "sft" / "checkpoints" / "step-000001" / "state.pt"

    def loop_for(ctx: Recorder, spec: Any, policy_id: str, init: Path = adapter) -> TrainingLoop:
        return TrainingLoop(
            ctx,
            spec,
            engine,
            rows=addition_rows(200),
            eval_rows=[],
            policy_id=policy_id,
            init_weights=init,
        )

    def started(workdir: Path, policy_id: str, init: Path) -> tuple[TrainingLoop, Recorder]:
        ctx = Recorder(workdir)
        loop = loop_for(ctx, rl, policy_id, init)
        assert loop.resume() is False
        return loop, ctx

    # The final adapter: the policy holds exactly its tensors.
    loop, ctx = started(tmp_path / "rl", "from-adapter", adapter)
    try:
        assert weights_of(loop).keys() == trained.keys()
        assert all(torch.equal(weights_of(loop)[k], trained[k]) for k in trained)
        assert ctx.events[0][0] == f"starts from the weights of job {source}"
    finally:
        loop.close()
    # A checkpoint: its weights, and a fresh optimizer at step 0.
    saved = torch.load(state, weights_only=True)
    loop, _ = started(tmp_path / "rl-ckpt", "from-checkpoint", state)
    try:
        params = dict(loop.policy.named_parameters())
        assert all(torch.equal(params[n], w) for n, w in saved["weights"].items())
        assert loop.policy.step == 0 and not loop.policy.optimizer.state_dict()["state"]
        assert not torch.equal(weights_of(loop)[next(iter(trained))], trained[next(iter(trained))])
    finally:
        loop.close()
    # A run that already checkpointed resumes its own weights, not the init ones.
    ctx = Recorder(tmp_path / "rl-own", stop_after=1)
    own = _pipelined_spec(0, steps=2, checkpoint_every=1, init={"from_job": source})
    first = loop_for(ctx, own, "own-1")
    try:
        assert first.run() is False
        mine = weights_of(first)
    finally:
        first.close()
    second = loop_for(Recorder(tmp_path / "rl-own", attempt=2), own, "own-2")
    try:
        assert second.resume() is True
        assert all(torch.equal(weights_of(second)[k], mine[k]) for k in mine)
    finally:
        second.close()
