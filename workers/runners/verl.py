"""The verl runner: ``runner: verl`` jobs train with verl's PPO trainer on the job's GPU block.

The JobSpec becomes Hydra overrides of verl's ``ppo_trainer`` config (``build_overrides``),
the environment's prompts become parquet files in verl's schema (``write_datasets``), and
verl's trainer runs as a subprocess in its own process group (``supervise``): its console
metric lines (``step:N - key:value - ...``) become job metrics, the ``global_step_N``
checkpoints it saves become job events and lines of ``checkpoints/checkpoints.jsonl``, and a
cancel or a lost lease ends the whole process tree (SIGTERM, then SIGKILL to the group).

Rewards: single-turn envs are scored by ``workers.runners.verl_reward.compute_score`` (the
env's own step, so grading matches the native runner); multi-turn envs run through the
``opentinker_env`` agent loop (``workers.runners.verl_agent_loop``), which steps our episodes
against verl's vLLM server and returns the episode reward.

verl is an optional extra (``pip install .[verl]``); this module imports it nowhere. The entry
command is ``python -m verl.trainer.main_ppo`` with the worker's interpreter, or the
``OPENTINKER_VERL_COMMAND`` environment variable (a shell-style command line): tests point it
at a stand-in script, a GPU worker can point it at a separate verl virtualenv.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.spec import JobSpec, parse_spec
from workers.processes import group_alive, stop_process_group
from workers.runners.base import JobContext

ENTRY_ENV = "OPENTINKER_VERL_COMMAND"
REPO_ROOT = Path(__file__).resolve().parents[2]
REWARD_FILE = Path(__file__).resolve().with_name("verl_reward.py")
CHECKPOINT_INDEX = "checkpoints.jsonl"

# Our estimator -> verl's algorithm.adv_estimator. verl's GRPO is outcome-only: for
# grpo_per_step the agent loop reports the episode's summed reward (per-turn rewards travel in
# extra_fields["turn_scores"] but do not shape the advantage).
ADVANTAGE = {"grpo": "grpo", "rloo": "rloo", "grpo_per_step": "grpo"}
# Our loss -> verl's actor.policy_loss.loss_mode. importance_sampling is verl's vanilla loss
# run strictly on-policy (one PPO epoch over one mini-batch), where the clip never binds.
LOSS_MODE = {"importance_sampling": "vanilla", "ppo": "vanilla", "cispo": "cispo", "dro": "dro"}
# Multi-turn response budget: observations between actions (tool output, a board) are
# counted in verl's fixed response width along with the actions.
OBSERVATION_TOKENS_PER_TURN = 128
# Generator environments have no dataset: this many episodes (distinct seeds) make an epoch.
MAX_GENERATED_ROWS = 100_000
EVAL_SEED_OFFSET = 1_000_003
TERM_GRACE_S = 10.0

_METRIC_LINE = re.compile(r"(?:^|[\s)])step:(\d+) - (.*)$")
# verl prints values with pprint: numpy scalars show as "np.float64(0.5)".
_WRAPPED = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_SIMPLE_VALUE = re.compile(r"^[A-Za-z0-9_./+\-]+$")
# verl metric -> the name the native runner logs, so both runners chart the same series.
ALIASES = {
    "critic/score/mean": "reward/mean",
    "actor/pg_loss": "loss",
    "actor/kl_loss": "kl",
    "actor/entropy": "entropy",
    "perf/throughput": "tokens_per_s",
    "timing_s/step": "step_time_s",
}


# --- data -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataFiles:
    train: Path
    val: Path
    train_rows: int
    val_rows: int
    max_prompt_tokens: int | None
    """Longest rendered prompt in tokens, when a tokenizer was given."""


def _is_multi_turn(env_name: str) -> bool:
    from environments.registry import get_env
    from environments.types import Interaction

    return get_env(env_name).interaction is Interaction.MULTI_TURN


def _records(spec: JobSpec, group_specs: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    from environments.registry import build_group

    multi = _is_multi_turn(str(spec.env))
    out = []
    for i, gs in enumerate(group_specs):
        (episode,) = build_group(gs).make_episodes()
        try:
            messages, _stop = episode.initial_observation()
        finally:
            episode.close()
        row = gs.get("row") or {}
        record: dict[str, Any] = {
            "data_source": spec.env,
            "prompt": [{"role": m["role"], "content": m["content"]} for m in messages],
            "ability": spec.env,
            "reward_model": {"style": "rule", "ground_truth": str(row.get("answer", ""))},
            "extra_info": {
                "index": i,
                "split": split,
                "group_spec": json.dumps(gs, sort_keys=True),
                "max_tokens": spec.rollout.max_tokens,
            },
        }
        if multi:
            from workers.runners.verl_agent_loop import AGENT_NAME

            record["agent_name"] = AGENT_NAME
        out.append(record)
    return out


def _group_specs(
    spec: JobSpec, rows: list[dict[str, Any]] | None, n: int, seed: int
) -> list[dict[str, Any]]:
    from environments.registry import group_specs

    return group_specs(
        str(spec.env), config=spec.env_config, rows=rows, n_groups=n, group_size=1, seed=seed
    )


def write_datasets(
    spec: JobSpec,
    out_dir: Path,
    *,
    rows: list[dict[str, Any]] | None,
    eval_rows: list[dict[str, Any]] | None,
    tokenizer: Any = None,
) -> DataFiles:
    """Write ``train.parquet`` and ``val.parquet`` in verl's RLHF schema.

    Dataset envs: every training row once per epoch (verl shuffles), evaluation rows (or,
    without any, the first ``eval_examples`` training rows) for validation. Generator envs:
    one episode seed per row, validation seeds disjoint from training seeds.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if rows is not None:
        if not rows:
            raise ValueError(f"the dataset of env {spec.env!r} has no rows")
        train_specs = _group_specs(spec, rows, len(rows), spec.seed)
        val_source = eval_rows or rows[: spec.eval_examples]
        val_specs = _group_specs(spec, val_source, len(val_source), spec.seed)
    else:
        n_train = min(spec.steps * spec.rollout.prompts_per_step, MAX_GENERATED_ROWS)
        train_specs = _group_specs(spec, None, n_train, spec.seed)
        val_specs = _group_specs(spec, None, spec.eval_examples, spec.seed + EVAL_SEED_OFFSET)
    train = _records(spec, train_specs, "train")
    val = _records(spec, val_specs, "test")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.parquet", out_dir / "val.parquet"
    for path, records in zip(paths, (train, val)):
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(pa.Table.from_pylist(records), tmp)
        os.replace(tmp, path)
    longest = None
    if tokenizer is not None:
        longest = max(_prompt_tokens(tokenizer, r["prompt"]) for r in (*train, *val))
    return DataFiles(paths[0], paths[1], len(train), len(val), longest)


def _prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- the translation ------------------------------------------------------------------------


def _value(value: Any) -> str:
    """A Hydra override value (grammar: hydra.core.override_parser)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v) for v in value) + "]"
    text = str(value)
    if _SIMPLE_VALUE.match(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def response_length(spec: JobSpec) -> int:
    """verl's fixed response width for the job's episodes."""
    if _is_multi_turn(str(spec.env)):
        turns = spec.rollout.max_turns
        return spec.rollout.max_tokens * turns + OBSERVATION_TOKENS_PER_TURN * (turns - 1)
    return spec.rollout.max_tokens


def build_overrides(
    spec: JobSpec,
    *,
    model_path: Path | str,
    data: DataFiles,
    checkpoint_dir: Path,
    n_gpus: int,
    experiment: str,
    agent_loop_config: Path | None = None,
    max_prompt_length: int = 1024,
) -> list[str]:
    """The Hydra overrides of verl's ``ppo_trainer`` config that run ``spec``.

    Raises ``ValueError`` for a run that cannot start (no GPU, a dataset smaller than one
    batch, a choice verl has no counterpart for; ``jobs.spec`` refuses those at submission).
    """
    if spec.method != "rl" or spec.algorithm.advantage not in ADVANTAGE:
        raise ValueError(
            f"verl runs method 'rl' with advantage {' | '.join(ADVANTAGE)}, not "
            f"{spec.method!r} / {spec.algorithm.advantage!r}"
        )
    if n_gpus < 1:
        raise ValueError("the verl runner needs at least one GPU in the job's block")
    alg, ro, opt = spec.algorithm, spec.rollout, spec.optimizer
    batches_per_epoch = data.train_rows // ro.prompts_per_step
    if batches_per_epoch < 1:
        raise ValueError(
            f"{data.train_rows} training prompts do not fill one step of "
            f"rollout.prompts_per_step={ro.prompts_per_step}"
        )
    multi = _is_multi_turn(str(spec.env))
    if multi and agent_loop_config is None:
        raise ValueError(f"env {spec.env!r} is multi-turn: give the agent loop config file")
    # One sequence per GPU micro-batch keeps memory flat for long multi-turn responses.
    micro = max(1, min(8, (ro.prompts_per_step * ro.group_size) // n_gpus))
    a = "actor_rollout_ref"
    o: dict[str, Any] = {
        # data
        "data.train_files": str(data.train),
        "data.val_files": str(data.val),
        "data.prompt_key": "prompt",
        "data.train_batch_size": ro.prompts_per_step,
        "data.max_prompt_length": max_prompt_length,
        "data.max_response_length": response_length(spec),
        "data.truncation": "error",
        "data.seed": spec.seed,
        "data.dataloader_num_workers": 0,
        # algorithm
        "algorithm.adv_estimator": ADVANTAGE[alg.advantage],
        "algorithm.norm_adv_by_std_in_grpo": alg.normalize_std,
        "algorithm.use_kl_in_reward": False,
        # model and LoRA
        f"{a}.model.path": str(model_path),
        f"{a}.model.lora_rank": 0 if spec.full_finetune else spec.lora.rank,
        f"{a}.model.use_remove_padding": True,
        # actor
        f"{a}.actor.ppo_mini_batch_size": ro.prompts_per_step,
        f"{a}.actor.ppo_micro_batch_size_per_gpu": micro,
        f"{a}.actor.ppo_epochs": 1,
        f"{a}.actor.policy_loss.loss_mode": LOSS_MODE[alg.loss],
        f"{a}.actor.use_kl_loss": alg.kl_coef > 0,
        f"{a}.actor.kl_loss_coef": alg.kl_coef,
        f"{a}.actor.kl_loss_type": "low_var_kl",
        f"{a}.actor.entropy_coeff": 0,
        f"{a}.actor.optim.lr": opt.lr,
        f"{a}.actor.optim.betas": list(opt.betas),
        f"{a}.actor.optim.weight_decay": opt.weight_decay,
        # verl always clips; "off" is a bound no gradient norm reaches.
        f"{a}.actor.grad_clip": opt.grad_clip if opt.grad_clip is not None else 1e9,
        f"{a}.actor.data_loader_seed": spec.seed,
        f"{a}.ref.log_prob_micro_batch_size_per_gpu": micro,
        # rollout
        f"{a}.rollout.name": "vllm",
        f"{a}.rollout.mode": "async",
        f"{a}.rollout.n": ro.group_size,
        f"{a}.rollout.temperature": ro.temperature,
        f"{a}.rollout.top_p": ro.top_p,
        f"{a}.rollout.seed": spec.seed,
        f"{a}.rollout.tensor_model_parallel_size": 1,
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu": micro,
        f"{a}.rollout.multi_turn.enable": multi,
        # reward
        "reward.custom_reward_function.path": str(REWARD_FILE),
        "reward.custom_reward_function.name": "compute_score",
        # trainer
        "trainer.n_gpus_per_node": n_gpus,
        "trainer.nnodes": 1,
        "trainer.total_training_steps": spec.steps,
        "trainer.total_epochs": math.ceil(spec.steps / batches_per_epoch),
        # checkpoint_every 0 means "at the end only": verl saves on the last step when the
        # frequency is positive, so the whole run is one period.
        "trainer.save_freq": spec.checkpoint_every or spec.steps,
        "trainer.test_freq": spec.eval_every or -1,
        "trainer.val_before_train": spec.eval_every > 0,
        "trainer.default_local_dir": str(checkpoint_dir),
        "trainer.resume_mode": "auto",
        "trainer.logger": ["console"],
        "trainer.project_name": "opentinker",
        "trainer.experiment_name": experiment,
        # The legacy trainer needs nothing beyond `pip install verl` (v1 wants TransferQueue).
        "trainer.use_v1": False,
    }
    if alg.loss in ("ppo", "cispo"):
        # verl's clip ratios are distances from 1: ratio in [1 - low, 1 + high].
        o[f"{a}.actor.clip_ratio_low"] = round(1.0 - alg.clip_low, 10)
        o[f"{a}.actor.clip_ratio_high"] = round(alg.clip_high - 1.0, 10)
    if alg.loss == "dro":
        o[f"{a}.actor.policy_loss.dro_beta"] = alg.dro_beta
    if not spec.full_finetune:
        alpha = spec.lora.alpha
        o[f"{a}.model.lora_alpha"] = int(alpha) if float(alpha).is_integer() else alpha
        modules = spec.lora.target_modules
        o[f"{a}.model.target_modules"] = modules if isinstance(modules, str) else list(modules)
        o[f"{a}.rollout.load_format"] = "safetensors"
    if multi:
        o[f"{a}.rollout.multi_turn.max_assistant_turns"] = ro.max_turns
        o[f"{a}.rollout.agent.default_agent_loop"] = "opentinker_env"
        o[f"{a}.rollout.agent.agent_loop_config_path"] = str(agent_loop_config)
    return [f"{key}={_value(value)}" for key, value in o.items()]


# --- the subprocess -------------------------------------------------------------------------


def parse_metric_line(line: str) -> tuple[int, dict[str, float]] | None:
    """``(step, metrics)`` of one of verl's console logger lines, else None.

    Ray prefixes worker output (``(TaskRunner pid=7) step:3 - ...``); values that are not
    finite numbers are dropped (the job's metric table refuses them).
    """
    match = _METRIC_LINE.search(line.rstrip("\r\n"))
    if match is None:
        return None
    metrics: dict[str, float] = {}
    for part in match.group(2).split(" - "):
        key, sep, raw = part.rpartition(":")
        key, raw = key.strip(), raw.strip()
        if not sep or not key or len(key) > 100:
            continue
        wrapped = _WRAPPED.match(raw)
        if wrapped:
            raw = wrapped.group(1)
        try:
            value = float(raw)
        except ValueError:
            continue
        if math.isfinite(value):
            metrics[key] = value
    return int(match.group(1)), metrics


def with_aliases(metrics: Mapping[str, float], env_name: str = "") -> dict[str, float]:
    """verl's metrics plus the native runner's names for the same quantities."""
    out = dict(metrics)
    for theirs, ours in ALIASES.items():
        if theirs in metrics and ours not in out:
            out[ours] = metrics[theirs]
    if "kl" not in out and "actor/ppo_kl" in metrics:
        out["kl"] = metrics["actor/ppo_kl"]
    # Validation: verl names it val-core/<data_source>/<reward key>/mean@<n>.
    prefix = f"val-core/{env_name}/" if env_name else "val-core/"
    for key in sorted(metrics):
        if key.startswith(prefix) and "/mean@" in key and "eval/reward" not in out:
            out["eval/reward"] = metrics[key]
    return out


def entry_command() -> list[str]:
    configured = os.environ.get(ENTRY_ENV, "").strip()
    if configured:
        return shlex.split(configured)
    return [sys.executable, "-m", "verl.trainer.main_ppo"]


def cuda_visible_devices(ctx: JobContext) -> str:
    """The block's GPU indices, from ``ctx.gpus`` or the ``cuda:i`` devices."""
    indices = list(ctx.gpus) or [
        int(d.split(":", 1)[1]) for d in ctx.devices if d.startswith("cuda:")
    ]
    return ",".join(str(i) for i in indices)


@dataclass
class TrainerResult:
    returncode: int | None
    """Exit status; None when we stopped it."""
    stopped: bool
    last_step: int
    checkpoints: list[int] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)


def _saved_steps(checkpoint_dir: Path) -> list[int]:
    """Steps whose checkpoint verl finished writing.

    verl writes ``latest_checkpointed_iteration.txt`` after a save completes, so a
    ``global_step_N`` directory counts once N is at most the step named there.
    """
    marker = checkpoint_dir / "latest_checkpointed_iteration.txt"
    try:
        latest = int(marker.read_text().strip())
    except (OSError, ValueError):
        return []
    steps = []
    for child in checkpoint_dir.iterdir() if checkpoint_dir.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and int(match.group(1)) <= latest:
            steps.append(int(match.group(1)))
    return sorted(steps)


def _registered_steps(ctx: JobContext) -> set[int]:
    """Steps an earlier attempt of this job already put in the checkpoint index."""
    index = ctx.workdir / "checkpoints" / CHECKPOINT_INDEX
    steps: set[int] = set()
    if not index.is_file():
        return steps
    for line in index.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        extra = record.get("extra") or {}
        if extra.get("runner") == "verl":
            steps.add(int(extra.get("step", 0)))
    return steps


def _register_checkpoint(ctx: JobContext, checkpoint_dir: Path, step: int) -> None:
    name = f"global_step_{step}"
    record = {
        "name": name,
        "step": step,
        "created": time.time(),
        "extra": {
            "step": step,
            "attempt": ctx.attempt,
            "runner": "verl",
            "path": str(checkpoint_dir / name),
        },
    }
    index = ctx.workdir / "checkpoints" / CHECKPOINT_INDEX
    index.parent.mkdir(parents=True, exist_ok=True)
    with index.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
    ctx.event(f"verl saved checkpoint {name}", record["extra"])


def supervise(
    ctx: JobContext,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    checkpoint_dir: Path,
    log_path: Path,
    env_name: str = "",
    term_grace_s: float = TERM_GRACE_S,
    poll_s: float = 0.2,
    tail_lines: int = 40,
) -> TrainerResult:
    """Run the trainer to the end, or until ``ctx.cancelled()``; stream what it prints.

    Every output line goes to ``log_path``; metric lines go to ``ctx.log_metrics``; each
    step heartbeats; each finished checkpoint is registered once (also across requeues: the
    index already lists what an earlier attempt registered).
    """
    proc = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        # Its own process group: a cancel signals every process the trainer started.
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, name=f"verl-{ctx.job_id}-stdout", daemon=True)
    reader.start()
    known = _registered_steps(ctx)
    result = TrainerResult(returncode=None, stopped=False, last_step=0)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    eof = False
    try:
        with log_path.open("a", encoding="utf-8") as log:
            while not eof:
                if ctx.cancelled():
                    result.stopped = True
                    stop_process_group(proc, term_grace_s)
                    break
                try:
                    line = lines.get(timeout=poll_s)
                except queue.Empty:
                    line = ""
                while line is not None:
                    if line:
                        log.write(line)
                        result.tail = [*result.tail[-(tail_lines - 1) :], line.rstrip("\n")]
                        parsed = parse_metric_line(line)
                        if parsed is not None:
                            step, metrics = parsed
                            result.last_step = max(result.last_step, step)
                            if metrics:
                                ctx.log_metrics(step, with_aliases(metrics, env_name))
                            ctx.heartbeat(step)
                    try:
                        line = lines.get_nowait()
                    except queue.Empty:
                        break
                else:
                    eof = True
                log.flush()
                for step in _saved_steps(checkpoint_dir):
                    if step not in known:
                        # verl resumes after this step: its metrics must be stored first.
                        ctx.flush_metrics()
                        known.add(step)
                        result.checkpoints.append(step)
                        _register_checkpoint(ctx, checkpoint_dir, step)
                ctx.heartbeat(result.last_step)
        if not result.stopped:
            result.returncode = proc.wait()
            # The leader exited; anything it left behind in its group goes too.
            if group_alive(proc.pid):
                stop_process_group(proc, term_grace_s)
    except BaseException:
        stop_process_group(proc, term_grace_s)
        raise
    finally:
        reader.join(timeout=5)
    return result


# --- the runner -----------------------------------------------------------------------------


def _write_agent_loop_config(path: Path) -> Path:
    from workers.runners.verl_agent_loop import agent_loop_config

    lines = []
    for entry in agent_loop_config():
        lines.append(f"- name: {entry['name']}\n  _target_: {entry['_target_']}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def prepare(
    ctx: JobContext,
    spec: JobSpec,
    *,
    model_path: Path,
    rows: list[dict[str, Any]] | None,
    eval_rows: list[dict[str, Any]] | None,
    tokenizer: Any = None,
) -> list[str]:
    """Write the job's verl inputs under ``ctx.workdir/verl`` and return the full argv."""
    root = ctx.workdir / "verl"
    data = write_datasets(spec, root / "data", rows=rows, eval_rows=eval_rows, tokenizer=tokenizer)
    multi = _is_multi_turn(str(spec.env))
    agent_cfg = _write_agent_loop_config(root / "agent_loops.yaml") if multi else None
    # Room for the longest prompt, rounded up so a resumed attempt pads identically.
    longest = data.max_prompt_tokens or 1024
    overrides = build_overrides(
        spec,
        model_path=model_path,
        data=data,
        checkpoint_dir=root / "checkpoints",
        n_gpus=len([d for d in cuda_visible_devices(ctx).split(",") if d]),
        experiment=f"job-{ctx.job_id}",
        agent_loop_config=agent_cfg,
        max_prompt_length=64 * math.ceil(longest / 64),
    )
    return [*entry_command(), *overrides]


def trainer_env(ctx: JobContext) -> dict[str, str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(ctx)
    # verl's Ray workers import the reward function and the agent loop from this checkout.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    # Django settings are meaningless inside verl's processes; nothing there imports Django.
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def run(ctx: JobContext) -> None:
    """Run one attempt of a ``runner: verl`` job; verl resumes from its own checkpoints."""
    from workers.runners.native import _base_model_path, _rows

    spec = parse_spec(ctx.spec)
    if not cuda_visible_devices(ctx):
        raise RuntimeError(
            "the verl runner needs GPUs: this job's block has none "
            f"(devices {ctx.devices or ['cpu']}); submit it with runner 'native' on CPU"
        )
    model_path = _base_model_path(spec)
    rows, eval_rows = _rows(spec)
    argv = prepare(
        ctx,
        spec,
        model_path=model_path,
        rows=rows,
        eval_rows=eval_rows,
        tokenizer=_load_tokenizer(model_path),
    )
    root = ctx.workdir / "verl"
    ctx.event(
        f"verl on {spec.env}: {spec.steps} steps on GPUs {cuda_visible_devices(ctx)}",
        {"argv": argv},
    )
    result = supervise(
        ctx,
        argv,
        env=trainer_env(ctx),
        cwd=root,
        checkpoint_dir=root / "checkpoints",
        log_path=root / "trainer.log",
        env_name=str(spec.env),
    )
    if result.stopped:
        return
    if result.returncode != 0:
        tail = "\n".join(result.tail[-15:])
        raise RuntimeError(f"verl's trainer exited with status {result.returncode}:\n{tail}")
    ctx.heartbeat(result.last_step, force=True)
