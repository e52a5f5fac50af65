"""Data-parallel scaling of the native RL job: one rank against two, on this machine.

    .venv/bin/python bench/scale.py [--steps 12] [--write]

Runs the demo's RL job (`workers.management.commands.demo.demo_spec`: 16 prompts x 8 samples
per step on the tiny model, LoRA r8; no evaluation) for `--steps` steps three ways, each rank a
process of its own (the loop's `Collective` on gloo, as the service's ranks):

- 1 rank with 1 torch thread: the baseline, one "GPU";
- 2 ranks with 1 thread each: the same global batch shared by two (what `gpus: 2` does);
- 1 rank with 2 threads: the whole machine to one process, for reference.

It prints the wall time per step, the rollout tokens per second and, for two ranks, the
seconds per step spent in collectives (gradient all-reduce, the metrics' gather, the stop
broadcast): the per-step communication overhead. The figure is the throughput ratio, 2 ranks
/ 1 rank, in the same run. On a two-core machine two ranks have the cores one rank with two
threads has; on a GPU machine each rank is a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rank_main(config: dict[str, Any]) -> None:
    """One rank: train, and (rank 0) write the per-step figures to ``config["out"]``."""
    import django
    import torch

    # The demo's data and spec live in a management command module, which imports models.
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "opentinker_site.settings.local")
    django.setup()
    torch.set_num_threads(int(config["threads"]))
    from bench.jobs import QuietContext
    from jobs.spec import parse_spec
    from training.engine import Engine
    from workers.management.commands.demo import demo_rows, demo_spec
    from workers.runners.distributed import Collective
    from workers.runners.inputs import split_holdout
    from workers.runners.loop import TrainingLoop

    class Recorder(QuietContext):
        def __init__(self, workdir: Path) -> None:
            super().__init__(workdir)
            self.steps: list[dict[str, float]] = []

        def log_metrics(self, step: int, metrics: Any) -> None:
            if step > 0:
                self.steps.append(dict(metrics))

    data = demo_spec("builtin:unused")
    data.update(steps=int(config["steps"]), eval_every=0, checkpoint_every=0, gpus=config["world"])
    spec = parse_spec(data)
    rows, _ = split_holdout(demo_rows(), spec.eval_examples, spec.seed)
    world, rank = int(config["world"]), int(config["rank"])
    collective = None

    def publish(where: str) -> None:
        Path(config["rendezvous"]).write_text(where)

    if world > 1 and rank == 0:
        collective = Collective.host(
            world=world, device="cpu", address="127.0.0.1", publish=publish
        )
    elif world > 1:
        collective = Collective.join(
            rendezvous=config["address"], rank=rank, world=world, device="cpu"
        )
    ctx = Recorder(Path(config["workdir"]))
    loop = TrainingLoop(
        ctx,
        spec,
        Engine(ROOT / "models" / "tiny-chat"),
        rows=rows,
        eval_rows=[],
        policy_id=f"rank{rank}",
        collective=collective,
    )
    started = time.perf_counter()
    try:
        loop.run()
    finally:
        loop.close()
        if collective is not None:
            collective.close()
    if rank == 0:
        wall = time.perf_counter() - started
        Path(config["out"]).write_text(json.dumps({"wall": wall, "steps": ctx.steps}))


def _spawn(config: dict[str, Any]) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_NUM_THREADS=str(config["threads"]))
    return subprocess.Popen(
        [sys.executable, __file__, "--rank-config", json.dumps(config)], cwd=ROOT, env=env
    )


def run(world: int, threads: int, steps: int, tmp: Path) -> dict[str, float]:
    base = {"world": world, "threads": threads, "steps": steps}
    out = tmp / f"out-{world}-{threads}.json"
    rendezvous = tmp / f"rendezvous-{world}-{threads}"
    procs = [
        _spawn(
            {
                **base,
                "rank": 0,
                "workdir": str(tmp / f"w{world}-{threads}-0"),
                "out": str(out),
                "rendezvous": str(rendezvous),
            }
        )
    ]
    if world > 1:
        deadline = time.monotonic() + 120
        while not rendezvous.exists():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise SystemExit("rank 0 did not open its rendezvous")
            time.sleep(0.1)
        address = rendezvous.read_text()
        for rank in range(1, world):
            workdir = str(tmp / f"w{world}-{threads}-{rank}")
            procs.append(_spawn({**base, "rank": rank, "workdir": workdir, "address": address}))
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a rank exited with {proc.returncode}")
    result = json.loads(out.read_text())
    trained = result["steps"]
    tokens = sum(m["sample/tokens"] for m in trained)
    return {
        "wall": result["wall"],
        "step": statistics.median(m["step_time_s"] for m in trained),
        "tokens_per_s": tokens / result["wall"],
        "comm": statistics.median(m.get("dist/comm_seconds", 0.0) for m in trained),
        "episodes": trained[0]["episodes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return
    os.environ.setdefault("OPENTINKER_DATA_DIR", tempfile.mkdtemp(prefix="bench-scale-"))
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for label, world, threads in (
            ("1 rank x 1 thread", 1, 1),
            ("2 ranks x 1 thread", 2, 1),
            ("1 rank x 2 threads", 1, 2),
        ):
            results[label] = run(world, threads, args.steps, Path(tmp))
    load_after = " ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [
        "| ranks x threads | episodes/step | wall | s/step (median) | rollout tokens/s | "
        "collectives s/step (median) |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['episodes']:.0f} | {r['wall']:.1f} s | {r['step']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['comm']:.4f} |"
        )
    one, two = results["1 rank x 1 thread"], results["2 ranks x 1 thread"]
    whole = results["1 rank x 2 threads"]
    ratio = two["tokens_per_s"] / one["tokens_per_s"]
    vs_threads = two["tokens_per_s"] / whole["tokens_per_s"]
    overhead = two["comm"] / two["step"] if two["step"] else 0.0
    table = "\n".join(lines)
    print(table)
    print(
        f"throughput, 2 ranks / 1 rank: {ratio:.2f}x; 2 ranks / 1 rank x 2 threads: "
        f"{vs_threads:.2f}x; collectives {overhead:.1%} of a 2-rank step"
    )
    if args.write:
        from bench.report import write_section

        command = f"python bench/scale.py --steps {args.steps} --write"
        section = f"""## Data-parallel scaling (native RL)

Command: `{command}` ({time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, {os.cpu_count()}
CPU cores, load average {load} before, {load_after} after).

The demo's RL job ({args.steps} steps of 16 prompts x 8 samples, tiny model, LoRA r8), each
rank a process on gloo:

{table}

Throughput, 2 ranks / 1 rank (one thread each): **{ratio:.2f}x**; 2 ranks / one rank with both
threads: {vs_threads:.2f}x. Collectives take {overhead:.1%} of a two-rank step (rank 0's time in them, which
includes waiting for the slower rank to finish its share).
"""
        print(write_section("Data-parallel scaling (native RL)", section))


if __name__ == "__main__":
    main()
