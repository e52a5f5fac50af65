"""Faults on the service as ``manage.py serve`` runs it (SQLite, embedded Valkey, one worker,
the web server), each during a running RL job with checkpoints: SIGKILL of the web server and
SIGKILL of the embedded Valkey (which keeps nothing: it comes back empty). Every job ends
SUCCEEDED with each metric step exactly once, the adapter bit-identical to the undisturbed
run's, and no GPU lease left behind.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import redis
import torch
from safetensors.torch import load as load_safetensors

from tests.e2e.test_managed_training import rl_spec
from tests.fixtures.served import ROOT, embedded_env, free_port, start_manage
from tests.fixtures.workers import wait_for
from workers.locktable import GpuLockTable
from workers.processes import group_alive

# The service under test is its own (its own Valkey and SQLite): the pass against PostgreSQL
# and Redis would run the very same thing again.
pytestmark = [pytest.mark.live, pytest.mark.once, pytest.mark.timeout(600)]

STEPS = 30
SPEC = rl_spec("builtin:arith_train", steps=STEPS, eval_every=0, checkpoint_every=5, seed=5)
FINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
KEY_ARGS = ("--user", "chaos", "--team", "chaos", "--create")


@dataclass
class Service:
    proc: subprocess.Popen[bytes]
    data_dir: Path
    log_path: Path
    api: httpx.Client

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid_of(self, part: str) -> int:
        found = re.findall(rf"(?:started|restarted) {part} \(pid (\d+)\)", self.log())
        assert found, self.log()
        return int(found[-1])

    def valkey_pid(self) -> int:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid), "-f", "valkey"],
            capture_output=True,
            text=True,
            check=False,
        )
        pids = [int(p) for p in out.stdout.split()]
        assert len(pids) == 1, (pids, self.log())
        return pids[0]

    def redis(self) -> redis.Redis:
        password = (self.data_dir / "valkey" / "password").read_text().strip()
        port = re.findall(r"Redis [\w.]+:(\d+)", self.log())[0]
        return redis.Redis.from_url(f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0")

    def healthy(self) -> bool:
        try:
            return self.api.get("/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def submit(self, name: str) -> str:
        response = self.api.post("/api/v1/jobs", json={"name": name, "spec": SPEC})
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.api.get(f"/api/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def finished(self, job_id: str, timeout: float) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            try:
                job = self.job(job_id)
            except httpx.HTTPError:  # the web server is being restarted
                return None
            return job if job["state"] in FINAL else None

        return wait_for(done, timeout, f"job {job_id} to end; log:\n{self.log()[-3000:]}")

    def steps(self, job_id: str, name: str = "loss") -> list[int]:
        series = self.api.get(f"/api/v1/jobs/{job_id}/metrics").json()["series"]
        return [int(step) for step, _ in series.get(name, [])]

    def reached(self, job_id: str, step: int) -> bool:
        try:
            return max(self.steps(job_id), default=0) >= step
        except httpx.HTTPError:
            return False

    def adapter(self, job_id: str) -> dict[str, torch.Tensor]:
        artifacts = {a["name"]: a for a in self.api.get(f"/api/v1/jobs/{job_id}/artifacts").json()}
        download = self.api.get(artifacts["adapter"]["download"], follow_redirects=True)
        assert download.status_code == 200, download.text[:500]
        with zipfile.ZipFile(io.BytesIO(download.content)) as zf:
            return load_safetensors(zf.read("adapter_model.safetensors"))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    data_dir = tmp_path_factory.mktemp("served")
    port = free_port()
    env = embedded_env(
        data_dir,
        "chaos",
        OPENTINKER_VALKEY_DIR=str(data_dir / "valkey"),
        OPENTINKER_CPU_SLOTS="1",
        # Short leases: a job whose lease vanished with the Valkey is requeued in seconds.
        OPENTINKER_JOB_LEASE_SECONDS="3",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    log_path = data_dir / "serve.log"
    proc = start_manage(["serve", "--port", str(port)], env, log_path)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    served = Service(proc, data_dir, log_path, api)
    try:
        wait_for(served.healthy, 120, f"the web server; log:\n{served.log()}")
        key = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "issue_api_key", *KEY_ARGS],
            env=env | _redis_env(served),
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        api.headers["Authorization"] = f"Bearer {key}"
        yield served
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        api.close()


def _redis_env(served: Service) -> dict[str, str]:
    kwargs = served.redis().connection_pool.connection_kwargs
    password = quote(str(kwargs["password"]), safe="")
    return {"REDIS_URL": f"redis://:{password}@127.0.0.1:{kwargs['port']}/0"}


@pytest.fixture(scope="module")
def undisturbed(service: Service) -> dict[str, torch.Tensor]:
    job = service.finished(service.submit("undisturbed"), 180)
    assert job["state"] == "SUCCEEDED", (job, service.log()[-3000:])
    return service.adapter(job["id"])


def _kill_web(service: Service) -> None:
    web = service.pid_of("web")
    os.kill(web, signal.SIGKILL)
    wait_for(lambda: service.pid_of("web") != web, 30, "the web server's restart")
    assert not group_alive(web)


def _kill_valkey(service: Service) -> None:
    os.kill(service.valkey_pid(), signal.SIGKILL)
    wait_for(lambda: "the embedded Valkey died" in service.log(), 30, "the Valkey's restart")


@pytest.mark.parametrize("fault", [_kill_web, _kill_valkey], ids=["web-server", "valkey"])
def test_a_job_survives_a_killed_part_with_the_undisturbed_adapter(
    service: Service, undisturbed: dict[str, torch.Tensor], fault: Any
) -> None:
    job_id = service.submit(fault.__name__)
    wait_for(lambda: service.reached(job_id, 3), 120, "step 3")
    at_fault = max(service.steps(job_id))
    struck = time.monotonic()
    fault(service)
    wait_for(service.healthy, 60, "the web server after the fault")
    # A step past the last one seen before the fault: the job carried on or resumed.
    wait_for(lambda: service.reached(job_id, at_fault + 1), 120, "a step after the fault")
    resumed = time.monotonic() - struck
    job = service.finished(job_id, 240)
    took = time.monotonic() - struck
    assert job["state"] == "SUCCEEDED", (job, service.log()[-4000:])
    assert service.steps(job_id) == list(range(1, STEPS + 1))
    table = GpuLockTable(service.redis())
    wait_for(lambda: table.lease_of(job_id) is None, 30, "the lease's release")
    got = service.adapter(job_id)
    assert got.keys() == undisturbed.keys()
    assert all(torch.equal(got[k], undisturbed[k]) for k in undisturbed), "adapters differ"
    print(
        f"{fault.__name__}: attempt {job['attempt']}, a new step {resumed:.1f} s and "
        f"SUCCEEDED {took:.1f} s after the fault"
    )
