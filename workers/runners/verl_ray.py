"""verl across nodes: a Ray cluster of the job's own, one Ray node per member of its gang.

On one node verl's driver starts Ray itself (``ray.init`` inside ``main_ppo``). A gang needs
the cluster first: the leader starts a Ray head (``ray start --head --block``) on a free port
of its node address and publishes "host:port" (``workers.gang.publish_rendezvous``); each
follower's ``join_job`` runs ``ray start --address=... --block`` with its GPUs and the same
environment as the trainer (verl's workers on that node are its raylet's children); the leader
waits until every node is up, then runs ``main_ppo`` with ``ray_kwargs.ray_init.address`` and
``trainer.nnodes``. Ray's own processes start in sessions of their own: each member marks them
(``JOB_MARKER``) and kills what carries its mark when it ends. A follower's raylet also ends
by itself a few seconds after the head has gone.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from workers.processes import stop_process_group
from workers.runners.verl_process import tool_python

__all__ = [
    "TOKEN_ENV",
    "RayNode",
    "auth_env",
    "free_port",
    "parse_rendezvous",
    "rendezvous",
    "start_head",
    "start_worker",
    "wait_for_nodes",
]

TOKEN_ENV = "RAY_AUTH_TOKEN"


def auth_env(token: str) -> dict[str, str]:
    """Ray's token authentication with ``token`` (without it Ray 2.60 enables token auth on
    its own once a token file exists in the home directory, and a member without that file
    is refused)."""
    return {"RAY_AUTH_MODE": "token", TOKEN_ENV: token}


def rendezvous(address: str, token: str) -> str:
    """What the leader publishes for its followers: the token and the head's address."""
    return f"{token}@{address}"


def parse_rendezvous(published: str) -> tuple[str, str]:
    token, _, address = published.rpartition("@")
    return address, token


# Seconds a follower's raylet keeps trying to reach a head that went away before it exits.
GCS_RECONNECT_SECONDS = 5
_NODES_SCRIPT = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(sum(1 for n in ray.nodes() if n["Alive"]))
"""


def free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def _ray() -> list[str]:
    python = tool_python()
    if python is None:
        raise RuntimeError("verl across nodes needs the verl venv (make verl-env)")
    return [python, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


class RayNode:
    """A ``ray start --block`` process of this member, stopped with its process group."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log_path: Path) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                env=dict(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.alive():
            stop_process_group(self.proc, grace_s=10)


def _resources(gpus: int, cpus: int) -> list[str]:
    return [f"--num-gpus={gpus}", f"--num-cpus={cpus}", "--disable-usage-stats"]


def start_head(
    *, address: str, gpus: int, cpus: int, env: Mapping[str, str], log_path: Path
) -> tuple[RayNode, str]:
    """The job's Ray head on this node; returns it and the address the others join."""
    port = free_port(address)
    argv = [
        *_ray(),
        "start",
        "--head",
        "--block",
        f"--node-ip-address={address}",
        f"--port={port}",
        "--include-dashboard=false",
        *_resources(gpus, cpus),
    ]
    return RayNode(argv, env, log_path), f"{address}:{port}"


def start_worker(
    *, head: str, address: str, gpus: int, cpus: int, env: Mapping[str, str], log_path: Path
) -> RayNode:
    argv = [
        *_ray(),
        "start",
        f"--address={head}",
        "--block",
        f"--node-ip-address={address}",
        *_resources(gpus, cpus),
    ]
    env = {**env, "RAY_gcs_rpc_server_reconnect_timeout_s": str(GCS_RECONNECT_SECONDS)}
    return RayNode(argv, env, log_path)


def wait_for_nodes(
    head: str,
    count: int,
    *,
    env: Mapping[str, str],
    timeout_s: float,
    still_wanted: Callable[[], bool],
) -> int:
    """Poll the cluster until ``count`` nodes are alive; returns the last count seen."""
    python = tool_python()
    assert python is not None
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline and still_wanted():
        try:
            out = subprocess.run(
                [python, "-c", _NODES_SCRIPT, head],
                env=dict(env),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            lines = out.stdout.strip().splitlines()
            seen = int(lines[-1]) if lines and lines[-1].isdigit() else seen
        except subprocess.TimeoutExpired:
            pass
        if seen >= count:
            return seen
        time.sleep(1.0)
    return seen
