"""The native training loop behind ``method: rl`` and ``method: sft`` (no Django in here).

`TrainingLoop` owns one policy on one engine and runs the JobSpec's steps:

- RL step: take `prompts_per_step` groups from the data order, play them against the current
  snapshot (all live episodes of all groups sampled together, one batch per turn; the envs step
  in this process or, with ``rollout.env_execution: queue``, on env workers), turn rewards
  into advantages (training.rl), then `forward_backward` + `optim_step` and publish a new
  snapshot.
- SFT step: `batch_size` rows rendered exactly as the env shows them, cross entropy on the
  answer tokens.

Everything random is derived from (seed, position): row order from (seed, epoch), generator
env seeds from the example's position, sampling seeds from (seed, step, row, turn). A
checkpoint therefore needs only the policy state (weights, AdamW, step, its RNG) plus the step
and the data cursor, and a resumed run replays exactly the steps a killed one would have run.

The loop talks to its job through a `LoopContext` (``workers.runners.base.JobContext`` in the
service; anything with the same methods in a notebook or a benchmark). The context may buffer
metrics: the loop flushes them before each checkpoint and after each evaluation, and a resumed
run first discards the metrics of the steps after its checkpoint, which it is about to redo.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from environments.registry import build_group, get_env
from environments.renderer import Renderer
from environments.rollouts import (
    EpisodeRecorder,
    PolicyInput,
    PolicyOutput,
    apply_group_rewards,
    run_episode,
)
from environments.types import DataSource, GroupBuilder, StepResult, Trajectory
from jobs.spec import JobSpec
from training import ops, rl
from training.checkpoint import CheckpointDir
from training.engine import Engine
from training.policy import Policy
from training.sampler import SampleRequest, sample, sequence_logprobs
from training.types import AdamParams, Datum, SamplingParams

CHECKPOINT_DIR = "checkpoints"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"
EVAL_DIR = "eval"
SUMMARY_FILE = "summary.json"
# Rows per forward_backward call: bounds activation memory on big models.
MICRO_BATCH = 64
# Generator envs: evaluation seeds live far away from every training seed.
EVAL_SEED_OFFSET = 1_000_000_007
_SEED_MOD = 2**61 - 1


class LoopContext(Protocol):
    workdir: Path
    attempt: int

    def cancelled(self) -> bool: ...

    def heartbeat(self, step: int | None = None, *, force: bool = False) -> None: ...

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def flush_metrics(self) -> None: ...

    def discard_metrics_after(self, step: int) -> None: ...

    def event(self, message: str, data: Mapping[str, Any] | None = None) -> None: ...


class TrainingError(RuntimeError):
    """A job that cannot run as specified (bad data, context too small, ...)."""


@dataclass
class DataOrder:
    """Example i of the run is row ``perm(epoch)[i % n]`` with ``epoch = i // n``.

    Each epoch's permutation comes from (seed, epoch) alone, so a cursor is a complete
    description of the position in the data.
    """

    size: int
    seed: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise TrainingError("the dataset has no rows to train on")
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # one epoch at a time is all a run touches
        return perm

    def take(self, cursor: int, count: int) -> list[int]:
        return [self._perm(i // self.size)[i % self.size] for i in range(cursor, cursor + count)]


def split_holdout(
    rows: list[dict[str, Any]], n_eval: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) for a dataset without a test split: a seeded fifth at most is held out."""
    k = min(n_eval, len(rows) // 5)
    if k < 1:
        return rows, []
    order = list(range(len(rows)))
    random.Random(seed + 7919).shuffle(order)
    held = set(order[:k])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in order[:k]]


def _mix(*parts: int) -> int:
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part) + 1) % _SEED_MOD
    return value


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _std(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


@dataclass
class RolloutStats:
    sampled_tokens: int = 0
    seconds: float = 0.0


class _InlineGroups:
    """Groups whose episodes live in this process: `environments.remote.RemoteGroups`'s
    interface, with the exceptions worded as `rollouts.run_episode` words them."""

    def __init__(self, builders: Sequence[GroupBuilder]) -> None:
        self.episodes = [builder.make_episodes() for builder in builders]

    def start(self) -> list[list[tuple[list[Any], Any] | str]]:
        out: list[list[tuple[list[Any], Any] | str]] = []
        for episodes in self.episodes:
            row: list[tuple[list[Any], Any] | str] = []
            for episode in episodes:
                try:
                    row.append(episode.initial_observation())
                except Exception as exc:  # noqa: BLE001 - an env crash is a value
                    row.append(f"{type(exc).__name__}: {exc}")
            out.append(row)
        return out

    def step(self, actions: Sequence[Sequence[str | None]]) -> list[list[StepResult | str | None]]:
        out: list[list[StepResult | str | None]] = []
        for episodes, group_actions in zip(self.episodes, actions, strict=True):
            row: list[StepResult | str | None] = []
            for episode, action in zip(episodes, group_actions, strict=True):
                if action is None:
                    row.append(None)
                    continue
                try:
                    row.append(episode.step(action))
                except Exception as exc:  # noqa: BLE001
                    row.append(f"{type(exc).__name__}: {exc}")
            out.append(row)
        return out

    def close(self) -> None:
        for episodes in self.episodes:
            for episode in episodes:
                episode.close()


def play_groups(
    engine: Engine,
    renderer: Renderer,
    group_specs: Sequence[dict[str, Any]],
    *,
    policy: Policy | None,
    version: int | None,
    temperature: float,
    top_p: float,
    max_tokens: int,
    max_turns: int,
    seed_of: Any,
    stats: RolloutStats | None = None,
    env_execution: str = "inline",
) -> list[list[Trajectory]]:
    """Play every group to the end with one sampler batch per turn across all live episodes.

    The episodes are driven by `EpisodeRecorder`, the recorder of `rollouts.run_episode`, so
    token layout and masks are those of the inline rollouts. The environments step in this
    process (`env_execution` "inline") or on env workers ("queue": one task per group and
    turn, `environments.remote.RemoteGroups`); the requests to the sampler, and so the
    trajectories, are the same either way. Builders whose episodes must run concurrently
    (self-play) run inline, one thread per episode with a one-row policy function.
    `seed_of(group, episode, turn)` gives each row's sampling seed.
    """
    started = time.perf_counter()
    policy_id = policy.id if policy is not None else None
    max_positions = int(getattr(engine.model.config, "max_position_embeddings", 0) or 0)
    counter = stats or RolloutStats()

    def params_for(inp: PolicyInput, seed: int) -> SamplingParams | None:
        limit = min(max_tokens, inp.stop.max_tokens)
        if max_positions:
            limit = min(limit, max_positions - len(inp.tokens))
        if limit < 1:
            return None
        return SamplingParams(
            max_tokens=limit,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=inp.stop.stop,
            stop_token_ids=inp.stop.stop_token_ids,
        )

    def one_row(inp: PolicyInput, g: int, e: int, turn: int) -> PolicyOutput:
        params = params_for(inp, seed_of(g, e, turn))
        if params is None:
            raise TrainingError("the conversation filled the model's context")
        seq = sample(engine, [SampleRequest(inp.tokens, params, 1, policy_id, version)])[0][0]
        counter.sampled_tokens += len(seq.tokens)
        return PolicyOutput(tokens=seq.tokens, logprobs=seq.logprobs)

    if env_execution not in ("inline", "queue"):
        raise ValueError(f"env_execution must be 'inline' or 'queue', not {env_execution!r}")
    builders = [build_group(dict(spec)) for spec in group_specs]
    results: list[list[Trajectory] | None] = [None] * len(builders)
    lockstep: list[int] = []  # the groups played one sampler batch per turn
    for g, builder in enumerate(builders):
        if not getattr(builder, "concurrent", False):
            lockstep.append(g)
        elif env_execution == "queue":
            raise TrainingError(
                f"env {builder.env_name!r} plays a group's episodes against each other: "
                "it runs inline only"
            )
        else:
            results[g] = _play_concurrent(
                builder, renderer, max_turns, lambda inp, e, t, g=g: one_row(inp, g, e, t)
            )

    envs: Any
    if env_execution == "queue":
        from environments.remote import RemoteGroups

        envs = RemoteGroups([group_specs[g] for g in lockstep])
    else:
        envs = _InlineGroups([builders[g] for g in lockstep])
    recorders: list[list[EpisodeRecorder]] = []  # [position in lockstep][episode]
    try:
        for g, observations in zip(lockstep, envs.start(), strict=True):
            row = []
            for obs in observations:
                rec = EpisodeRecorder(renderer, builders[g].env_name)
                if isinstance(obs, str):
                    rec.fail(f"initial_observation failed: {obs}")
                else:
                    rec.begin(*obs)
                row.append(rec)
            recorders.append(row)
        for turn in range(max_turns):
            requests, rows = [], []
            for k, row in enumerate(recorders):
                for e, rec in enumerate(row):
                    if rec.done:
                        continue
                    inp = rec.policy_input()
                    params = params_for(inp, seed_of(lockstep[k], e, turn))
                    if params is None:
                        rec.fail("the conversation filled the model's context")
                        continue
                    requests.append(SampleRequest(inp.tokens, params, 1, policy_id, version))
                    rows.append((k, e, rec))
            if not requests:
                break
            outputs = sample(engine, requests)
            actions: list[list[str | None]] = [[None] * len(row) for row in recorders]
            for (k, e, rec), out in zip(rows, outputs, strict=True):
                seq = out[0]
                counter.sampled_tokens += len(seq.tokens)
                actions[k][e] = rec.take_action(
                    PolicyOutput(tokens=seq.tokens, logprobs=seq.logprobs)
                )
            stepped = envs.step(actions)
            for k, e, rec in rows:
                result = stepped[k][e]
                if result is None:
                    rec.fail("the env worker skipped a live episode")
                elif isinstance(result, str):
                    rec.fail(f"step failed: {result}", turn_error="env_exception")
                else:
                    rec.record(result)
        for row in recorders:
            for rec in row:
                if not rec.done:
                    rec.fail(f"max_turns ({max_turns}) reached before the episode ended")
    finally:
        envs.close()

    for g, row in zip(lockstep, recorders, strict=True):
        results[g] = apply_group_rewards(builders[g], [rec.trajectory for rec in row])
    counter.seconds += time.perf_counter() - started
    return [r for r in results if r is not None]


def _play_concurrent(
    builder: GroupBuilder, renderer: Renderer, max_turns: int, row_fn: Any
) -> list[Trajectory]:
    """Episodes that wait for each other (self-play): one thread each, as `rollouts.run_group`
    does, but each with its own policy function so that its sampling seeds are its own."""
    episodes = builder.make_episodes()
    out: list[Trajectory | None] = [None] * len(episodes)

    def play(e: int) -> None:
        turns = iter(range(max_turns + 1))

        def policy_fn(inp: PolicyInput) -> PolicyOutput:
            return row_fn(inp, e, next(turns))

        out[e] = run_episode(
            policy_fn, episodes[e], renderer, env_name=builder.env_name, max_turns=max_turns
        )

    threads = [threading.Thread(target=play, args=(e,), daemon=True) for e in range(len(episodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trajectories = [
        t
        if t is not None
        else Trajectory(turns=[], env_name=builder.env_name, error="episode thread died")
        for t in out
    ]
    return apply_group_rewards(builder, trajectories)


def _correct(traj: Trajectory) -> float | None:
    """The env's own correctness flag of the final turn, where it has one (math envs)."""
    if traj.turns and "correct" in traj.turns[-1].metrics:
        return float(traj.turns[-1].metrics["correct"])
    return None


def _advantages(spec: JobSpec, trajectories: list[Trajectory]) -> list[float | list[float]]:
    algo = spec.algorithm
    if algo.advantage == "grpo_per_step":
        return list(
            rl.grpo_per_step(
                [t.rewards_per_turn for t in trajectories], normalize_std=algo.normalize_std
            )
        )
    rewards = [t.total_reward for t in trajectories]
    if algo.advantage == "grpo":
        adv = rl.grpo(rewards, normalize_std=algo.normalize_std)
    elif algo.advantage == "rloo":
        if len(rewards) < 2:
            return [0.0] * len(rewards)
        adv = rl.rloo(rewards)
    else:
        adv = rl.baseline(rewards, algo.baseline)
    return [float(a) for a in adv.tolist()]


def evaluate_snapshot(
    engine: Engine,
    renderer: Renderer,
    spec: JobSpec,
    eval_rows: list[dict[str, Any]] | None,
    *,
    policy: Policy | None,
    version: int | None,
    out_path: Path,
) -> dict[str, float]:
    """Play the held-out prompts greedily with one snapshot (None: the base model).

    The same builders, renderer and env code as training; `spec.eval_examples` prompts: the
    first rows of `eval_rows` for a dataset env, seeds from EVAL_SEED_OFFSET for a generator.
    Writes one JSON line per episode (the transcript) to `out_path` and returns the metrics.
    """
    env = get_env(str(spec.env))
    n = spec.eval_examples
    rows: list[dict[str, Any] | None]
    if env.data_source is DataSource.DATASET:
        rows = list((eval_rows or [])[:n])
        if not rows:
            raise TrainingError(f"env {env.name!r} reads a dataset, and no evaluation rows exist")
    else:
        rows = [None] * n
    group_specs = [
        {
            "env": env.name,
            "config": dict(spec.env_config),
            "row": row,
            "seed": EVAL_SEED_OFFSET + i,
            "group_size": 2 if env.name == "gomoku_selfplay" else 1,
        }
        for i, row in enumerate(rows)
    ]
    started = time.perf_counter()
    groups = play_groups(
        engine,
        renderer,
        group_specs,
        policy=policy,
        version=version,
        temperature=0.0,
        top_p=1.0,
        max_tokens=spec.rollout.max_tokens,
        max_turns=spec.rollout.max_turns,
        seed_of=lambda g, e, t: 0,
        env_execution=spec.rollout.env_execution,
    )
    trajectories = [t for group in groups for t in group]
    rewards = [t.total_reward for t in trajectories]
    correct = [c for c in (_correct(t) for t in trajectories) if c is not None]
    metrics = {
        "eval/reward": _mean(rewards),
        "eval/episodes": float(len(trajectories)),
        "eval/seconds": time.perf_counter() - started,
    }
    if correct:
        metrics["eval/accuracy"] = _mean(correct)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for traj in trajectories:
            last = traj.turns[-1] if traj.turns else None
            fh.write(
                json.dumps(
                    {
                        "reward": traj.total_reward,
                        "error": traj.error,
                        "turns": [
                            {
                                "observation": t.observation_messages,
                                "action": t.action_text,
                                "reward": t.reward,
                                "metrics": t.metrics,
                            }
                            for t in traj.turns
                        ],
                        "info": last.info if last else {},
                    },
                    default=str,
                )
                + "\n"
            )
    os.replace(tmp, out_path)
    return metrics


def run_eval(
    ctx: LoopContext,
    spec: JobSpec,
    engine: Engine,
    *,
    eval_rows: list[dict[str, Any]] | None,
    policy: Policy | None,
    source: Mapping[str, Any],
) -> dict[str, float] | None:
    """An eval job: evaluate `policy` (None: the base model) once, training switched off.

    Logs the metrics at step 0 and leaves ``eval/transcripts.jsonl`` and ``summary.json`` in
    the workdir. Returns None when cancelled before it finished.
    """
    workdir = Path(ctx.workdir)
    ctx.event(f"eval on {spec.env}: {spec.eval_examples} prompts", dict(source))
    if ctx.cancelled():
        return None
    version = policy.snapshot() if policy is not None else None
    metrics = evaluate_snapshot(
        engine,
        Renderer(engine.tokenizer),
        spec,
        eval_rows,
        policy=policy,
        version=version,
        out_path=workdir / EVAL_DIR / "transcripts.jsonl",
    )
    if ctx.cancelled():
        return None
    ctx.log_metrics(0, metrics)
    ctx.flush_metrics()
    summary = {
        "kind": "eval",
        "env": spec.env,
        "source": dict(source),
        "eval": {k: v for k, v in metrics.items() if k != "eval/seconds"},
    }
    (workdir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    ctx.heartbeat(0, force=True)
    return metrics


class TrainingLoop:
    """One job's training run on an engine: create or resume the policy, step, evaluate, export."""

    def __init__(
        self,
        ctx: LoopContext,
        spec: JobSpec,
        engine: Engine,
        *,
        rows: list[dict[str, Any]] | None,
        eval_rows: list[dict[str, Any]] | None,
        policy_id: str,
    ) -> None:
        self.ctx = ctx
        self.spec = spec
        self.engine = engine
        self.env = get_env(str(spec.env))
        self.is_dataset_env = self.env.data_source is DataSource.DATASET
        if self.is_dataset_env and not rows:
            raise TrainingError(f"env {self.env.name!r} reads a dataset, and it has no rows")
        self.rows = rows or []
        self.eval_rows = eval_rows or []
        self.order = DataOrder(len(self.rows), spec.seed) if self.is_dataset_env else None
        self.renderer = Renderer(engine.tokenizer)
        self.workdir = Path(ctx.workdir)
        self.checkpoints = CheckpointDir(self.workdir / CHECKPOINT_DIR)
        self.adam = AdamParams(
            learning_rate=spec.optimizer.lr,
            beta1=spec.optimizer.betas[0],
            beta2=spec.optimizer.betas[1],
            weight_decay=spec.optimizer.weight_decay,
            grad_clip_norm=spec.optimizer.grad_clip,
        )
        self.loss_config: dict[str, float] = {}
        if spec.algorithm.loss in ("ppo", "cispo"):
            self.loss_config = {
                "clip_low_threshold": spec.algorithm.clip_low,
                "clip_high_threshold": spec.algorithm.clip_high,
            }
        elif spec.algorithm.loss == "dro":
            self.loss_config = {"beta": spec.algorithm.dro_beta}
        self.policy = engine.create_policy(
            rank=spec.lora.rank,
            alpha=spec.lora.alpha,
            target_modules=spec.lora.target_modules,
            seed=spec.seed,
            full_finetune=spec.full_finetune,
            policy_id=policy_id,
        )
        self.step = 0
        self.cursor = 0
        self.version: int | None = None
        self.last_eval: dict[str, float] = {}

    # -- state ------------------------------------------------------------------------------

    def resume(self) -> bool:
        """Load the latest checkpoint of an earlier attempt, if there is one."""
        record = self.checkpoints.latest()
        if record is None:
            return False
        self.policy.load_state(record["path"])
        extra = record.get("extra") or {}
        self.step = int(extra.get("step", record["step"]))
        self.cursor = int(extra.get("cursor", 0))
        self.last_eval = dict(extra.get("eval", {}))
        # Steps after the checkpoint run again: what the lost attempt logged for them goes.
        self.ctx.discard_metrics_after(self.step)
        self.ctx.event(
            f"resumed from checkpoint {record['name']} (step {self.step})",
            {"checkpoint": record["name"], "step": self.step, "cursor": self.cursor},
        )
        return True

    def save_checkpoint(self) -> dict[str, Any]:
        return self.checkpoints.save(
            self.policy,
            name=f"step-{self.step:06d}",
            extra={
                "step": self.step,
                "cursor": self.cursor,
                "attempt": self.ctx.attempt,
                "eval": self.last_eval,
            },
        )

    def publish(self) -> int:
        """A new snapshot of the live weights; the previous one is dropped (nobody samples it)."""
        previous = self.version
        self.version = self.policy.snapshot()
        if previous is not None:
            self.policy.release(previous)
        return self.version

    def close(self) -> None:
        if self.policy.id in self.engine.policies:
            self.engine.remove_policy(self.policy.id)

    # -- data -------------------------------------------------------------------------------

    def _take_groups(self, count: int, group_size: int) -> list[dict[str, Any]]:
        """The JSON specs of the next `count` groups in the data order (registry.build_group)."""
        if self.order is not None:
            rows: list[dict[str, Any] | None] = [
                self.rows[index] for index in self.order.take(self.cursor, count)
            ]
        else:
            rows = [None] * count
        specs = [
            {
                "env": self.env.name,
                "config": dict(self.spec.env_config),
                "row": row,
                "seed": _mix(self.spec.seed, self.cursor + offset),
                "group_size": group_size,
            }
            for offset, row in enumerate(rows)
        ]
        self.cursor += count
        return specs

    # -- steps ------------------------------------------------------------------------------

    def rl_step(self) -> dict[str, float]:
        spec = self.spec
        started = time.perf_counter()
        if self.version is None:
            self.publish()
        step = self.step + 1
        group_specs = self._take_groups(spec.rollout.prompts_per_step, spec.rollout.group_size)
        stats = RolloutStats()
        groups = play_groups(
            self.engine,
            self.renderer,
            group_specs,
            policy=self.policy,
            version=self.version,
            temperature=spec.rollout.temperature,
            top_p=spec.rollout.top_p,
            max_tokens=spec.rollout.max_tokens,
            max_turns=spec.rollout.max_turns,
            seed_of=lambda g, e, t: _mix(spec.seed, step, g, e, t),
            stats=stats,
            env_execution=spec.rollout.env_execution,
        )
        rewards: list[float] = []
        correct: list[float] = []
        errors = 0
        action_logprobs: list[float] = []
        datums: list[Datum] = []
        for trajectories in groups:
            usable = [t for t in trajectories if t.turns]
            errors += sum(1 for t in trajectories if t.error)
            for t in trajectories:
                rewards.append(t.total_reward)
                flag = _correct(t)
                if flag is not None:
                    correct.append(flag)
                for turn in t.turns:
                    action_logprobs.extend(turn.action_logprobs)
            if not usable:
                continue
            for traj, adv in zip(usable, _advantages(spec, usable), strict=True):
                values = adv if isinstance(adv, list) else [adv]
                # A zero advantage everywhere carries no gradient: skip the compute.
                if all(v == 0.0 for v in values):
                    continue
                datums.append(rl.trajectory_to_datum(traj.to_engine(), adv))
        kl_base = self._apply_kl_penalty(datums) if spec.algorithm.kl_coef > 0 else None

        train_started = time.perf_counter()
        loss_sum, tokens, loss_metrics = 0.0, 0.0, {}
        for start in range(0, len(datums), MICRO_BATCH):
            chunk = datums[start : start + MICRO_BATCH]
            result = ops.forward_backward(self.policy, chunk, spec.algorithm.loss, self.loss_config)
            loss_sum += result.metrics.get("loss:sum", 0.0)
            tokens += result.metrics.get("tokens:sum", 0.0)
            loss_metrics = result.metrics
        opt = ops.optim_step(self.policy, self.adam)
        self.publish()
        self.step = step
        train_seconds = time.perf_counter() - train_started
        elapsed = time.perf_counter() - started

        metrics = {
            "reward/mean": _mean(rewards),
            "reward/std": _std(rewards),
            "episodes": float(len(rewards)),
            "episodes/error_frac": errors / len(rewards) if rewards else 0.0,
            "datums": float(len(datums)),
            "loss": loss_sum / tokens if tokens else 0.0,
            # -mean log p of the sampled tokens estimates the policy's entropy (exact in
            # expectation at temperature 1).
            "entropy": -_mean(action_logprobs),
            "grad_norm": opt["grad_norm"],
            "sample/tokens": float(stats.sampled_tokens),
            "sample/seconds": stats.seconds,
            "train/seconds": train_seconds,
            "tokens_per_s": stats.sampled_tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed,
        }
        if correct:
            metrics["accuracy"] = _mean(correct)
        if "kl_sample_train_k3:mean" in loss_metrics:
            metrics["kl/sample_train"] = loss_metrics["kl_sample_train_k3:mean"]
        if kl_base is not None:
            metrics["kl/base"] = kl_base
        return metrics

    def _apply_kl_penalty(self, datums: list[Datum]) -> float:
        """Fold -kl_coef * (log pi_sampler - log pi_base) into each action token's advantage.

        Returns the mean per-token KL estimate (k1) over action tokens.
        """
        if not datums:
            return 0.0
        sequences = [
            [*d.model_input.tolist(), int(d.loss_fn_inputs["target_tokens"][-1])] for d in datums
        ]
        base = sequence_logprobs(
            self.engine.model, sequences, adapters=[None] * len(sequences), host=self.engine.host
        )
        total, count = 0.0, 0.0
        for datum, base_lp in zip(datums, base, strict=True):
            mask = datum.loss_fn_inputs["mask"]
            kl = (datum.loss_fn_inputs["logprobs"] - torch.tensor(base_lp[1:])) * mask
            datum.loss_fn_inputs["advantages"] = (
                datum.loss_fn_inputs["advantages"] - self.spec.algorithm.kl_coef * kl
            )
            total += float(kl.sum())
            count += float(mask.sum())
        return total / count if count else 0.0

    def sft_datum(self, row: dict[str, Any]) -> Datum:
        """The env's own first observation, then the answer as the env grades it, boxed."""
        builder = build_group(
            {
                "env": self.env.name,
                "config": dict(self.spec.env_config),
                "row": row,
                "seed": 0,
                "group_size": 1,
            }
        )
        episode = builder.make_episodes()[0]
        try:
            messages, _ = episode.initial_observation()
        finally:
            episode.close()
        prompt = self.renderer.prompt_tokens(messages)
        answer = self.renderer.encode(
            f"\\boxed{{{row['answer']}}}" + self.renderer.turn_end_text.strip()
        )
        tokens = prompt + answer
        # weights[j] belongs to target token j + 1: only answer tokens carry loss.
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        return Datum.from_sequence(tokens, weights)

    def sft_step(self) -> dict[str, float]:
        assert self.order is not None
        started = time.perf_counter()
        indices = self.order.take(self.cursor, self.spec.batch_size)
        datums = [self.sft_datum(self.rows[i]) for i in indices]
        loss_sum, weight_sum, tokens = 0.0, 0.0, 0.0
        for start in range(0, len(datums), MICRO_BATCH):
            result = ops.forward_backward(
                self.policy, datums[start : start + MICRO_BATCH], "cross_entropy"
            )
            loss_sum += result.metrics["loss:sum"]
            weight_sum += result.metrics["weights:sum"]
            tokens += sum(d.length for d in datums[start : start + MICRO_BATCH])
        opt = ops.optim_step(self.policy, self.adam)
        self.cursor += len(indices)
        self.step += 1
        elapsed = time.perf_counter() - started
        return {
            "loss": loss_sum / weight_sum if weight_sum else 0.0,
            "grad_norm": opt["grad_norm"],
            "examples": float(len(datums)),
            "epoch": self.cursor / len(self.rows),
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed,
        }

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Greedy decoding on the held-out prompts (test split or fresh generator seeds)."""
        if self.is_dataset_env and not self.eval_rows:
            return {}
        # RL steps publish a snapshot of the weights they end with; SFT steps do not.
        fresh = self.version is None or self.spec.method == "sft"
        version = self.publish() if fresh else self.version
        assert version is not None
        metrics = evaluate_snapshot(
            self.engine,
            self.renderer,
            self.spec,
            self.eval_rows,
            policy=self.policy,
            version=version,
            out_path=self.workdir / EVAL_DIR / f"step-{self.step:06d}.jsonl",
        )
        self.last_eval = {k: v for k, v in metrics.items() if k != "eval/seconds"}
        return metrics

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> bool:
        """Train to `spec.steps`. Returns False when stopped early (cancel or lost lease)."""
        spec = self.spec
        ctx = self.ctx
        resumed = self.resume()
        if not resumed:
            ctx.event(
                f"{spec.method} on {self.env.name}: {spec.steps} steps, "
                f"{'full fine-tuning' if spec.full_finetune else f'LoRA r={spec.lora.rank}'}",
                {"steps": spec.steps},
            )
            if spec.eval_every and not ctx.cancelled():
                ctx.log_metrics(0, self.evaluate())
                ctx.flush_metrics()
        while self.step < spec.steps:
            if ctx.cancelled():
                return False
            metrics = self.rl_step() if spec.method == "rl" else self.sft_step()
            if ctx.cancelled():
                # The step's results are dropped: the next attempt (if any) redoes it.
                return False
            step = self.step
            evaluated = bool(spec.eval_every) and (
                step % spec.eval_every == 0 or step == spec.steps
            )
            if evaluated:
                metrics.update(self.evaluate())
            ctx.log_metrics(step, metrics)
            checkpoint = step == spec.steps or bool(
                spec.checkpoint_every and step % spec.checkpoint_every == 0
            )
            if evaluated or checkpoint:
                # Before the checkpoint: a step it covers is never redone, so its metrics
                # must already be stored when the checkpoint appears.
                ctx.flush_metrics()
            if checkpoint:
                self.save_checkpoint()
            ctx.heartbeat(step)
        if ctx.cancelled():
            return False
        self.export()
        ctx.heartbeat(self.step, force=True)
        return True

    def export(self) -> Path:
        """Write the final weights (PEFT adapter, or a HF model for full fine-tuning)."""
        version = self.publish()
        final = self.workdir / (MODEL_DIR if self.spec.full_finetune else ADAPTER_DIR)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if self.spec.full_finetune:
            self.policy.export_full(version, tmp)
            self.engine.tokenizer.save_pretrained(str(tmp))
        else:
            self.policy.export_peft(version, tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        summary = {
            "step": self.step,
            "method": self.spec.method,
            "env": self.env.name,
            "eval": self.last_eval,
            "export": final.name,
        }
        (self.workdir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
        self.ctx.event(f"exported the final weights to {final.name}/", summary)
        return final
