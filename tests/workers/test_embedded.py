"""ensure_valkey(): one embedded server per process tree, stopped only by its starter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import os, subprocess, sys
    sys.path.insert(0, sys.argv[1])
    from opentinker_site.embedded import ensure_valkey
    url = ensure_valkey(sys.argv[2])
    assert ensure_valkey() == url and os.environ["REDIS_URL"] == url
    child = subprocess.run(
        [sys.executable, "-c",
         "import sys; sys.path.insert(0, sys.argv[1]);"
         "from opentinker_site.embedded import ensure_valkey; print(ensure_valkey())",
         sys.argv[1]],
        capture_output=True, text=True, check=True,
    )
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a forked child runs atexit hooks: they must not stop the parent's server
    os.waitpid(pid, 0)
    import redis
    assert redis.Redis.from_url(url).ping()
    print(url)
    print(child.stdout.strip())
    """
)


def test_it_starts_one_server_per_process_tree_and_stops_it_at_exit(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT), str(tmp_path / "valkey")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    url, child_url = out.stdout.split()
    assert child_url == url  # the subprocess inherited the server instead of starting one
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except redis.ConnectionError:
        pass
    else:
        raise AssertionError("the embedded server outlived the process that started it")


def test_it_uses_a_configured_redis_url(monkeypatch) -> None:
    from opentinker_site.embedded import ensure_valkey

    monkeypatch.setenv("REDIS_URL", "redis://example.invalid:6379/3")
    assert ensure_valkey() == "redis://example.invalid:6379/3"


PROTECTED = textwrap.dedent(
    """
    import stat, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import redis
    from opentinker_site.embedded import ensure_valkey
    url = ensure_valkey(sys.argv[2])
    parsed = redis.Redis.from_url(url)
    where = parsed.connection_pool.connection_kwargs
    host, port = where["host"], where["port"]
    try:
        redis.Redis(host=host, port=port).ping()
    except redis.AuthenticationError:
        print("refused")
    secret = Path(sys.argv[2]) / "password"
    print(oct(stat.S_IMODE(secret.stat().st_mode)), secret.read_text().strip() in url)
    print(parsed.ping())
    """
)


def test_it_requires_the_random_password_it_writes_beside_its_data(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    out = subprocess.run(
        [sys.executable, "-c", PROTECTED, str(ROOT), str(tmp_path / "valkey")],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "0o600", "True", "True"]


STARTER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    while time.time() < float(sys.argv[3]):
        time.sleep(0.001)
    from opentinker_site.embedded import ensure_valkey
    import redis
    url = ensure_valkey(sys.argv[2])
    assert redis.Redis.from_url(url).ping()
    print(url)
    """
)


def test_servers_started_at_the_same_moment_each_get_a_port_of_their_own(tmp_path: Path) -> None:
    import time

    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    at = str(time.time() + 3)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STARTER, str(ROOT), str(tmp_path / f"v{i}"), at],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-2000:] for _, err in outs]
    ports = {out.strip().rsplit(":", 1)[1] for out, _ in outs}
    assert len(ports) == 4


def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(
    tmp_path: Path, monkeypatch: Any
) -> None:
    import socket

    from opentinker_site import embedded

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = embedded._free_port
    monkeypatch.setattr(embedded, "_free_port", lambda: ports.pop() if ports else real())
    server = embedded._start_on_a_free_port(tmp_path)
    try:
        assert server.port != taken.getsockname()[1]
        assert redis.Redis(host=server.host, port=server.port).ping()
    finally:
        server.stop(timeout=5.0)
        taken.close()
