"""Run untrusted Python (code-interpreter actions, user reward code) in a separate process.

`run_code(code, limits)` never raises for anything the code does: every outcome (normal exit,
exception, CPU or wall-time kill, memory or process limit, setup failure) comes back as a
`SandboxResult`. docs/sandbox.md says which barrier is enforced where.

Two isolation modes, picked by `SandboxLimits.isolation` ("auto" picks the strongest available):
- "namespace" (needs root, which is how the env workers run): mount, network, pid, ipc and uts
  namespaces, a chroot holding only /usr, the Python prefix and an empty tmpfs work dir, a
  fresh unprivileged uid per run with no_new_privs, rlimits (CPU, address space, processes,
  file size, open files), a pids cgroup when the cgroup v1 pids controller is writable, and a
  wall-clock kill of the whole pid namespace.
- "rlimit" (fallback for unprivileged callers): rlimits, a clean environment, an empty work dir
  and an audit hook that refuses sockets, subprocesses, ctypes and files outside the work dir.
  Audit hooks are not a security boundary against determined code; this mode exists so that
  development machines without root still run the environments.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Literal

Isolation = Literal["auto", "namespace", "rlimit"]
KilledBy = Literal["wall_time", "cpu_time", "memory", "output", "signal"]

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_launcher.py")
_PIDS_CGROUP_ROOT = "/sys/fs/cgroup/pids"
# uids handed to sandboxed runs; none of them exists in /etc/passwd, so they own nothing on disk.
_UID_BASE = 200_000
_UID_SPAN = 800_000


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one run. Defaults suit a code-interpreter turn."""

    cpu_seconds: int = 5
    """RLIMIT_CPU: SIGXCPU at this many CPU seconds, SIGKILL one second later."""
    wall_seconds: float = 10.0
    """The whole process tree is killed after this long, whatever it is doing."""
    memory_bytes: int = 512 * 1024**2
    """RLIMIT_AS (address space) of every process."""
    max_processes: int = 16
    """Processes and threads the run may have at once (RLIMIT_NPROC on its own uid, pids cgroup)."""
    file_size_bytes: int = 8 * 1024**2
    """RLIMIT_FSIZE: largest file the code may write."""
    work_dir_bytes: int = 16 * 1024**2
    """Size of the tmpfs work dir (namespace mode)."""
    open_files: int = 64
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 64 * 1024
    """stdout and stderr are each cut at this many bytes (the rest is read and dropped)."""
    isolation: Isolation = "auto"
    """"auto" uses "namespace" when available, else "rlimit"."""

    def __post_init__(self) -> None:
        for name in (
            "cpu_seconds",
            "memory_bytes",
            "max_processes",
            "file_size_bytes",
            "work_dir_bytes",
            "open_files",
            "max_output_bytes",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SandboxLimits.{name} must be >= 1, got {getattr(self, name)}")
        if not self.wall_seconds > 0:
            raise ValueError(f"SandboxLimits.wall_seconds must be > 0, got {self.wall_seconds}")
        if self.isolation not in ("auto", "namespace", "rlimit"):
            raise ValueError(f"SandboxLimits.isolation: unknown mode {self.isolation!r}")


@dataclass
class SandboxResult:
    """What happened to one run. `ok` is True only for a clean exit with status 0."""

    stdout: str
    stderr: str
    exit: int | None
    """Exit status, or None when the process was killed by a signal."""
    killed_by: KilledBy | None = None
    """Which limit ended the run, if one did."""
    reason: str = ""
    """One human-readable line: why the run ended the way it did."""
    isolation: str = ""
    """The isolation mode actually used."""
    wall_seconds: float = 0.0
    truncated: bool = False
    """True when stdout or stderr was cut at max_output_bytes."""
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit == 0 and self.killed_by is None

    def to_dict(self) -> dict:
        return asdict(self)


_PRELUDE = r"""
import sys

_CFG = __CFG__


def _deny(what):
    raise PermissionError(f"sandbox: {what} is not allowed")


def _under(path, roots):
    import os.path
    try:
        full = os.path.realpath(path)
    except (TypeError, ValueError):
        return False
    return any(full == r or full.startswith(r.rstrip("/") + "/") for r in roots)


_BLOCKED_ALWAYS = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo")
_BLOCKED_RLIMIT = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "os.fork", "os.forkpty", "ctypes.dlopen", "ctypes.cdata", "os.kill")


def _hook(event, args):
    if event in _BLOCKED_ALWAYS:
        _deny(f"network access ({event})")
    if _CFG["mode"] != "rlimit":
        return
    if event in _BLOCKED_RLIMIT:
        _deny(event)
    if event == "open":
        path, mode = args[0], args[1]
        if isinstance(path, int):
            return
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        writing = mode is not None and any(c in str(mode) for c in "wax+")
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        writing = writing or bool(flags & 0o3)
        if _under(path, _CFG["write_roots"]):
            return
        if not writing and _under(path, _CFG["read_roots"]):
            return
        _deny(f"opening {path!r}")


sys.addaudithook(_hook)
del _hook
_path = _CFG["main"]
with open(_path, encoding="utf-8") as _fh:
    _source = _fh.read()
_code = compile(_source, "main.py", "exec")
_globals = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
del _fh, _source, _path
exec(_code, _globals)
"""


@lru_cache(maxsize=1)
def namespace_available() -> tuple[bool, str]:
    """Whether "namespace" isolation works here; probed once per process."""
    if not sys.platform.startswith("linux"):
        return False, "not Linux"
    if os.geteuid() != 0:
        return False, "needs root to create namespaces and switch uid"
    result = _run(
        "print('ok')",
        SandboxLimits(wall_seconds=20.0, isolation="namespace"),
        "namespace",
    )
    if result.ok and result.stdout.strip() == "ok":
        return True, ""
    return False, result.reason or result.stderr[-300:]


def resolve_isolation(requested: Isolation) -> str:
    if requested == "auto":
        return "namespace" if namespace_available()[0] else "rlimit"
    return requested


def run_code(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python script under `limits`; never raises for the code's behaviour."""
    if not isinstance(code, str):
        raise TypeError(f"code must be str, got {type(code).__name__}")
    limits = limits or SandboxLimits()
    return _run(code, limits, resolve_isolation(limits.isolation))


def _python_binary() -> tuple[str, str]:
    # The venv's python is a symlink to the base interpreter; the chroot mounts only the base
    # prefix, so resolve the symlink and run the interpreter without the venv's site-packages.
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _make_pids_cgroup(limit: int) -> str | None:
    if not os.access(_PIDS_CGROUP_ROOT, os.W_OK):
        return None
    path = os.path.join(_PIDS_CGROUP_ROOT, f"opentinker-sbx-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as fh:
            # +1 for the launcher process, which sits in the cgroup as well.
            fh.write(str(limit + 1))
    except OSError:
        _remove_cgroup(path)
        return None
    return path


def _remove_cgroup(path: str | None) -> None:
    if not path:
        return
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            # Processes are still exiting after the kill; give the kernel a moment.
            time.sleep(0.02)


def _run(code: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    python, prefix = _python_binary()
    host_tmp = tempfile.mkdtemp(prefix="opentinker-sbx-")
    cgroup = None
    status_r, status_w = os.pipe()
    # Each end is closed exactly once: closing a number twice closes whatever another thread
    # opened under it in between (a checkpoint being written, a pipe being read).
    open_fds = {status_r, status_w}
    try:
        uid = _UID_BASE + secrets.randbelow(_UID_SPAN)
        cfg: dict = {
            "mode": mode,
            "python": python,
            "python_prefix": prefix,
            "cpu_seconds": limits.cpu_seconds,
            "memory_bytes": limits.memory_bytes,
            "max_processes": limits.max_processes,
            "file_size_bytes": limits.file_size_bytes,
            "work_dir_bytes": limits.work_dir_bytes,
            "open_files": limits.open_files,
            "status_fd": status_w,
            "uid": uid,
        }
        prelude_cfg: dict = {"mode": mode}
        if mode == "namespace":
            root_dir = os.path.join(host_tmp, "root")
            os.mkdir(root_dir)
            cfg["root_dir"] = root_dir
            prelude_cfg["main"] = "/sandbox/main.py"
            cgroup = _make_pids_cgroup(limits.max_processes)
            if cgroup:
                cfg["cgroup_procs"] = os.path.join(cgroup, "cgroup.procs")
            cfg["code"] = code
        else:
            script_dir = os.path.join(host_tmp, "sandbox")
            work_dir = os.path.join(host_tmp, "work")
            os.mkdir(script_dir)
            os.mkdir(work_dir)
            with open(os.path.join(script_dir, "main.py"), "w", encoding="utf-8") as fh:
                fh.write(code)
            cfg["script_dir"] = script_dir
            cfg["work_dir"] = work_dir
            prelude_cfg["main"] = os.path.join(script_dir, "main.py")
            prelude_cfg["write_roots"] = [os.path.realpath(work_dir)]
            prelude_cfg["read_roots"] = [
                prefix,
                os.path.realpath(script_dir),
                "/dev/null",
                "/dev/urandom",
            ]
        prelude = _PRELUDE.replace("__CFG__", repr(prelude_cfg))
        cfg["prelude"] = prelude
        if mode == "rlimit":
            with open(os.path.join(cfg["script_dir"], "prelude.py"), "w") as fh:
                fh.write(prelude)
        # _supervise closes the write end once the child holds it (and if it cannot start).
        open_fds.discard(status_w)
        result = _supervise(python, cfg, limits, status_r, status_w, mode)
        if mode == "namespace":
            result.metrics["uid"] = float(uid)
        return result
    finally:
        for fd in open_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        _remove_cgroup(cgroup)
        shutil.rmtree(host_tmp, ignore_errors=True)


def _supervise(
    python: str, cfg: dict, limits: SandboxLimits, status_r: int, status_w: int, mode: str
) -> SandboxResult:
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            [python, "-I", "-S", "-B", _LAUNCHER, json.dumps(cfg)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            cwd="/",
        )
    except OSError as exc:
        os.close(status_w)
        return SandboxResult("", "", None, None, f"sandbox could not start: {exc}", mode)
    os.close(status_w)
    outputs = {"stdout": bytearray(), "stderr": bytearray()}
    truncated = False
    killed_by: KilledBy | None = None
    deadline = started + limits.wall_seconds
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    open_streams = 2
    while open_streams:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            killed_by = "wall_time"
            _kill_group(proc)
            break
        for key, _ in sel.select(timeout=min(remaining, 0.5)):
            chunk = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            buf = outputs[key.data]
            room = limits.max_output_bytes - len(buf)
            if room > 0:
                buf.extend(chunk[:room])
            if len(chunk) > room:
                truncated = True
    sel.close()
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()) + 2.0)
    except subprocess.TimeoutExpired:
        killed_by = killed_by or "wall_time"
        _kill_group(proc)
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    elapsed = time.monotonic() - started
    status = _read_status(status_r)
    stdout = outputs["stdout"].decode("utf-8", errors="replace")
    stderr = outputs["stderr"].decode("utf-8", errors="replace")
    if mode == "rlimit":
        rc = proc.returncode
        status = status or (
            {"exit": rc, "signal": None} if rc >= 0 else {"exit": None, "signal": -rc}
        )
    return _classify(stdout, stderr, status, killed_by, truncated, elapsed, mode, limits)


def _kill_group(proc: subprocess.Popen) -> None:
    # The launcher leads its own session; its namespace child dies with it (PDEATHSIG), and the
    # kernel then kills every process in that pid namespace.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _read_status(fd: int) -> dict:
    data = b""
    try:
        os.set_blocking(fd, False)
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    except (BlockingIOError, OSError):
        pass
    line = data.decode(errors="replace").strip().splitlines()
    if not line:
        return {}
    try:
        return json.loads(line[-1])
    except json.JSONDecodeError:
        return {}


def _classify(
    stdout: str,
    stderr: str,
    status: dict,
    killed_by: KilledBy | None,
    truncated: bool,
    elapsed: float,
    mode: str,
    limits: SandboxLimits,
) -> SandboxResult:
    exit_code = status.get("exit")
    sig = status.get("signal")
    reason = ""
    if killed_by == "wall_time":
        exit_code = None
        reason = f"killed after the wall-time limit of {limits.wall_seconds:g}s"
    elif status.get("setup_error"):
        reason = f"sandbox setup failed: {status['setup_error']}"
        exit_code = None
    elif sig is not None:
        if sig == signal.SIGXCPU:
            killed_by = "cpu_time"
            reason = f"killed after the CPU-time limit of {limits.cpu_seconds}s"
        elif sig == signal.SIGKILL:
            killed_by = "signal"
            reason = "killed by SIGKILL (CPU hard limit or out of memory)"
        elif sig == signal.SIGXFSZ:
            killed_by = "signal"
            reason = f"file-size limit of {limits.file_size_bytes} bytes exceeded"
        else:
            killed_by = "signal"
            reason = f"killed by signal {signal.Signals(sig).name}"
    elif not status:
        reason = "sandbox ended without reporting a status"
    else:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        if last.startswith("MemoryError"):
            killed_by = "memory"
            reason = f"memory limit of {limits.memory_bytes} bytes reached"
        elif "sandbox:" in last and "not allowed" in last:
            reason = last[last.index("sandbox:") :]
        elif exit_code == 0:
            reason = "exited normally"
        else:
            reason = f"exited with status {exit_code}" + (f": {last}" if last else "")
    if truncated:
        reason += f" (output cut at {limits.max_output_bytes} bytes)"
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit=exit_code,
        killed_by=killed_by,
        reason=reason,
        isolation=mode,
        wall_seconds=round(elapsed, 4),
        truncated=truncated,
        metrics={"sandbox_wall_s": elapsed},
    )
