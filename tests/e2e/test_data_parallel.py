"""Data-parallel ranks of the native loop: two gloo ranks in two processes train exactly the
run one process trains on the same global batch and seed.

Rank 0 runs in this test process (it hosts the rendezvous store); rank 1 is a child process
running this module as a script. No Django and no worker: the Celery launch of the same ranks
is tested in tests/workers/test_gang_training.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from jobs.spec import parse_spec
from tests.e2e.rows import addition_rows
from tests.e2e.test_training_loop import Recorder
from training.engine import Engine
from workers.runners.distributed import Collective, PeerLost
from workers.runners.loop import TrainingLoop

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]

RL = {
    "method": "rl",
    "env": "math",
    "dataset": "builtin:unused",
    "steps": 5,
    "seed": 5,
    "checkpoint_every": 0,
    "gpus": 2,
    "gpus_per_node": 1,
    "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 16},
    "lora": {"rank": 4, "alpha": 8},
    "optimizer": {"lr": 2e-3},
}
SFT = {
    "method": "sft",
    "env": "math",
    "dataset": "builtin:unused",
    "steps": 3,
    "batch_size": 6,
    "checkpoint_every": 0,
    "gpus": 2,
    "lora": {"rank": 4, "alpha": 8},
}
# Summation order differs (each rank sums its share, then the ranks are summed): float noise.
TOLERANCE = 1e-4


def run_rank(
    data: dict[str, Any],
    workdir: Path,
    model_dir: Path,
    *,
    rank: int = 0,
    world: int = 1,
    rendezvous: str | None = None,
    publish: Any = None,
) -> Recorder:
    torch.set_num_threads(1)
    spec = parse_spec(data)
    ctx = Recorder(workdir)
    collective = None
    if world > 1 and rank == 0:
        collective = Collective.host(
            world=world, device="cpu", address="127.0.0.1", publish=publish, timeout_s=60
        )
    elif world > 1:
        assert rendezvous is not None
        collective = Collective.join(
            rendezvous=rendezvous, rank=rank, world=world, device="cpu", timeout_s=60
        )
    engine = Engine(model_dir)
    loop = TrainingLoop(
        ctx,
        spec,
        engine,
        rows=addition_rows(200),
        eval_rows=addition_rows(8, 300),
        policy_id=f"rank{rank}",
        collective=collective,
    )
    try:
        assert loop.run() is True
    finally:
        loop.close()
        if collective is not None:
            collective.close()
    return ctx


def two_ranks(data: dict[str, Any], tmp_path: Path, model_dir: Path) -> Recorder:
    """Rank 0 here, rank 1 in a child; returns rank 0's record (the whole batch's metrics)."""
    child: subprocess.Popen[bytes] | None = None

    def publish(where: str) -> None:
        nonlocal child
        args = [json.dumps(data), str(tmp_path / "rank1"), str(model_dir), where]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        module = "tests.e2e.test_data_parallel"
        child = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env)

    try:
        record = run_rank(data, tmp_path / "rank0", model_dir, world=2, publish=publish)
    finally:
        if child is not None:
            assert child.wait(timeout=60) == 0
    return record


@pytest.mark.parametrize("data", [RL, SFT], ids=["rl", "sft"])
def test_two_ranks_train_what_one_process_trains_on_the_same_global_batch(
    data: dict[str, Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    one = run_rank(data, tmp_path / "one", tiny_model_dir)
    two = two_ranks(data, tmp_path / "two", tiny_model_dir)
    steps = list(range(1, data["steps"] + 1))
    assert sorted(two.metrics) == steps == sorted(one.metrics)
    names = ["loss", "grad_norm"] + (["reward/mean", "entropy"] if data["method"] == "rl" else [])
    for step in steps:
        assert two.metrics[step]["dist/ranks"] == 2
        for name in names:
            assert two.metrics[step][name] == pytest.approx(
                one.metrics[step][name], rel=TOLERANCE, abs=TOLERANCE
            ), (step, name)
    if data["method"] == "rl":
        assert two.metrics[1]["episodes"] == one.metrics[1]["episodes"] == 16
        assert any(one.metrics[s]["datums"] > 0 for s in steps)
    # Rank 0 alone exports; its adapter is the single process's.
    a = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "two" / "rank0" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-5)
    assert not (tmp_path / "two" / "rank1" / "adapter").exists()
    assert any(float(t.abs().sum()) > 0 for k, t in a.items() if "lora_B" in k)


def test_a_rank_that_never_comes_fails_the_rendezvous_with_peer_lost() -> None:
    with pytest.raises(PeerLost, match="did not all join"):
        Collective.host(
            world=2, device="cpu", address="127.0.0.1", publish=lambda _: None, timeout_s=3
        )


if __name__ == "__main__":
    # Rank 1 of `two_ranks`: spec JSON, workdir, model dir, rank 0's "host:port".
    spec_json, workdir, model_dir, rendezvous = sys.argv[1:5]
    run_rank(
        json.loads(spec_json),
        Path(workdir),
        Path(model_dir),
        rank=1,
        world=2,
        rendezvous=rendezvous,
    )
