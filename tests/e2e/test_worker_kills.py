"""SIGKILL of a worker's pool child or of its main process during an RL job with checkpoints:
the job ends SUCCEEDED with each metric step exactly once, no GPU lease is left behind, and
the final adapter is bit-identical to that of an undisturbed run with the same seed."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
import zipfile
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors

from jobs.models import JobMetric, JobState
from tests.e2e.test_managed_training import finished, rl_spec, series, steps_of, submit
from tests.fixtures.workers import TEST_LEASE_SECONDS, wait_for
from workers.control import reap
from workers.locktable import GpuLockTable

pytestmark = [pytest.mark.timeout(300), pytest.mark.django_db(transaction=True)]

STEPS = 8
SPEC = rl_spec("builtin:arith_train", steps=STEPS, eval_every=0, checkpoint_every=2, seed=5)


def adapter_tensors(client: Any, job_id: str) -> dict[str, torch.Tensor]:
    artifacts = {a["name"]: a for a in client.get(f"/api/v1/jobs/{job_id}/artifacts").json()}
    download = client.get(artifacts["adapter"]["download"])
    assert download.status_code == 200
    with zipfile.ZipFile(io.BytesIO(b"".join(download.streaming_content))) as zf:
        return load_safetensors(zf.read("adapter_model.safetensors"))


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.parametrize("victim", ["pool-child", "main-process"])
def test_it_finishes_a_killed_workers_job_with_the_undisturbed_adapter(
    trainer: Any, owner_client: Any, clean_control_plane: Any, victim: str
) -> None:
    worker = trainer()
    undisturbed = finished(submit(owner_client, SPEC, name="undisturbed"), 120)
    assert undisturbed.state == JobState.SUCCEEDED, undisturbed.error_message
    expected = adapter_tensors(owner_client, str(undisturbed.pk))

    job_id = submit(owner_client, SPEC, name=victim)
    wait_for(
        lambda: JobMetric.objects.filter(job_id=job_id, name="loss", step__gte=3).exists(),
        90,
        "step 3",
    )
    struck = time.monotonic()
    if victim == "pool-child":
        # The OOM killer's usual pick: the process running the job. The worker's main process
        # replaces it; the job's lease lapses and the reaper requeues it onto this worker.
        for child in children_of(worker.proc.pid):
            os.kill(child, signal.SIGKILL)
    else:
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.kill()  # whatever of its group outlived it goes too: the machine's worker is gone
        trainer()
    wait_for(
        lambda: job_id in reap()["requeued"] or finished_state(job_id),
        TEST_LEASE_SECONDS * 4 + 30,
        "the reaper to requeue the job",
    )
    requeued_after = time.monotonic() - struck
    job = finished(job_id, 180)
    took = time.monotonic() - struck
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
    assert job.attempt == 2  # the kill cost one attempt, and only one
    assert steps_of(series(owner_client, job_id)["loss"]) == list(range(1, STEPS + 1))
    # The attempt writes its final state, then gives the GPUs back.
    table = GpuLockTable(clean_control_plane)
    wait_for(lambda: table.lease_of(job_id) is None, 30, "the job's lease to be released")
    got = adapter_tensors(owner_client, job_id)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected), "adapters differ"
    print(f"{victim}: requeued {requeued_after:.1f} s and SUCCEEDED {took:.1f} s after the kill")


def finished_state(job_id: str) -> bool:
    from jobs.models import FINAL_STATES, Job

    return Job.objects.filter(pk=job_id, state__in=FINAL_STATES).exists()
