"""Pipelined RL: the demo's RL job with rollouts on-policy (0) and one step off-policy (1).

    .venv/bin/python bench/pipeline.py [--steps 200] [--threads 2] [--write]

Runs the native training loop in-process on the tiny model with the demo's spec
(`workers.management.commands.demo.demo_spec`: 600 additions of the pre-training split, 100
held out, 16 prompts x 8 samples per step, greedy held-out evaluation before and after), once
with `rollout.max_off_policy_steps` 0 (every step samples the weights the previous step ended
with) and once with 1 (step k+1's rollouts are sampled on a second thread while step k
trains). It prints, for each, the wall time per step, how long the trainer waited for its
rollouts, and the held-out accuracy before and after; the ratio of the two wall times is the
figure. Both runs share the machine's cores: on CPU the sampler and the trainer compete for
them, which is what this measures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.jobs import QuietContext


class Recorder(QuietContext):
    """bench/jobs.py's context without a service, keeping every step's metrics."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.metrics: dict[int, dict[str, float]] = {}

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.metrics.setdefault(step, {}).update(metrics)


def run(ahead: int, steps: int, workdir: Path) -> dict[str, float]:
    from jobs.spec import parse_spec
    from training.engine import Engine
    from workers.management.commands.demo import demo_rows, demo_spec
    from workers.runners.inputs import split_holdout
    from workers.runners.loop import TrainingLoop

    data = demo_spec("builtin:unused")
    data["steps"] = steps
    data["eval_every"] = steps
    data["checkpoint_every"] = 0
    data["rollout"]["max_off_policy_steps"] = ahead
    spec = parse_spec(data)
    rows, eval_rows = split_holdout(demo_rows(), spec.eval_examples, spec.seed)
    ctx = Recorder(workdir)
    engine = Engine(ROOT / "models" / "tiny-chat")
    loop = TrainingLoop(ctx, spec, engine, rows=rows, eval_rows=eval_rows, policy_id=f"p{ahead}")
    started = time.perf_counter()
    try:
        loop.run()
    finally:
        loop.close()
    wall = time.perf_counter() - started
    trained = [ctx.metrics[s] for s in range(1, steps + 1)]
    return {
        "wall": wall,
        "step": statistics.median(m["step_time_s"] for m in trained),
        "wait": statistics.median(m["sample/wait_seconds"] for m in trained),
        "sample": statistics.median(m["sample/seconds"] for m in trained),
        "train": statistics.median(m["train/seconds"] for m in trained),
        "before": ctx.metrics[0]["eval/accuracy"],
        "after": ctx.metrics[steps]["eval/accuracy"],
        "reward_last10": statistics.mean(m["reward/mean"] for m in trained[-10:]),
        "behind": max(m["rollout/off_policy_steps"] for m in trained),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the worker's)")
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    # The demo's data and spec live in a management command module, which imports models.
    os.environ.setdefault("OPENTINKER_DATA_DIR", tempfile.mkdtemp(prefix="bench-pipeline-"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.local")
    import django
    import torch

    django.setup()
    torch.set_num_threads(args.threads)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    # Imports, the model's first load and oneDNN's first kernels are paid here, not by run 0.
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-warm-") as tmp:
        run(1, 2, Path(tmp))
    results = {}
    for ahead in (0, 1):
        with tempfile.TemporaryDirectory(prefix=f"bench-pipeline-{ahead}-") as tmp:
            results[ahead] = run(ahead, args.steps, Path(tmp))
    load_after = " ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [
        "| max_off_policy_steps | wall | s/step (median) | waited for rollouts | sampling | "
        "training | held-out accuracy | train reward, last 10 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ahead, r in results.items():
        lines.append(
            f"| {ahead} | {r['wall']:.0f} s | {r['step']:.3f} | {r['wait']:.3f} s | "
            f"{r['sample']:.3f} s | {r['train']:.3f} s | {r['before']:.3f} -> {r['after']:.3f} | "
            f"{r['reward_last10']:.3f} |"
        )
    ratio = results[1]["wall"] / results[0]["wall"]
    # The median step is less exposed than the wall time to load that comes and goes.
    step_ratio = results[1]["step"] / results[0]["step"]
    gain0 = results[0]["after"] - results[0]["before"]
    gain1 = results[1]["after"] - results[1]["before"]
    table = "\n".join(lines)
    print(table)
    print(f"wall time, off-policy 1 / on-policy: {ratio:.3f}; median step: {step_ratio:.3f}")
    print(f"held-out gain: {gain0:+.3f} (0) vs {gain1:+.3f} (1)")
    if args.write:
        from bench.report import write_section

        command = f"python bench/pipeline.py --steps {args.steps} --threads {args.threads} --write"
        section = f"""## Pipelined RL

Command: `{command}` ({time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, {os.cpu_count()}
CPU cores, {args.threads} torch threads, load average {load} before, {load_after} after).

The demo's RL job in-process ({args.steps} steps of 16 prompts x 8 samples, tiny model, LoRA
r8), with `rollout.max_off_policy_steps` 0 and 1 in the same run:

{table}

Wall time, 1 / 0: {ratio:.3f}; median step time, 1 / 0: **{step_ratio:.3f}**. Held-out gain: {gain0:+.3f} (0) and {gain1:+.3f} (1).
"""
        print(write_section("Pipelined RL", section, keep_subsections=True))


if __name__ == "__main__":
    main()
