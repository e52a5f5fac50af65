"""``manage.py demo``: from nothing to a trained policy, through the public HTTP API.

Creates (or reuses) a demo user, team and quota, issues an API key and prints it, starts
``manage.py serve`` in the background unless ``--url`` points at a running service, uploads
the demo dataset (2-digit additions; 100 held out of training), submits an RL
job on the tiny model with the ``math`` env and follows it, printing each step's reward and
accuracy, and the held-out accuracy before (step 0) and after training. ``--smoke`` runs the
built-in smoke job instead, ``--spec`` any JobSpec. Exits 0 when the job SUCCEEDED.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from accounts.keys import issue_key
from accounts.models import Membership, Team
from opentinker_site import embedded
from training import data
from workers.processes import stop_process_group

DEMO_USER = "demo"
DEMO_TEAM = "demo"
DEMO_DATASET = "demo-addition"
FINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
# Shown per step, in this order, under these names; other metrics are left to the API.
SHOWN = {
    "reward/mean": "reward",
    "accuracy": "accuracy",
    "eval/accuracy": "held-out accuracy",
    "loss": "loss",
    "step_time_s": "seconds",
}


def demo_rows() -> list[dict[str, str]]:
    """600 of the additions the tiny model was pre-trained on, in the math env's schema.

    RL sharpens what pre-training half taught: the job trains on 500 of them and holds out
    the other 100 (a seeded split), on which it measures accuracy before and after.
    """
    train = data.addition_split()[0][:600]
    return [{"question": p.question(i), "answer": str(p.answer)} for i, p in enumerate(train)]


def demo_spec(dataset: str = DEMO_DATASET) -> dict[str, Any]:
    """The demo's RL job. Sizes and learning rate were picked by measurement (docs/benchmarks.md,
    "Managed jobs"): a higher rate (2e-3) or a smaller batch collapses or stalls the held-out
    accuracy. Evaluation at step 0 and at the end gives the held-out accuracy before and after."""
    steps = 200
    return {
        "method": "rl",
        "base_model": "tiny",
        "env": "math",
        "dataset": dataset,
        "steps": steps,
        "seed": 1,
        "rollout": {"group_size": 8, "prompts_per_step": 16, "max_tokens": 16},
        "algorithm": {"advantage": "grpo", "normalize_std": True},
        "lora": {"rank": 8, "alpha": 16},
        "optimizer": {"lr": 1e-3},
        "eval_every": steps,
        "eval_examples": 100,
        "checkpoint_every": 50,
    }


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise CommandError("no free TCP port")


def demo_key() -> tuple[str, str]:
    """(team slug, plaintext key): the demo user and team, created once, and a new key."""
    with transaction.atomic():
        user, created = get_user_model().objects.get_or_create(username=DEMO_USER)
        if created:
            user.set_unusable_password()
            user.save()
        team, _ = Team.objects.get_or_create(slug=DEMO_TEAM, defaults={"name": "Demo"})
        Membership.objects.get_or_create(
            user=user, team=team, defaults={"role": Membership.Role.OWNER}
        )
        quota = team.quota
        quota.max_gpus = max(quota.max_gpus, 2)
        quota.max_queued_jobs = max(quota.max_queued_jobs, 20)
        quota.save()
        _, plaintext = issue_key(team, user, f"demo {time.strftime('%Y-%m-%d %H:%M:%S')}")
    return team.slug, plaintext


def _stopped_by_signal(signum: int, frame: Any) -> None:
    raise CommandError(f"stopped by {signal.Signals(signum).name}")


def _serve_env() -> dict[str, str]:
    """The service's environment: without the embedded Valkey this process started, which
    stops when it exits, so that a service left running (`--keep-serving`) starts and owns
    its own."""
    env = dict(os.environ)
    owned = embedded.owned_url()
    if owned is not None and env.get("REDIS_URL") == owned:
        del env["REDIS_URL"]
    return env


class Command(BaseCommand):
    help = "Create a demo user, team and API key, start the service, run a demo job to the end."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", help="A running service; default: start `serve` here.")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--key", help="Use this API key instead of issuing a demo key.")
        parser.add_argument(
            "--spec",
            help="A JobSpec as JSON to submit instead of the demo RL job.",
        )
        parser.add_argument(
            "--smoke",
            action="store_true",
            help="Run the built-in smoke job (no model) instead of the RL job.",
        )
        parser.add_argument("--steps", type=int, default=8, help="Steps of the smoke job.")
        parser.add_argument(
            "--step-seconds", type=float, default=0.5, help="Seconds per smoke job step."
        )
        parser.add_argument(
            "--timeout", type=float, default=1800.0, help="Seconds to wait for the job."
        )
        parser.add_argument(
            "--keep-serving", action="store_true", help="Leave the service running afterwards."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # SIGTERM unwinds like Ctrl-C: the service this command started is stopped with it.
        signal.signal(signal.SIGTERM, _stopped_by_signal)
        logging.getLogger("httpx").setLevel(logging.WARNING)
        server: subprocess.Popen[bytes] | None = None
        url = options["url"]
        if url is None:
            call_command("migrate", interactive=False, verbosity=0)
        key = options["key"]
        if not key:
            team, key = demo_key()
            self.stdout.write(f"demo user '{DEMO_USER}', team '{team}', API key (shown once):")
            self.stdout.write(f"  {key}")
        try:
            if url is None:
                port = free_port(options["port"])
                url = f"http://127.0.0.1:{port}"
                log_path = Path(settings.OPENTINKER_DATA_DIR) / "serve.log"
                with open(log_path, "ab") as log_file:
                    server = subprocess.Popen(
                        [
                            sys.executable,
                            str(settings.BASE_DIR / "manage.py"),
                            "serve",
                            "--port",
                            str(port),
                            "--no-migrate",
                        ],
                        env=_serve_env(),
                        cwd=settings.BASE_DIR,
                        start_new_session=True,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                    )
                self.stdout.write(f"started the service at {url} (log: {log_path})")
            url = url.rstrip("/")
            with httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
            ) as client:
                self._wait_up(client, server, options["timeout"])
                state = self._run_demo_job(client, options)
        finally:
            if server is not None and not options["keep_serving"]:
                self.stdout.write("stopping the service")
                stop_process_group(server, grace_s=30)
        if state != "SUCCEEDED":
            raise CommandError(f"the demo job ended {state}")
        self.stdout.write(self.style.SUCCESS("demo job SUCCEEDED"))

    def _wait_up(self, client: Any, server: subprocess.Popen[bytes] | None, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server is not None and server.poll() is not None:
                raise CommandError(
                    f"the service exited with status {server.returncode}; see its log"
                )
            try:
                if client.get("/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise CommandError(f"the service did not answer within {timeout:.0f} s")

    def _upload_dataset(self, client: Any) -> None:
        """The demo dataset, uploaded once per team through the API."""
        found = client.get("/api/v1/datasets", params={"name": DEMO_DATASET})
        if found.status_code == 200 and found.json().get("results"):
            return
        body = "".join(json.dumps(r) + "\n" for r in demo_rows()).encode()
        response = client.post(
            "/api/v1/datasets",
            files={"file": ("addition.jsonl", body, "application/jsonl")},
            data={"name": DEMO_DATASET, "env": "math"},
        )
        if response.status_code not in (201, 409):
            raise CommandError(
                f"dataset upload failed: HTTP {response.status_code} {response.text}"
            )
        self.stdout.write(f"uploaded dataset {DEMO_DATASET!r} ({len(demo_rows())} rows)")

    def _run_demo_job(self, client: Any, options: dict[str, Any]) -> str:
        if options["spec"]:
            try:
                spec = json.loads(options["spec"])
            except json.JSONDecodeError as exc:
                raise CommandError(f"--spec is not valid JSON: {exc}") from exc
            if not isinstance(spec, dict):
                raise CommandError("--spec must be a JSON object")
        elif options["smoke"]:
            spec = {
                "method": "smoke",
                "smoke_steps": options["steps"],
                "smoke_step_seconds": options["step_seconds"],
            }
        else:
            spec = demo_spec()
        if spec.get("dataset") == DEMO_DATASET:
            self._upload_dataset(client)
        response = client.post("/api/v1/jobs", json={"name": "demo", "spec": spec})
        if response.status_code != 201:
            raise CommandError(f"submit failed: HTTP {response.status_code} {response.text}")
        job = response.json()
        job_id = job["id"]
        self.stdout.write(f"submitted job {job_id} (method {spec.get('method')})")
        state, last_step = "", -1
        deadline = time.monotonic() + options["timeout"]
        while time.monotonic() < deadline:
            job = client.get(f"/api/v1/jobs/{job_id}").json()
            if job["state"] != state:
                state = job["state"]
                where = f" on {job.get('node')}" if job.get("node") else ""
                self.stdout.write(f"  state {state}{where} (attempt {job.get('attempt')})")
            last_step = self._print_metrics(client, job_id, last_step)
            if state in FINAL:
                if job.get("error_message"):
                    self.stdout.write(f"  error: {job['error_code']}: {job['error_message']}")
                self._print_heldout(client, job_id)
                return state
            time.sleep(0.5)
        raise CommandError(f"job {job_id} still {state} after {options['timeout']:.0f} s")

    def _print_metrics(self, client: Any, job_id: str, last_step: int) -> int:
        series = client.get(
            f"/api/v1/jobs/{job_id}/metrics", params={"since_step": last_step + 1}
        ).json()["series"]
        by_step: dict[int, dict[str, float]] = {}
        for name, points in series.items():
            for step, value in points:
                by_step.setdefault(int(step), {})[name] = value
        for step in sorted(by_step):
            values = by_step[step]
            if any(name in values for name in SHOWN):
                shown = ", ".join(
                    f"{label}={values[name]:.3g}" for name, label in SHOWN.items() if name in values
                )
            else:
                shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(values.items()))
            self.stdout.write(f"  step {step}: {shown}")
            last_step = max(last_step, step)
        return last_step

    def _print_heldout(self, client: Any, job_id: str) -> None:
        """Held-out accuracy before (step 0) and after (last evaluation), when evaluated."""
        points = (
            client.get(f"/api/v1/jobs/{job_id}/metrics", params={"name": "eval/accuracy"})
            .json()["series"]
            .get("eval/accuracy", [])
        )
        if len(points) < 2 or int(points[0][0]) != 0:
            return
        before, (step, after) = points[0][1], points[-1]
        self.stdout.write(
            f"held-out accuracy: {before:.3f} before training -> {after:.3f} after "
            f"{int(step)} steps ({after - before:+.3f})"
        )
