"""The service as deployed, on this machine, for the Tinker API benchmarks (bench/tinker_api.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The base model's name in the benchmark's database.
BASE = "tiny-tinker"


class Stack:
    """The service as deployed, on this machine: web server and model worker in processes
    of their own, SQLite + embedded Valkey in a throw-away data directory."""

    def __init__(
        self,
        threads: int,
        web_threads: int,
        wal: bool = True,
        device: str = "cpu",
        base_path: str | Path | None = None,
    ) -> None:
        """``base_path``: the directory of the model registered as ``BASE`` (the tiny model
        by default)."""
        self.device = device
        self.base_path = base_path
        self.threads = threads
        self.web_threads = web_threads
        self.wal = wal
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.url = ""
        self.key = ""
        self.data_dir = ""

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log_path = Path(os.environ["OPENTINKER_DATA_DIR"]) / f"{name}.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        self.logs.append(log_path)
        return proc

    def _wait(self, predicate: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc, log_path in zip(self.procs, self.logs, strict=True):
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise SystemExit(f"{log_path.name}: exited with {proc.returncode}\n{tail}")
            if predicate():
                return
            time.sleep(0.1)
        raise SystemExit(f"timed out waiting for {what}")

    def start(self) -> None:
        data_dir = self.data_dir = tempfile.mkdtemp(prefix="opentinker-bench-")
        os.environ["OPENTINKER_DATA_DIR"] = data_dir
        os.environ["DATABASE_URL"] = f"sqlite:///{data_dir}/db.sqlite3"
        os.environ["DJANGO_SETTINGS_MODULE"] = "opentinker_site.settings.local"
        os.environ["DEBUG"] = "0"
        os.environ["TINKER_TELEMETRY"] = "0"
        import django

        django.setup()  # starts the embedded Valkey and exports REDIS_URL to the children
        from django.contrib.auth import get_user_model
        from django.core.management import call_command

        call_command("migrate", interactive=False, verbosity=0)
        if self.wal:
            from django.db import connection

            # Persistent in the file: every process of the stack commits through the WAL.
            with connection.cursor() as cursor:
                cursor.execute("PRAGMA journal_mode=WAL")
        from accounts.keys import issue_key
        from accounts.models import Membership, Team
        from jobs.models import BaseModel
        from training.model import DEFAULT_BASE_MODEL
        from workers import conf
        from workers.locktable import GpuLockTable

        base_path = str(self.base_path or DEFAULT_BASE_MODEL)
        if not (Path(base_path) / "config.json").is_file():
            hint = "" if self.base_path else ": run scripts/build_tiny_model.py"
            raise SystemExit(f"{base_path} is missing{hint}")
        BaseModel.objects.update_or_create(
            name=BASE, defaults={"path": base_path, "max_lora_rank": 64, "max_context": 512}
        )
        slug = f"bench-{uuid.uuid4().hex[:6]}"
        user = get_user_model().objects.create_user(username=slug, password=uuid.uuid4().hex)
        team = Team.objects.create(name=slug, slug=slug)
        Membership.objects.create(user=user, team=team, role="owner")
        _key, plaintext = issue_key(team, user, "bench")
        self.key = "tml-" + plaintext

        env = dict(os.environ)
        env.update(
            OPENTINKER_NODE_NAME="bench",
            OPENTINKER_TINKER_TORCH_THREADS=str(self.threads),
            OPENTINKER_TINKER_WORKER_IDLE_SECONDS="3600",
            OPENTINKER_TINKER_LONG_POLL_SECONDS="5",
            PYTHONUNBUFFERED="1",
        )
        if self.device == "cpu":
            env.update(OPENTINKER_CPU_SLOTS="1", OPENTINKER_GPUS="", CUDA_VISIBLE_DEVICES="")
        else:
            # The device the in-process side uses, named, rather than found by nvidia-smi.
            index = self.device.partition(":")[2] or "0"
            env.setdefault("OPENTINKER_GPUS", index)
        # The gpu queue's Celery worker: the first request for the base model starts the
        # model worker task (tinker_api.serve_base_model) in its pool process.
        worker = [sys.executable, "manage.py", "runworker", "--node", "bench", "--queues", "gpu"]
        self._spawn("worker", [*worker, "--no-beat", "--loglevel", "WARNING"], env)
        table = GpuLockTable(conf.get_redis())
        self._wait(lambda: bool(table.nodes().get("bench", {}).get("alive")), "the gpu worker")
        kind = table.nodes()["bench"]["kind"]
        if kind != ("cpu" if self.device == "cpu" else "gpu"):
            raise RuntimeError(
                f"the worker announced {kind} slots for --device {self.device}: the model "
                "worker and the in-process side would not run on the same device"
            )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # Threads, not sync workers: every SDK future holds a long poll open.
        web = [
            *(sys.executable, "-m", "gunicorn", "opentinker_site.wsgi:application"),
            *("--bind", f"127.0.0.1:{port}", "--workers", "1", "--worker-class", "gthread"),
            *("--threads", str(self.web_threads), "--log-level", "warning"),
        ]
        if Path("/dev/shm").is_dir():
            # gunicorn's advice in containers: its per-worker heartbeat file in memory.
            web += ["--worker-tmp-dir", "/dev/shm"]
        self._spawn("web", web, env)
        self.url = f"http://127.0.0.1:{port}/"

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(self.url + "api/v1/healthz", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False

        self._wait(healthy, "the web server")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                # The model worker task serves until idle: a warm shutdown would wait for it.
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
