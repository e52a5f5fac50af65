"""The verl runner's subprocess handling, against a stand-in trainer script (no verl, no GPU).

The stand-in (``fake_verl_trainer.py``) is a real process that reads the overrides the runner
built, prints verl-format metric lines behind Ray's prefix, saves ``global_step_N``
directories and starts a child process. These tests check our side: metric parsing, the
checkpoint index, heartbeats and that a cancel ends the whole process tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from environments.datasets import load_rows, resolve
from jobs.spec import parse_spec
from workers.runners import verl, verl_process
from workers.runners.base import JobContext

FAKE_TRAINER = Path(__file__).with_name("fake_verl_trainer.py")


@dataclass
class RecordingContext(JobContext):
    """A JobContext whose job-row writes land in lists instead of the database."""

    metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    heartbeats: list[int | None] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def heartbeat(self, step: int | None = None, *, force: bool = False) -> None:
        self.heartbeats.append(step)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.metrics.append((step, dict(metrics)))

    def event(self, message: str, data: Mapping[str, Any] | None = None) -> None:
        self.events.append((message, dict(data or {})))


def _spec(**over: Any) -> Any:
    base = {
        "method": "rl",
        "env": "math",
        "dataset": "builtin:arith_train",
        "runner": "verl",
        "steps": 5,
        "checkpoint_every": 2,
        "rollout": {"prompts_per_step": 4, "group_size": 2},
    }
    return parse_spec({**base, **over})


def _ctx(tmp_path: Path, spec: Any, cancel: Any = None) -> RecordingContext:
    return RecordingContext(
        job_id="7",
        attempt=1,
        spec=spec.model_dump(mode="json"),
        devices=["cuda:0"],
        gpus=[0],
        workdir=tmp_path / "job",
        cancel_check=cancel,
    )


def _argv(ctx: RecordingContext, spec: Any) -> list[str]:
    rows = load_rows(resolve("builtin:arith_train"), "math")[:40]
    argv = verl.prepare(ctx, spec, model_path=Path("/models/none"), rows=rows, eval_rows=rows[:4])
    # Replace verl's entry point, keep every override.
    entry = len(verl_process.entry_command())
    return [sys.executable, str(FAKE_TRAINER), *argv[entry:]]


def _supervise(ctx: RecordingContext, argv: list[str], **env: str) -> verl_process.TrainerResult:
    root = ctx.workdir / "verl"
    return verl_process.supervise(
        ctx,
        argv,
        env={**os.environ, **env},
        cwd=root,
        checkpoint_dir=root / "checkpoints",
        log_path=root / "trainer.log",
        env_name="math",
        term_grace_s=1.0,
        poll_s=0.05,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): read its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_it_streams_metrics_heartbeats_and_checkpoints(tmp_path: Path) -> None:
    spec = _spec()
    ctx = _ctx(tmp_path, spec)
    result = _supervise(ctx, _argv(ctx, spec))

    assert result.returncode == 0 and not result.stopped
    assert [step for step, _ in ctx.metrics] == [1, 2, 3, 4, 5]
    step3 = dict(ctx.metrics)[3]
    assert step3["critic/score/mean"] == pytest.approx(0.3)
    assert step3["reward/mean"] == pytest.approx(0.3)  # the native runner's name
    assert step3["loss"] == pytest.approx(-0.03)
    assert "actor/entropy" not in step3  # nan is dropped, not stored
    assert 5 in ctx.heartbeats
    # checkpoint_every=2 over 5 steps: 2, 4 and the last step.
    assert result.checkpoints == [2, 4, 5]
    index = ctx.workdir / "checkpoints" / "checkpoints.jsonl"
    records = [json.loads(line) for line in index.read_text().splitlines()]
    assert [r["name"] for r in records] == ["global_step_2", "global_step_4", "global_step_5"]
    assert all(r["extra"]["runner"] == "verl" and r["extra"]["attempt"] == 1 for r in records)
    assert Path(records[-1]["extra"]["path"]).is_dir()
    assert [m for m, _ in ctx.events if "checkpoint" in m] == [
        f"verl saved checkpoint global_step_{s}" for s in (2, 4, 5)
    ]
    log = (ctx.workdir / "verl" / "trainer.log").read_text()
    assert "Started a local Ray instance." in log and "step:5 - " in log


def test_it_does_not_register_a_checkpoint_twice_after_a_requeue(tmp_path: Path) -> None:
    spec = _spec(steps=3, checkpoint_every=1)
    first = _ctx(tmp_path, spec)
    argv = _argv(first, spec)
    assert _supervise(first, argv, FAKE_VERL_MODE="fail").returncode == 3
    assert first.metrics and first.metrics[0][0] == 1

    second = _ctx(tmp_path, spec)
    second.attempt = 2
    result = _supervise(second, argv)
    # The trainer resumed after step 1 (verl's own resume); only new saves are registered.
    assert result.returncode == 0
    assert [step for step, _ in second.metrics] == [2, 3]
    assert result.checkpoints == [2, 3]
    index = second.workdir / "checkpoints" / "checkpoints.jsonl"
    names = [json.loads(line)["name"] for line in index.read_text().splitlines()]
    assert names == ["global_step_1", "global_step_2", "global_step_3"]


def test_it_reports_a_failing_trainer_with_its_last_lines(tmp_path: Path) -> None:
    spec = _spec()
    ctx = _ctx(tmp_path, spec)
    result = _supervise(ctx, _argv(ctx, spec), FAKE_VERL_MODE="fail")
    assert result.returncode == 3 and not result.stopped
    assert result.tail[-1] == "RuntimeError: CUDA out of memory"


def test_it_kills_the_whole_process_tree_on_cancel(tmp_path: Path) -> None:
    spec = _spec()
    pids = tmp_path / "pids"
    cancel = {"now": False}
    ctx = _ctx(tmp_path, spec, cancel=lambda _job: cancel["now"])

    real_log = ctx.log_metrics

    def log_then_cancel(step: int, metrics: Mapping[str, float]) -> None:
        real_log(step, metrics)
        cancel["now"] = True  # as if the user cancelled once the first step was in

    ctx.log_metrics = log_then_cancel  # type: ignore[method-assign]
    started = time.monotonic()
    segment = f"opentinker-test-{os.getpid()}-{time.time_ns()}"
    result = _supervise(
        ctx,
        _argv(ctx, spec),
        FAKE_VERL_MODE="hang",
        FAKE_VERL_PIDS=str(pids),
        FAKE_VERL_SHM=segment,
    )
    elapsed = time.monotonic() - started

    assert result.stopped and result.returncode is None
    # The tree's shared memory goes with it.
    assert result.removed_segments == [segment]
    assert not (verl_process.SHM_DIR / segment).exists()
    assert [step for step, _ in ctx.metrics] == [1]
    leader, child = (int(p) for p in pids.read_text().split())
    # Both ignore SIGTERM: the group's SIGKILL after the grace period ends them.
    deadline = time.monotonic() + 5
    while (_alive(leader) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(leader) and not _alive(child)
    assert elapsed < 15


def test_it_runs_a_block_of_cpu_slots_on_the_cpu_platform(tmp_path: Path) -> None:
    spec = _spec()
    ctx = _ctx(tmp_path, spec)
    # A CPU node leases slots: their numbers are in ctx.gpus, but they are no GPUs.
    ctx.devices, ctx.gpus = ["cpu"], [1]
    assert verl.is_cpu_block(ctx) and verl_process.cuda_visible_devices(ctx) == ""
    argv = _argv(ctx, spec)
    for override in (
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "+ray_kwargs.ray_init.num_gpus=1",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "+actor_rollout_ref.rollout.enable_sleep_mode=false",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "reward.num_workers=1",
    ):
        assert override in argv, override
    # One value per key: Hydra takes the CPU value, not the GPU default next to it.
    keys = [a.split("=", 1)[0] for a in argv if "=" in a]
    assert len(keys) == len(set(keys))

    env = verl.trainer_env(ctx, tmp_path / "ray")
    assert env["VERL_PLATFORM"] == verl.CPU_PLATFORM
    assert env["VERL_USE_EXTERNAL_MODULES"].split(",")[:2] == [
        verl.CPU_PLATFORM_MODULE,
        verl.FIXES_MODULE,
    ]
    assert env["VERL_ENGINE_DEVICE"] == "cuda" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["RAY_TMPDIR"] == str(tmp_path / "ray") and env["OMP_NUM_THREADS"] == "1"
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert str(verl.CPU_PLATFORM_DIR) in paths and str(verl.REPO_ROOT) in paths
    assert (verl.CPU_PLATFORM_DIR / f"{verl.CPU_PLATFORM_MODULE}.py").is_file()
    assert "CUDA_VISIBLE_DEVICES" not in env

    # A GPU block uses none of it but the fixes to verl.
    gpu = _ctx(tmp_path / "gpu", spec)
    assert "trainer.device=cpu" not in _argv(gpu, spec)
    assert "actor_rollout_ref.model.use_remove_padding=true" in _argv(gpu, spec)
    gpu_env = verl.trainer_env(gpu)
    assert gpu_env.get("VERL_PLATFORM") == os.environ.get("VERL_PLATFORM")
    assert gpu_env["VERL_USE_EXTERNAL_MODULES"].split(",")[0] == verl.FIXES_MODULE
    assert str(verl.CPU_PLATFORM_DIR) in gpu_env["PYTHONPATH"].split(os.pathsep)


def test_it_stops_a_trainer_that_prints_nothing_for_too_long(tmp_path: Path) -> None:
    spec = _spec()
    pids = tmp_path / "pids"
    ctx = _ctx(tmp_path, spec)
    root = ctx.workdir / "verl"
    started = time.monotonic()
    result = verl_process.supervise(
        ctx,
        _argv(ctx, spec),
        env={**os.environ, "FAKE_VERL_MODE": "hang", "FAKE_VERL_PIDS": str(pids)},
        cwd=root,
        checkpoint_dir=root / "checkpoints",
        log_path=root / "trainer.log",
        term_grace_s=1.0,
        poll_s=0.05,
        stall_s=1.5,
    )
    assert result.stalled and not result.stopped and result.returncode is None
    assert [step for step, _ in ctx.metrics] == [1]
    leader, child = (int(p) for p in pids.read_text().split())
    deadline = time.monotonic() + 5
    while (_alive(leader) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(leader) and not _alive(child)
    assert time.monotonic() - started < 15


def test_it_passes_the_block_as_cuda_visible_devices(tmp_path: Path) -> None:
    spec = _spec()
    ctx = _ctx(tmp_path, spec)
    ctx.gpus = [2, 5]
    env = verl.trainer_env(ctx)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert str(verl.REPO_ROOT) in env["PYTHONPATH"].split(os.pathsep)
    ctx.gpus = []
    ctx.devices = ["cuda:3"]
    assert verl_process.cuda_visible_devices(ctx) == "3"


def test_it_takes_the_entry_command_from_the_settings(settings: Any, tmp_path: Path) -> None:
    settings.OPENTINKER_VERL_COMMAND = "/opt/verl/bin/python -m verl.trainer.main_ppo"
    assert verl_process.entry_command() == ["/opt/verl/bin/python", "-m", "verl.trainer.main_ppo"]
    assert verl_process.tool_python() == "/opt/verl/bin/python"
    settings.OPENTINKER_VERL_COMMAND = ""
    # No verl venv: this interpreter's verl.
    settings.OPENTINKER_VERL_VENV = tmp_path / "none"
    assert verl_process.entry_command() == [sys.executable, "-m", "verl.trainer.main_ppo"]
    # The venv `make verl-env` built.
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    settings.OPENTINKER_VERL_VENV = tmp_path / "venv"
    assert verl_process.entry_command() == [str(python), "-m", "verl.trainer.main_ppo"]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            (
                "(TaskRunner pid=812) step:12 - actor/pg_loss:np.float64(-0.25) - "
                "critic/score/mean:0.5 - val-core/math/reward/mean@1:0.75\n"
            ),
            (
                12,
                {
                    "actor/pg_loss": -0.25,
                    "critic/score/mean": 0.5,
                    "val-core/math/reward/mean@1": 0.75,
                },
            ),
        ),
        (
            "step:0 - timing_s/gen:1e-03 - perf/max_memory_allocated_gb:inf",
            (0, {"timing_s/gen": 0.001}),
        ),
        ("step:3 - training/epoch:np.int64(2)", (3, {"training/epoch": 2.0})),
        # The SFT trainer's progress bar ends with "]" where its metric line starts.
        (
            "Epoch 1/1:  25%|##        | 1/4 [00:00<00:00,  3.51it/s]step:2 - train/loss:8.5",
            (2, {"train/loss": 8.5}),
        ),
        ("local_global_step_folder: /x/global_step_3", None),
        ("(WorkerDict pid=9) INFO step: not a metric line", None),
    ],
)
def test_it_parses_verl_console_metric_lines(line: str, expected: Any) -> None:
    assert verl_process.parse_metric_line(line) == expected


def test_it_adds_the_native_runner_metric_names() -> None:
    out = verl_process.with_aliases(
        {"critic/score/mean": 0.5, "actor/ppo_kl": 0.01, "val-core/math/reward/mean@1": 0.7},
        "math",
    )
    assert out["reward/mean"] == 0.5 and out["kl"] == 0.01 and out["eval/reward"] == 0.7
    assert out["critic/score/mean"] == 0.5


def test_a_resumed_attempt_starts_after_the_last_checkpoint_with_stored_metrics(
    tmp_path: Path,
) -> None:
    """verl saved global_step_4 but the worker died before step 4's metrics were stored: the
    next attempt resumes from the registered global_step_2, and verl's marker says so."""
    ctx = _ctx(tmp_path, _spec())
    ckpt = ctx.workdir / "verl" / "checkpoints"
    for step in (2, 4):
        (ckpt / f"global_step_{step}" / "actor").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    assert verl_process.resume_point(ctx, ckpt) == 0
    assert not (ckpt / "global_step_2").exists()

    (ckpt / "global_step_2" / "actor").mkdir(parents=True)
    (ckpt / "global_step_4" / "actor").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    verl_process.register_checkpoint(ctx, ckpt, 2)
    assert verl_process.resume_point(ctx, ckpt) == 2
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert (ckpt / "global_step_2").is_dir() and not (ckpt / "global_step_4").exists()


@pytest.mark.django_db
def test_an_attempt_after_the_last_step_was_saved_only_exports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attempt that saved the last step lost its worker before it ended: verl, resumed
    there, would train a step past the job's `steps`; the next attempt exports instead."""
    spec = _spec(steps=4)
    ctx = _ctx(tmp_path, spec)
    ckpt = ctx.workdir / "verl" / "checkpoints"
    (ckpt / "global_step_4" / "actor").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    verl_process.register_checkpoint(ctx, ckpt, 4)
    exported: list[Path] = []

    def trainer_ran(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("verl's trainer was started again")

    monkeypatch.setattr(verl, "supervise", trainer_ran)
    monkeypatch.setattr(verl, "export_final", lambda _c, _s, where, **_k: exported.append(where))
    verl.run(ctx)
    assert exported == [ckpt]
    assert ctx.events[-1][0] == (
        "verl trained all 4 steps in an earlier attempt: exporting global_step_4"
    )
    assert ctx.heartbeats[-1] == 4


def test_the_next_attempt_kills_what_a_killed_worker_left_and_its_segments(
    tmp_path: Path,
) -> None:
    job_id = f"left-{os.getpid()}"
    left = subprocess.Popen(
        ["sleep", "60"], env={**os.environ, verl_process.JOB_MARKER: job_id},
        start_new_session=True,
    )  # fmt: skip
    segment = verl_process.SHM_DIR / f"ot-test-{job_id}"
    segment.write_bytes(b"x")
    ray_dir = tmp_path / "ray"
    ray_dir.mkdir()
    state = tmp_path / "leftovers.json"
    verl_process.record_leftovers(state, segments={segment.name}, ray_tmpdir=str(ray_dir))
    try:
        # The child carries the marker once it has exec'd; until then /proc shows the
        # environment it forked with.
        deadline = time.monotonic() + 10
        while verl_process.job_processes(job_id) != [left.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert verl_process.job_processes(job_id) == [left.pid]
        cleaned = verl_process.clean_leftovers(job_id, state)
        assert cleaned["killed"] == [left.pid] and cleaned["segments"] == [segment.name]
        assert left.wait(timeout=10) == -9
        assert verl_process.job_processes(job_id) == []
        assert not segment.exists() and not ray_dir.exists() and not state.exists()
    finally:
        left.kill()
        segment.unlink(missing_ok=True)


def test_the_trainer_dies_with_the_worker_process_that_started_it(tmp_path: Path) -> None:
    # A stand-in worker starts a child the way supervise does and is SIGKILLed.
    code = (
        "import os, signal, subprocess, sys; from workers.runners import verl_process as v;"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True,"
        " preexec_fn=v._die_with_parent); print(p.pid, flush=True);"
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
