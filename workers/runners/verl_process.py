"""verl's trainer as a supervised subprocess: its console metrics, checkpoints and stop.

verl's trainer runs in its own process group (``supervise``): its console metric lines
(``step:N - key:value - ...``) become job metrics, the ``global_step_N`` checkpoints it saves
become job events and lines of ``checkpoints/checkpoints.jsonl``, and a cancel or a lost lease
ends the whole process tree (SIGTERM, then SIGKILL to the group).

The entry command is ``OPENTINKER_VERL_COMMAND`` (a shell-style command line: the tests point
it at a stand-in script), else ``python -m verl.trainer.main_ppo`` with the python of the verl
venv (``OPENTINKER_VERL_VENV``, built by ``make verl-env``) when it exists, else with the
worker's interpreter. A trainer that prints nothing for ``stall_s`` seconds is stopped and
reported as stalled: vLLM and Ray failures hang verl's trainer rather than end it.

Shared-memory segments the tree maps (vLLM's message queues, ``/dev/shm/psm_*``, hundreds of
MiB each) outlive a tree that ends with SIGKILL: ``supervise`` notes the ``/dev/shm`` files
its processes map while they run and removes those left when the tree is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from workers import conf
from workers.processes import group_alive, stop_process_group
from workers.runners.base import JobContext

ENTRY_ENV = "OPENTINKER_VERL_COMMAND"
CHECKPOINT_INDEX = "checkpoints.jsonl"
TERM_GRACE_S = 10.0
SHM_DIR = Path("/dev/shm")
SHM_SCAN_S = 5.0
# Every process of a job's verl tree inherits this variable (Ray and vLLM workers take the
# driver's environment): a later attempt finds what a killed worker left running by it.
JOB_MARKER = "OT_VERL_JOB"
LEFTOVERS_FILE = "leftovers.json"
_PR_SET_PDEATHSIG = 1

# After a space, Ray's ")" prefix, or the "]" a tqdm bar of the SFT trainer ends with.
_METRIC_LINE = re.compile(r"(?:^|[\s)\]])step:(\d+) - (.*)$")
# verl prints values with pprint: numpy scalars show as "np.float64(0.5)".
_WRAPPED = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
# verl metric -> the name the native runner logs, so both runners chart the same series.
ALIASES = {
    "critic/score/mean": "reward/mean",
    "actor/pg_loss": "loss",
    # verl's SFT trainer
    "train/loss": "loss",
    "train/grad_norm": "grad_norm",
    "val/loss": "eval/loss",
    "actor/kl_loss": "kl",
    "actor/entropy": "entropy",
    "perf/throughput": "tokens_per_s",
    "timing_s/step": "step_time_s",
}


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


def venv_python() -> Path | None:
    """The verl venv's interpreter (``make verl-env``), when that venv exists."""
    python = Path(conf.setting("OPENTINKER_VERL_VENV")) / "bin" / "python"
    return python if python.is_file() else None


def entry_command() -> list[str]:
    """The trainer's command line: ``OPENTINKER_VERL_COMMAND`` (declared and checked in the
    settings), else the verl venv's main_ppo, else this interpreter's."""
    configured = str(conf.setting(ENTRY_ENV) or "").strip()
    if configured:
        return shlex.split(configured)
    return [str(venv_python() or sys.executable), "-m", "verl.trainer.main_ppo"]


def sft_entry_command(n_procs: int) -> list[str]:
    """verl's SFT trainer is SPMD under torchrun, not a Ray driver: one process per GPU (or
    CPU slot), a rendezvous on a free local port so that jobs side by side do not collide."""
    python = tool_python() or sys.executable
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc_per_node={n_procs}",
        "-m",
        "verl.trainer.sft_trainer",
    ]


def tool_python() -> str | None:
    """The interpreter that has verl, for verl's tools (the checkpoint merger): the entry
    command's when it runs a python, else the verl venv's."""
    first = entry_command()[0]
    if Path(first).name.startswith("python"):
        return first
    python = venv_python()
    return str(python) if python else None


def cuda_visible_devices(ctx: JobContext) -> str:
    """The block's GPU indices, from ``ctx.gpus`` or the ``cuda:i`` devices; empty for a
    block of CPU slots (whose ``ctx.gpus`` are slot numbers, not GPUs)."""
    if ctx.devices and not any(d.startswith("cuda") for d in ctx.devices):
        return ""
    indices = list(ctx.gpus) or [
        int(d.split(":", 1)[1]) for d in ctx.devices if d.startswith("cuda:")
    ]
    return ",".join(str(i) for i in indices)


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def shm_segments_of(root: int, job_id: str = "") -> set[str]:
    """Names of the ``/dev/shm`` files that ``root``'s process tree (and, given ``job_id``,
    every process carrying the job's marker: Ray reparents some) has mapped."""
    marker = f"{SHM_DIR}/"
    names = set()
    pids = set(descendants(root)) | set(job_processes(job_id) if job_id else [])
    for pid in sorted(pids):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            at = line.find(marker)
            if at >= 0:
                name = line[at + len(marker) :].removesuffix(" (deleted)").strip()
                if name and "/" not in name:
                    names.add(name)
    return names


def job_processes(job_id: str) -> list[int]:
    """Live processes whose environment carries ``JOB_MARKER=job_id`` (zombies have none)."""
    needle = f"{JOB_MARKER}={job_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return sorted(pids)


def record_leftovers(path: Path, *, segments: set[str] = frozenset(), ray_tmpdir: str = "") -> None:
    """Note in the workdir what a kill of this worker would leave behind: the next attempt
    (``clean_leftovers``) removes it."""
    state = read_leftovers(path)
    state["segments"] = sorted(set(state["segments"]) | set(segments))
    if ray_tmpdir and ray_tmpdir not in state["ray_tmpdirs"]:
        state["ray_tmpdirs"].append(ray_tmpdir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state), encoding="utf-8")
    tmp.replace(path)


def read_leftovers(path: Path) -> dict[str, list[str]]:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = {}
    return {
        "segments": list(state.get("segments") or []),
        "ray_tmpdirs": list(state.get("ray_tmpdirs") or []),
    }


def clean_leftovers(job_id: str, path: Path, wait_s: float = 10.0) -> dict[str, list]:
    """SIGKILL what an earlier attempt of the job left running (its worker was killed and
    the tree, in a session of its own, outlived it), then remove its shared-memory segments
    and Ray session directories. Before a resume: an old tree would still write checkpoints."""
    pids = job_processes(job_id)
    state = read_leftovers(path)
    segments = set(state["segments"])
    for pid in pids:
        segments |= shm_segments_of(pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while pids and job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    removed = remove_segments(segments)
    for tmpdir in state["ray_tmpdirs"]:
        shutil.rmtree(tmpdir, ignore_errors=True)
    path.unlink(missing_ok=True)
    return {"killed": pids, "segments": removed, "ray_tmpdirs": state["ray_tmpdirs"]}


def _die_with_parent() -> None:
    # Runs in the child before exec: the trainer's leader gets SIGKILL when the worker
    # process that started it dies, so a killed worker does not leave a training driver.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def remove_segments(names: set[str]) -> list[str]:
    removed = []
    for name in sorted(names):
        try:
            (SHM_DIR / name).unlink()
        except OSError:
            continue
        removed.append(name)
    return removed


@dataclass
class TrainerResult:
    returncode: int | None
    """Exit status; None when we stopped it."""
    stopped: bool
    last_step: int
    stalled: bool = False
    """Stopped by us after ``stall_s`` seconds without a line of output."""
    checkpoints: list[int] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    removed_segments: list[str] = field(default_factory=list)
    """``/dev/shm`` files of the tree that were still there when it had gone."""


def saved_steps(checkpoint_dir: Path) -> list[int]:
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


def registered_steps(ctx: JobContext) -> set[int]:
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


def resume_point(ctx: JobContext, checkpoint_dir: Path) -> int:
    """The step a new attempt resumes from: the latest checkpoint an earlier attempt
    registered (its metrics stored). verl's later saves, whose metrics were lost with a
    killed worker, are deleted, and verl's marker names that step, so that
    ``trainer.resume_mode=auto`` starts after it; 0 (and no checkpoint left) when none."""
    saved = saved_steps(checkpoint_dir)
    kept = [step for step in saved if step in registered_steps(ctx)]
    point = max(kept, default=0)
    for step in saved:
        if step > point:
            shutil.rmtree(checkpoint_dir / f"global_step_{step}", ignore_errors=True)
    marker = checkpoint_dir / "latest_checkpointed_iteration.txt"
    if point:
        marker.write_text(str(point), encoding="utf-8")
    else:
        marker.unlink(missing_ok=True)
    return point


def register_checkpoint(ctx: JobContext, checkpoint_dir: Path, step: int) -> None:
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
    stall_s: float | None = None,
    shm_scan_s: float = SHM_SCAN_S,
    leftovers_path: Path | None = None,
) -> TrainerResult:
    """Run the trainer to the end, until ``ctx.cancelled()``, or until it prints nothing for
    ``stall_s`` seconds (then ``stalled``; its return code is None); stream what it prints.

    Every output line goes to ``log_path``; metric lines go to ``ctx.log_metrics``; each
    step heartbeats; each finished checkpoint is registered once (also across requeues: the
    index already lists what an earlier attempt registered). The shared-memory segments it
    sees are noted in ``leftovers_path`` too, for the attempt after a killed worker.
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
        preexec_fn=_die_with_parent,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=pump, name=f"verl-{ctx.job_id}-stdout", daemon=True)
    reader.start()
    known = registered_steps(ctx)
    result = TrainerResult(returncode=None, stopped=False, last_step=0)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    eof = False
    last_output = time.monotonic()
    segments: set[str] = set()
    last_scan = -math.inf
    try:
        with log_path.open("a", encoding="utf-8") as log:
            while not eof:
                if time.monotonic() - last_scan >= shm_scan_s:
                    seen = shm_segments_of(proc.pid, str(ctx.job_id))
                    if leftovers_path is not None and not seen <= segments:
                        record_leftovers(leftovers_path, segments=seen)
                    segments |= seen
                    last_scan = time.monotonic()
                if ctx.cancelled():
                    result.stopped = True
                    segments |= shm_segments_of(proc.pid, str(ctx.job_id))
                    stop_process_group(proc, term_grace_s)
                    break
                if stall_s is not None and time.monotonic() - last_output > stall_s:
                    result.stalled = True
                    segments |= shm_segments_of(proc.pid, str(ctx.job_id))
                    stop_process_group(proc, term_grace_s)
                    break
                try:
                    line = lines.get(timeout=poll_s)
                except queue.Empty:
                    line = ""
                while line is not None:
                    if line:
                        last_output = time.monotonic()
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
                for step in saved_steps(checkpoint_dir):
                    # verl saves step N before it prints step N's metrics, and a resume
                    # from N redoes only the steps after it: N counts once its metrics
                    # are stored (the last step's after a clean exit).
                    if step not in known and (step <= result.last_step or eof):
                        ctx.flush_metrics()
                        known.add(step)
                        result.checkpoints.append(step)
                        register_checkpoint(ctx, checkpoint_dir, step)
                ctx.heartbeat(result.last_step)
        if not result.stopped and not result.stalled:
            segments |= shm_segments_of(proc.pid, str(ctx.job_id))
            result.returncode = proc.wait()
            # The leader exited; anything it left behind in its group goes too.
            if group_alive(proc.pid):
                stop_process_group(proc, term_grace_s)
    except BaseException:
        stop_process_group(proc, term_grace_s)
        raise
    finally:
        reader.join(timeout=5)
        result.removed_segments = remove_segments(segments)
    return result
