"""The native training loop behind ``method: rl`` and ``method: sft`` (no Django in here).

`TrainingLoop` owns one policy on one engine and runs the JobSpec's steps:

- RL step: take `prompts_per_step` groups from the data order (`data_order`), play them
  against the current snapshot (`rollouts.play_groups`), turn rewards into advantages and
  datums (`data_processing`), then `forward_backward` + `optim_step` and publish a snapshot.
  With `rollout.max_off_policy_steps` = S > 0 the rollouts of the next S steps are sampled on
  a background thread while a step trains, each from the snapshot published when it was
  requested (at most S steps behind); requests are made on the loop's thread in step order
  and run one after the other, so a pipelined run is as deterministic as a sequential one.
- SFT step: `batch_size` rows rendered exactly as the env shows them, cross entropy on the
  answer tokens.
- Every `eval_every` steps: greedy decoding on the held-out prompts (`evaluation`).

With a `Collective` (a job across several ranks, `distributed`) every rank takes the same
groups or rows from the data order and plays or trains its share of them (group or row i goes
to rank i mod world, seeded by its place in the whole batch), the gradients are summed across
ranks before the optimizer step, and the step's metrics are those of the whole batch. Rank 0
alone evaluates, checkpoints and exports, and decides when the ranks stop; a resumed rank 0
hands its state to the others. One rank is the plain single-process loop.

Everything random is derived from (seed, position) (`data_order`), so a checkpoint needs only
the policy state (weights, AdamW, step, its RNG) plus the step and the data cursor, and a
resumed run replays exactly the steps a killed one would have run.

The loop talks to its job through a `LoopContext`. The context may buffer metrics: the loop
flushes them before each checkpoint and after each evaluation, and a resumed run first
discards the metrics of the steps after its checkpoint, which it is about to redo.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from environments.registry import get_env
from environments.types import DataSource, Trajectory
from jobs.spec import JobSpec
from training import ops
from training.checkpoint import CheckpointDir
from training.engine import Engine
from training.types import AdamParams, Datum
from workers.runners.adapters import load_peft_adapter
from workers.runners.data_order import DataOrder, mix_seed
from workers.runners.data_processing import apply_kl_penalty, mean, rl_batch, sft_datum, std
from workers.runners.distributed import Collective
from workers.runners.engines import policy_from_spec
from workers.runners.evaluation import evaluate_snapshot
from workers.runners.loop_types import (
    ADAPTER_DIR,
    CHECKPOINT_DIR,
    EVAL_DIR,
    MODEL_DIR,
    SUMMARY_FILE,
    LoopContext,
    TrainingError,
)
from workers.runners.pictures import renderer_for
from workers.runners.rollouts import Opponent, RolloutStats, play_groups

__all__ = ["MICRO_BATCH", "TrainingLoop"]

# Rows per forward_backward call: bounds activation memory on big models.
MICRO_BATCH = 64


@dataclass
class _Rollouts:
    """One step's played groups and the snapshot that played them."""

    version: int
    groups: list[list[Trajectory]]
    stats: RolloutStats


@dataclass
class _Request:
    step: int
    version: int
    cursor_before: int
    """The data cursor before this step's groups were taken: where a resume starts."""
    result: Future[_Rollouts] | _Rollouts


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
        collective: Collective | None = None,
        opponent: Opponent | None = None,
        init_weights: Path | None = None,
    ) -> None:
        self.ctx = ctx
        self.init_weights = init_weights
        """What a run that resumes nothing starts from (`spec.init`): a PEFT adapter directory
        or a checkpoint's state file (weights only); None: a fresh adapter."""
        self.opponent = opponent
        """The frozen policy of an env that plays one (`GroupBuilder.opponent_episodes`)."""
        self.collective = collective
        self.rank = collective.rank if collective is not None else 0
        self.world = collective.world if collective is not None else 1
        self.spec = spec
        self.engine = engine
        self.env = get_env(str(spec.env))
        self.is_dataset_env = self.env.data_source is DataSource.DATASET
        if self.is_dataset_env and not rows:
            raise TrainingError(f"env {self.env.name!r} reads a dataset, and it has no rows")
        self.rows = rows or []
        self.eval_rows = eval_rows or []
        self.order = DataOrder(len(self.rows), spec.seed) if self.is_dataset_env else None
        self.renderer = renderer_for(engine)
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
        self.policy = policy_from_spec(engine, spec, policy_id=policy_id)
        self.step = 0
        self.cursor = 0
        self.version: int | None = None
        self.last_eval: dict[str, float] = {}
        # Pipelined rollouts: requested steps in order, the snapshots they sample (kept until
        # their step has trained), the step each snapshot was published after.
        self._requests: deque[_Request] = deque()
        self._pinned: Counter[int] = Counter()
        self._published_at: dict[int, int] = {}
        self._sampler: ThreadPoolExecutor | None = None

    # -- state ------------------------------------------------------------------------------

    def resume(self) -> bool:
        """Load the latest checkpoint of an earlier attempt, if there is one (rank 0), and give
        every other rank rank 0's state."""
        record = self.checkpoints.latest() if self.rank == 0 else None
        if record is not None:
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
        elif self.rank == 0 and self.init_weights is not None:
            self._load_init_weights(self.init_weights)
        if self.collective is None:
            return record is not None
        state = self.collective.broadcast_state(
            {
                "policy": self.policy.state_dict(),
                "loop": {"step": self.step, "cursor": self.cursor, "resumed": record is not None},
            }
            if self.rank == 0
            else None
        )
        if self.rank != 0:
            self.policy.load_state_dict(state["policy"])
            self.step = int(state["loop"]["step"])
            self.cursor = int(state["loop"]["cursor"])
        return bool(state["loop"]["resumed"])

    def _load_init_weights(self, path: Path) -> None:
        if path.is_dir():
            load_peft_adapter(self.policy, path)
        else:
            self.policy.load_weights(path)
        init = self.spec.init
        data = init.model_dump() if init is not None else {"path": str(path)}
        source = f"job {init.from_job}" if init is not None else str(path)
        if init is not None and init.checkpoint:
            source += f" ({init.checkpoint})"
        self.ctx.event(f"starts from the weights of {source}", data)

    def _should_stop(self) -> bool:
        """The context's cancel or lost lease, as rank 0 sees it, on every rank."""
        stop = self.ctx.cancelled() if self.rank == 0 else False
        return self.collective.agree(stop) if self.collective is not None else stop

    def _mine(self, count: int) -> list[int]:
        """The places in a batch of `count` groups or rows that this rank plays or trains."""
        return list(range(self.rank, count, self.world))

    def save_checkpoint(self) -> dict[str, Any]:
        # Groups already taken for steps still in the pipeline are taken again on resume.
        cursor = self._requests[0].cursor_before if self._requests else self.cursor
        return self.checkpoints.save(
            self.policy,
            name=f"step-{self.step:06d}",
            extra={
                "step": self.step,
                "cursor": cursor,
                "attempt": self.ctx.attempt,
                "eval": self.last_eval,
            },
        )

    def publish(self) -> int:
        """A new snapshot of the live weights; the previous one is dropped unless a requested
        step still samples it."""
        previous = self.version
        self.version = self.policy.snapshot()
        self._published_at[self.version] = self.step
        if previous is not None and not self._pinned[previous]:
            self._release(previous)
        return self.version

    def _release(self, version: int) -> None:
        self.policy.release(version)
        self._published_at.pop(version, None)

    def close(self) -> None:
        if self._sampler is not None:
            # A stopped run's prefetched rollouts are not needed: the next attempt redoes them.
            self._sampler.shutdown(wait=True, cancel_futures=True)
            self._sampler = None
        self._requests.clear()
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
                "seed": mix_seed(self.spec.seed, self.cursor + offset),
                "group_size": group_size,
            }
            for offset, row in enumerate(rows)
        ]
        self.cursor += count
        return specs

    # -- steps ------------------------------------------------------------------------------

    def _play(
        self, step: int, group_specs: list[dict[str, Any]], version: int, places: list[int]
    ) -> _Rollouts:
        """Play `group_specs`, the groups at `places` of the step's batch (the seeds of a
        group's rows follow its place, so a group plays the same on any rank)."""
        spec = self.spec
        stats = RolloutStats()
        groups = play_groups(
            self.engine,
            self.renderer,
            group_specs,
            policy=self.policy,
            version=version,
            temperature=spec.rollout.temperature,
            top_p=spec.rollout.top_p,
            max_tokens=spec.rollout.max_tokens,
            max_turns=spec.rollout.max_turns,
            seed_of=lambda g, e, t: mix_seed(spec.seed, step, places[g], e, t),
            stats=stats,
            env_execution=spec.rollout.env_execution,
            opponent=self.opponent,
        )
        return _Rollouts(version, groups, stats)

    def _request(self, step: int, *, background: bool) -> None:
        """Take `step`'s groups and fix the snapshot that plays them, here, in step order."""
        assert self.version is not None
        cursor = self.cursor
        specs = self._take_groups(self.spec.rollout.prompts_per_step, self.spec.rollout.group_size)
        places = self._mine(len(specs))
        specs = [specs[i] for i in places]
        version = self.version
        self._pinned[version] += 1
        result: Future[_Rollouts] | _Rollouts
        if background:
            if self._sampler is None:
                self._sampler = ThreadPoolExecutor(1, thread_name_prefix="rollouts")
            result = self._sampler.submit(self._play, step, specs, version, places)
        else:
            result = self._play(step, specs, version, places)
        self._requests.append(_Request(step, version, cursor, result))

    def _rollouts_for(self, step: int) -> tuple[_Rollouts, float]:
        """`step`'s rollouts and the seconds the trainer waited for them (all of the sampling
        when it runs here); keeps the next `max_off_policy_steps` steps requested."""
        ahead = self.spec.rollout.max_off_policy_steps
        waited = time.perf_counter()
        if not self._requests:
            self._request(step, background=ahead > 0)
        last = self._requests[-1].step
        while last < min(step + ahead, self.spec.steps):
            last += 1
            self._request(last, background=True)
        request = self._requests.popleft()
        assert request.step == step, (request.step, step)
        rollouts = request.result
        if isinstance(rollouts, Future):
            rollouts = rollouts.result()
        waited = time.perf_counter() - waited
        self._pinned[request.version] -= 1
        return rollouts, waited

    def _unpin(self, version: int) -> None:
        # publish() already dropped it when no request held it any more.
        held = version in self._published_at
        if held and not self._pinned[version] and version != self.version:
            self._release(version)

    def rl_step(self) -> dict[str, float]:
        spec = self.spec
        started = time.perf_counter()
        if self.version is None:
            self.publish()
        step = self.step + 1
        rollouts, waited = self._rollouts_for(step)
        groups, stats = rollouts.groups, rollouts.stats
        # Steps between the weights that sampled and the weights that train (0: on-policy).
        behind = self.step - self._published_at[rollouts.version]
        batch = rl_batch(spec, groups, self.engine)
        datums = batch.datums
        kl_base = (
            apply_kl_penalty(self.engine, datums, spec.algorithm.kl_coef)
            if spec.algorithm.kl_coef > 0
            else None
        )

        train_started = time.perf_counter()
        loss_sum, tokens, loss_metrics = 0.0, 0.0, {}
        for start in range(0, len(datums), MICRO_BATCH):
            chunk = datums[start : start + MICRO_BATCH]
            result = ops.forward_backward(
                self.policy,
                chunk,
                spec.algorithm.loss,
                self.loss_config,
                recompute=spec.activation_checkpointing,
            )
            loss_sum += result.metrics.get("loss:sum", 0.0)
            tokens += result.metrics.get("tokens:sum", 0.0)
            loss_metrics = result.metrics
        if self.collective is not None:
            self.collective.all_reduce_grads(self.policy.parameters())
        opt = ops.optim_step(self.policy, self.adam)
        self.step = step
        self.publish()
        self._unpin(rollouts.version)
        train_seconds = time.perf_counter() - train_started

        # The whole batch's figures: every rank's share, in rank order.
        share = {
            "rewards": batch.rewards,
            "correct": batch.correct,
            "logprobs": batch.action_logprobs,
            "errors": batch.errors,
            "datums": len(datums),
            "loss_sum": loss_sum,
            "tokens": tokens,
            "sampled": stats.sampled_tokens,
            "sample_seconds": stats.seconds,
            "kl_sample_train": loss_metrics.get("kl_sample_train_k3:mean"),
            "kl_base": kl_base,
        }
        shares = self.collective.gather(share) if self.collective is not None else [share]
        elapsed = time.perf_counter() - started
        rewards = [r for s in shares for r in s["rewards"]]
        correct = [c for s in shares for c in s["correct"]]
        n_datums = sum(s["datums"] for s in shares)
        loss_sum = sum(s["loss_sum"] for s in shares)
        tokens = sum(s["tokens"] for s in shares)
        sampled = sum(s["sampled"] for s in shares)
        metrics = {
            "reward/mean": mean(rewards),
            "reward/std": std(rewards),
            "episodes": float(len(rewards)),
            "episodes/error_frac": sum(s["errors"] for s in shares) / len(rewards)
            if rewards
            else 0.0,
            "datums": float(n_datums),
            "loss": loss_sum / tokens if tokens else 0.0,
            # -mean log p of the sampled tokens estimates the policy's entropy (exact in
            # expectation at temperature 1).
            "entropy": -mean([lp for s in shares for lp in s["logprobs"]]),
            "grad_norm": opt["grad_norm"],
            "sample/tokens": float(sampled),
            # Ranks sample side by side: the step waited for the slowest.
            "sample/seconds": max(s["sample_seconds"] for s in shares),
            "sample/wait_seconds": waited,
            "rollout/off_policy_steps": float(behind),
            "train/seconds": train_seconds,
            "tokens_per_s": sampled / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed,
        }
        if correct:
            metrics["accuracy"] = mean(correct)
        for key, name in (("kl_sample_train", "kl/sample_train"), ("kl_base", "kl/base")):
            weighted = [(s[key], s["datums"]) for s in shares if s[key] is not None]
            if weighted:
                weight = sum(w for _, w in weighted)
                metrics[name] = (
                    sum(v * w for v, w in weighted) / weight if weight else weighted[0][0]
                )
        if self.collective is not None:
            metrics["dist/ranks"] = float(self.world)
            metrics["dist/comm_seconds"] = self.collective.take_comm_seconds()
        return metrics

    def sft_datum(self, row: dict[str, Any]) -> Datum:
        """The env's own first observation, then the reply the row teaches."""
        return sft_datum(self.renderer, self.env.name, self.spec.env_config, row, self.engine)

    def sft_step(self) -> dict[str, float]:
        assert self.order is not None
        started = time.perf_counter()
        indices = self.order.take(self.cursor, self.spec.batch_size)
        datums = [self.sft_datum(self.rows[indices[i]]) for i in self._mine(len(indices))]
        loss_sum, weight_sum, tokens = 0.0, 0.0, 0.0
        for start in range(0, len(datums), MICRO_BATCH):
            result = ops.forward_backward(
                self.policy,
                datums[start : start + MICRO_BATCH],
                "cross_entropy",
                recompute=self.spec.activation_checkpointing,
            )
            loss_sum += result.metrics["loss:sum"]
            weight_sum += result.metrics["weights:sum"]
            tokens += sum(d.length for d in datums[start : start + MICRO_BATCH])
        metrics: dict[str, float] = {}
        if self.collective is not None:
            self.collective.all_reduce_grads(self.policy.parameters())
            shares = self.collective.gather((loss_sum, weight_sum, tokens))
            loss_sum, weight_sum, tokens = (sum(s[i] for s in shares) for i in range(3))
            metrics["dist/ranks"] = float(self.world)
        opt = ops.optim_step(self.policy, self.adam)
        self.cursor += len(indices)
        self.step += 1
        elapsed = time.perf_counter() - started
        if self.collective is not None:
            metrics["dist/comm_seconds"] = self.collective.take_comm_seconds()
        return {
            "loss": loss_sum / weight_sum if weight_sum else 0.0,
            "grad_norm": opt["grad_norm"],
            "examples": float(len(indices)),
            "epoch": self.cursor / len(self.rows),
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed,
            **metrics,
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
            opponent=self.opponent,
        )
        self.last_eval = {k: v for k, v in metrics.items() if k != "eval/seconds"}
        return metrics

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> bool:
        """Train to `spec.steps`. Returns False when stopped early (cancel or lost lease)."""
        spec = self.spec
        ctx = self.ctx
        lead = self.rank == 0
        resumed = self.resume()
        if not resumed:
            ctx.event(
                f"{spec.method} on {self.env.name}: {spec.steps} steps, "
                f"{'full fine-tuning' if spec.full_finetune else f'LoRA r={spec.lora.rank}'}"
                + (f", {self.world} ranks" if self.world > 1 else ""),
                {"steps": spec.steps, "ranks": self.world},
            )
            if spec.eval_every and not self._should_stop() and lead:
                ctx.log_metrics(0, self.evaluate())
                ctx.flush_metrics()
        while self.step < spec.steps:
            if self._should_stop():
                return False
            metrics = self.rl_step() if spec.method == "rl" else self.sft_step()
            if self._should_stop():
                # The step's results are dropped: the next attempt (if any) redoes it.
                return False
            step = self.step
            evaluated = bool(spec.eval_every) and (
                step % spec.eval_every == 0 or step == spec.steps
            )
            if evaluated and lead:
                metrics.update(self.evaluate())
            ctx.log_metrics(step, metrics)
            checkpoint = step == spec.steps or bool(
                spec.checkpoint_every and step % spec.checkpoint_every == 0
            )
            if evaluated or checkpoint:
                # Before the checkpoint: a step it covers is never redone, so its metrics
                # must already be stored when the checkpoint appears.
                ctx.flush_metrics()
            if checkpoint and lead:
                self.save_checkpoint()
            ctx.heartbeat(step)
        if self._should_stop():
            return False
        if lead:
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
