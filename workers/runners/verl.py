"""The verl runner: ``runner: verl`` jobs train with verl's PPO trainer on the job's GPU block.

The JobSpec becomes verl's inputs (``workers.runners.verl_config``: parquet files of the env's
prompts and Hydra overrides of verl's ``ppo_trainer`` config), and verl's trainer runs as a
supervised subprocess (``workers.runners.verl_process``) whose metrics, checkpoints and stop
are the job's.

Rewards: single-turn envs are scored by ``workers.runners.verl_reward.compute_score`` (the
env's own step, so grading matches the native runner); multi-turn envs run through the
``opentinker_env`` agent loop (``workers.runners.verl_agent_loop``), which steps our episodes
against verl's vLLM server and returns the episode reward.

``method: sft`` runs verl's SFT trainer instead (``verl.trainer.sft_trainer`` under
torchrun, ``verl_config.build_sft_overrides``): the same supervision, checkpoints and export.

A block without a CUDA device runs verl on its CPU platform
(``workers/runners/verl_cpu/opentinker_verl_cpu.py``, loaded into every verl process through
``VERL_USE_EXTERNAL_MODULES``) with ``verl_config.cpu_overrides``; a GPU block uses none of it.
After the last step the final weights are exported (``workers.runners.verl_export``).

verl lives in a venv of its own (``make verl-env``); this package imports it nowhere.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from environments.registry import shows_images
from jobs.spec import JobSpec
from workers import conf, gang
from workers.runners import verl_ray
from workers.runners.base import JobCancelled, JobContext, MemberLost
from workers.runners.inputs import Rows, base_model_path, dataset_rows
from workers.runners.verl_agent_loop import agent_loop_config
from workers.runners.verl_config import (
    Pictures,
    build_overrides,
    build_sft_overrides,
    is_multi_turn,
    ray_cpus,
    write_datasets,
    write_sft_datasets,
)
from workers.runners.verl_export import export_final
from workers.runners.verl_process import (
    JOB_MARKER,
    LEFTOVERS_FILE,
    clean_leftovers,
    cuda_visible_devices,
    entry_command,
    record_leftovers,
    resume_point,
    sft_entry_command,
    shm_segments_of,
    supervise,
    tool_python,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_PLATFORM_DIR = Path(__file__).resolve().with_name("verl_cpu")
CPU_PLATFORM_MODULE = "opentinker_verl_cpu"
# Fixes to verl itself (verl_cpu/opentinker_verl_fixes.py), loaded on every block.
FIXES_MODULE = "opentinker_verl_fixes"
CPU_PLATFORM = "opentinker_cpu"


def is_cpu_block(ctx: JobContext) -> bool:
    return not cuda_visible_devices(ctx)


def trainer_processes(ctx: JobContext) -> int:
    """verl's trainer processes: one per GPU, or one per CPU slot of the block."""
    if is_cpu_block(ctx):
        return max(1, len(ctx.devices))
    return len([d for d in cuda_visible_devices(ctx).split(",") if d])


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


def _load_pictures(spec: JobSpec, model_path: Path) -> Pictures | None:
    """The base model's image processor, for a job whose env shows images."""
    if not shows_images(str(spec.env)):
        return None
    from training import vision

    return Pictures(vision.load_processor(str(model_path)))


def nodes_of(ctx: JobContext) -> int:
    """Ray nodes of the job: one per member of its lease (a gang spans several)."""
    return max(1, len(ctx.members))


def prepare(
    ctx: JobContext,
    spec: JobSpec,
    *,
    model_path: Path,
    rows: Rows | None,
    eval_rows: Rows | None,
    tokenizer: Any = None,
    pictures: Pictures | None = None,
) -> list[str]:
    """Write the job's verl inputs under ``ctx.workdir/verl`` and return the full argv."""
    root = ctx.workdir / "verl"
    if spec.method == "sft":
        return prepare_sft(
            ctx, spec, model_path=model_path, rows=rows, eval_rows=eval_rows, tokenizer=tokenizer
        )
    data = write_datasets(
        spec, root / "data", rows=rows, eval_rows=eval_rows, tokenizer=tokenizer, pictures=pictures
    )
    multi = is_multi_turn(str(spec.env))
    agent_cfg = write_agent_loop_config(root / "agent_loops.yaml") if multi else None
    # Room for the longest prompt, rounded up so a resumed attempt pads identically.
    longest = data.max_prompt_tokens or 1024
    overrides = build_overrides(
        spec,
        model_path=model_path,
        data=data,
        checkpoint_dir=root / "checkpoints",
        n_gpus=trainer_processes(ctx),
        experiment=f"job-{ctx.job_id}",
        agent_loop_config=agent_cfg,
        max_prompt_length=64 * math.ceil(longest / 64),
        cpu=is_cpu_block(ctx),
        nnodes=nodes_of(ctx),
    )
    return [*entry_command(), *overrides]


def prepare_sft(
    ctx: JobContext,
    spec: JobSpec,
    *,
    model_path: Path,
    rows: Rows | None,
    eval_rows: Rows | None,
    tokenizer: Any = None,
) -> list[str]:
    if rows is None:
        raise ValueError(f"method 'sft' learns from a dataset; env {spec.env!r} has none")
    root = ctx.workdir / "verl"
    data = write_sft_datasets(
        spec, root / "data", rows=rows, eval_rows=eval_rows, tokenizer=tokenizer
    )
    n_procs = trainer_processes(ctx)
    overrides = build_sft_overrides(
        spec,
        model_path=model_path,
        data=data,
        checkpoint_dir=root / "checkpoints",
        n_gpus=n_procs,
        experiment=f"job-{ctx.job_id}",
        # Rounded up so that a resumed attempt pads identically.
        max_length=64 * math.ceil((data.max_prompt_tokens or 1024) / 64),
        cpu=is_cpu_block(ctx),
    )
    return [*sft_entry_command(n_procs), *overrides]


def trainer_env(ctx: JobContext, ray_tmpdir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # verl's Ray workers import the reward function and the agent loop from this checkout.
    paths = [str(REPO_ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONUNBUFFERED"] = "1"
    env[JOB_MARKER] = str(ctx.job_id)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "disabled")
    # The SFT trainer's progress bar redraws with carriage returns: noise in the job's log.
    env.setdefault("TQDM_DISABLE", "1")
    if ray_tmpdir is not None:
        # Ray leaves a session directory per start: one per attempt, removed afterwards.
        env["RAY_TMPDIR"] = str(ray_tmpdir)
    # The modules verl's processes import (verl_cpu/): its fixes on every block, and on a
    # block without CUDA the CPU platform first.
    paths.insert(0, str(CPU_PLATFORM_DIR))
    ours = [FIXES_MODULE]
    if is_cpu_block(ctx):
        ours.insert(0, CPU_PLATFORM_MODULE)
    modules = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    env["VERL_USE_EXTERNAL_MODULES"] = ",".join([*ours, *modules])
    if is_cpu_block(ctx):
        env["VERL_PLATFORM"] = CPU_PLATFORM
        # verl registers its FSDP engine for cuda and npu; the class then runs on the
        # platform's device.
        env["VERL_ENGINE_DEVICE"] = "cuda"
        env["VLLM_TARGET_DEVICE"] = "cpu"
        # GiB of KV cache for vLLM's CPU backend: ample for small models and short turns.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # Every Ray worker is a process of its own: one torch thread each.
        env["OMP_NUM_THREADS"] = "1"
        # Ray would start one idle Python worker per logical CPU (ray_cpus: 8 or more) for
        # the driver; verl's actors ask for workers of their own runtime env, so those sit
        # unused, each an interpreter's start taken from the two cores.
        env["RAY_prestart_worker_first_driver"] = "0"
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(ctx)
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # Django settings are meaningless inside verl's processes; nothing there imports Django.
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return env


def _start_cluster(
    ctx: JobContext, env: dict[str, str], root: Path
) -> tuple[verl_ray.RayNode, str]:
    """The gang's Ray cluster: a head here, published for the followers' ``join_job``; returns
    once every member's node has joined (else the attempt is requeued: `MemberLost`)."""
    nodes = nodes_of(ctx)
    n_procs = trainer_processes(ctx)
    # Ray's token authentication, with a token of this attempt's own: the head, the driver
    # and every follower (which gets it with the address, through Redis) use it, and no one
    # else can join the cluster or run code on it.
    env.update(verl_ray.auth_env(secrets.token_hex(32)))
    head, address = verl_ray.start_head(
        address=conf.node_address(),
        gpus=n_procs,
        cpus=ray_cpus(n_procs),
        env=env,
        log_path=root / "ray-head.log",
    )

    def wanted() -> bool:
        return head.alive() and not ctx.cancelled()

    try:
        gang.publish_rendezvous(
            ctx.job_id, ctx.attempt, verl_ray.rendezvous(address, env[verl_ray.TOKEN_ENV])
        )
        seen = verl_ray.wait_for_nodes(
            address, nodes, env=env, timeout_s=conf.gang_timeout(), still_wanted=wanted
        )
    except BaseException:
        head.stop()
        raise
    if seen < nodes:
        head.stop()
        if ctx.stop_reason == "cancelled":
            raise JobCancelled()
        # A lost follower, a head that died or never answered: the attempt is requeued.
        raise MemberLost(f"{seen} of the job's {nodes} Ray nodes came up:\n{head.tail()}")
    ctx.event(f"verl: a Ray cluster of {nodes} nodes at {address}", {"ray": address})
    return head, address


def join(
    job_id: str,
    spec_data: dict[str, Any],
    *,
    attempt: int,
    rank: int,
    node: str,
    gpus: list[int],
    devices: list[str],
    workdir: Path,
    still_wanted: Callable[[], bool],
) -> bool:
    """A follower node of a verl gang: join the leader's Ray cluster with this node's GPUs
    and stay until the attempt ends (or the node's Ray stops). False when no cluster came."""
    published = gang.wait_rendezvous(
        job_id, attempt, timeout_s=conf.gang_timeout(), still_wanted=still_wanted
    )
    if published is None:
        return False
    address, token = verl_ray.parse_rendezvous(published)
    member = JobContext(
        job_id=job_id,
        attempt=attempt,
        spec=spec_data,
        devices=devices,
        workdir=workdir,
        node=node,
        gpus=gpus,
    )
    marker = f"{job_id}.{rank}"
    # One file per rank across attempts: an attempt whose follower was killed before its
    # cleanup left it there for the next one on this node.
    leftovers = workdir.parent / f"rank-{rank}-{LEFTOVERS_FILE}"
    clean_leftovers(marker, leftovers)
    ray_tmpdir = Path(tempfile.mkdtemp(prefix=f"ot-ray-{job_id[:8]}-{rank}-"))
    record_leftovers(leftovers, ray_tmpdir=str(ray_tmpdir))
    env = {**trainer_env(member, ray_tmpdir), JOB_MARKER: marker, **verl_ray.auth_env(token)}
    n_procs = trainer_processes(member)
    ray_node = verl_ray.start_worker(
        head=address,
        address=conf.node_address(),
        gpus=n_procs,
        cpus=ray_cpus(n_procs),
        env=env,
        log_path=workdir / "ray-worker.log",
    )
    try:
        while ray_node.alive() and still_wanted():
            # vLLM's shared-memory queues outlive a process killed with the node: noted here,
            # removed at the end by `clean_leftovers`.
            record_leftovers(leftovers, segments=shm_segments_of(ray_node.proc.pid, marker))
            time.sleep(2.0)
        if not ray_node.alive() and not gang.ended(job_id, attempt) and still_wanted():
            raise RuntimeError(f"this node's Ray stopped while the job ran:\n{ray_node.tail()}")
    finally:
        ray_node.stop()
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
        clean_leftovers(marker, leftovers)
    return True


def run(ctx: JobContext) -> None:
    """Run one attempt of a ``runner: verl`` job; verl resumes from its own checkpoints."""
    spec = ctx.job_spec
    model_path = base_model_path(spec)
    rows, eval_rows = dataset_rows(spec)
    argv = prepare(
        ctx,
        spec,
        model_path=model_path,
        rows=rows,
        eval_rows=eval_rows,
        tokenizer=_load_tokenizer(model_path),
        pictures=_load_pictures(spec, model_path),
    )
    root = ctx.workdir / "verl"
    leftovers = root / LEFTOVERS_FILE
    cleaned = clean_leftovers(str(ctx.job_id), leftovers)
    if cleaned["killed"] or cleaned["segments"]:
        ctx.event(
            f"verl: removed what an earlier attempt left: {len(cleaned['killed'])} processes,"
            f" {len(cleaned['segments'])} shared-memory segments",
            cleaned,
        )
    resumed_from = resume_point(ctx, root / "checkpoints")
    if resumed_from >= spec.steps:
        # An earlier attempt trained every step and saved the last, then lost its worker (or
        # a follower) before it ended: verl resumed there would train one step more than
        # the job asks for. What is left is the export.
        ctx.event(
            f"verl trained all {spec.steps} steps in an earlier attempt: exporting "
            f"global_step_{resumed_from}",
            {"step": resumed_from},
        )
        ctx.heartbeat(resumed_from, force=True)
        export_final(ctx, spec, root / "checkpoints", python=tool_python(), env=trainer_env(ctx))
        return
    if resumed_from:
        # verl redoes the steps after its checkpoint; an earlier attempt's rows past it go.
        ctx.discard_metrics_after(resumed_from)
        ctx.event(f"verl resumes from global_step_{resumed_from}", {"step": resumed_from})
    where = "the CPU" if is_cpu_block(ctx) else f"GPUs {cuda_visible_devices(ctx)}"
    ctx.event(f"verl on {spec.env}: {spec.steps} steps on {where}", {"argv": argv})
    # Short and outside the workdir: Ray's socket paths must fit in 107 bytes.
    ray_tmpdir = Path(tempfile.mkdtemp(prefix=f"ot-ray-{ctx.job_id[:8]}-"))
    record_leftovers(leftovers, ray_tmpdir=str(ray_tmpdir))
    env = trainer_env(ctx, ray_tmpdir)
    stall_s = float(conf.setting("OPENTINKER_VERL_STALL_SECONDS"))
    head: verl_ray.RayNode | None = None
    try:
        if nodes_of(ctx) > 1:
            head, address = _start_cluster(ctx, env, root)
            argv = [*argv, f"+ray_kwargs.ray_init.address={address}"]
        result = supervise(
            ctx,
            argv,
            env=env,
            cwd=root,
            checkpoint_dir=root / "checkpoints",
            log_path=root / "trainer.log",
            env_name=str(spec.env),
            stall_s=stall_s,
            leftovers_path=leftovers,
        )
    finally:
        if head is not None:
            # The followers' Ray nodes stop with the head: as they should, from now on.
            gang.mark_ended(ctx.job_id, ctx.attempt)
            head.stop()
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
        # Whatever of the tree left its process group (Ray starts some of its processes in
        # sessions of their own) goes by the marker, with the segments it mapped.
        clean_leftovers(str(ctx.job_id), leftovers)
    if result.stopped:
        return
    tail = "\n".join(result.tail[-15:])
    if result.stalled:
        raise RuntimeError(f"verl's trainer printed nothing for {stall_s:.0f} s:\n{tail}")
    if result.returncode != 0:
        raise RuntimeError(f"verl's trainer exited with status {result.returncode}:\n{tail}")
    ctx.heartbeat(result.last_step, force=True)
    export_final(ctx, spec, root / "checkpoints", python=tool_python(), env=env)
    ctx.heartbeat(result.last_step, force=True)
