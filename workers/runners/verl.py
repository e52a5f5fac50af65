"""The verl runner: ``runner: verl`` jobs train with verl's PPO trainer on the job's GPU block.

The JobSpec becomes verl's inputs (``workers.runners.verl_config``: parquet files of the env's
prompts and Hydra overrides of verl's ``ppo_trainer`` config), and verl's trainer runs as a
supervised subprocess (``workers.runners.verl_process``) whose metrics, checkpoints and stop
are the job's.

Rewards: single-turn envs are scored by ``workers.runners.verl_reward.compute_score`` (the
env's own step, so grading matches the native runner); multi-turn envs run through the
``opentinker_env`` agent loop (``workers.runners.verl_agent_loop``), which steps our episodes
against verl's vLLM server and returns the episode reward.

verl is an optional extra (``pip install .[verl]``); this package imports it nowhere.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from jobs.spec import JobSpec
from workers.runners.base import JobContext
from workers.runners.inputs import Rows, base_model_path, dataset_rows
from workers.runners.verl_agent_loop import agent_loop_config
from workers.runners.verl_config import build_overrides, is_multi_turn, write_datasets
from workers.runners.verl_process import cuda_visible_devices, entry_command, supervise

REPO_ROOT = Path(__file__).resolve().parents[2]


def write_agent_loop_config(path: Path) -> Path:
    lines = []
    for entry in agent_loop_config():
        lines.append(f"- name: {entry['name']}\n  _target_: {entry['_target_']}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")
    return path


def _load_tokenizer(model_path: Path) -> Any:
    # Lazy: only the prompt lengths need a tokenizer, and transformers is slow to import.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


def prepare(
    ctx: JobContext,
    spec: JobSpec,
    *,
    model_path: Path,
    rows: Rows | None,
    eval_rows: Rows | None,
    tokenizer: Any = None,
) -> list[str]:
    """Write the job's verl inputs under ``ctx.workdir/verl`` and return the full argv."""
    root = ctx.workdir / "verl"
    data = write_datasets(spec, root / "data", rows=rows, eval_rows=eval_rows, tokenizer=tokenizer)
    multi = is_multi_turn(str(spec.env))
    agent_cfg = write_agent_loop_config(root / "agent_loops.yaml") if multi else None
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
    spec = ctx.job_spec
    if not cuda_visible_devices(ctx):
        raise RuntimeError(
            "the verl runner needs GPUs: this job's block has none "
            f"(devices {ctx.devices or ['cpu']}); submit it with runner 'native' on CPU"
        )
    model_path = base_model_path(spec)
    rows, eval_rows = dataset_rows(spec)
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
