"""Sandbox launcher: runs as `python -I -S -B _sandbox_launcher.py CONFIG_JSON`.

Started by `environments.sandbox.run_code` in its own session. Standard library only, and it
never imports the project, because it runs before (and around) the isolation it sets up.

namespace mode (root only):
    unshare(mount, net, pid, ipc, uts) -> fork; the child is pid 1 of a fresh pid namespace and
    dies with the launcher (PDEATHSIG), so killing the launcher's process group kills every
    process the untrusted code started. The child builds a tmpfs root holding read-only,
    nosuid bind mounts of /usr and the Python prefix, a few device nodes, the code in /sandbox
    (read-only) and an empty tmpfs /work; chroots into it, sets rlimits, sets no_new_privs,
    drops to an unprivileged uid with no supplementary groups and execs Python.
rlimit mode (fallback):
    rlimits only, then exec Python in the work dir; the prelude's audit hook is the only
    barrier for files and sockets there.

The final status goes to the file descriptor named in the config as one JSON line.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _bind_readonly(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(source, target, None, MS_BIND | MS_REC, None)
    # A bind mount ignores MS_RDONLY on creation; it takes a remount to make it read-only.
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)


def _set_limits(cfg: dict) -> None:
    cpu = int(cfg["cpu_seconds"])
    # The soft limit sends SIGXCPU (reported as cpu_time); the hard limit a second later is SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = int(cfg["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    fsize = int(cfg["file_size_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    nofile = int(cfg["open_files"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg["mode"] == "namespace":
        # Counted per real uid; each run gets its own uid, so this is a per-run process cap.
        nproc = int(cfg["max_processes"])
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _build_root(cfg: dict) -> None:
    root = cfg["root_dir"]
    uid = int(cfg["uid"])
    # Keep every mount below private to this namespace.
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for name in ("bin", "lib", "lib64", "sbin"):
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            _bind_readonly(host, os.path.join(root, name))
    _bind_readonly("/usr", os.path.join(root, "usr"))
    prefix = cfg["python_prefix"]
    if not prefix.startswith("/usr/"):
        _bind_readonly(prefix, root + prefix)
    os.makedirs(os.path.join(root, "dev"))
    for dev in ("null", "zero", "urandom", "random"):
        if os.path.exists("/dev/" + dev):
            _bind_readonly_dev("/dev/" + dev, os.path.join(root, "dev", dev))
    sandbox_dir = os.path.join(root, "sandbox")
    os.makedirs(sandbox_dir)
    for name, text in (("prelude.py", cfg["prelude"]), ("main.py", cfg["code"])):
        with open(os.path.join(sandbox_dir, name), "w", encoding="utf-8") as fh:
            fh.write(text)
    work = os.path.join(root, "work")
    os.makedirs(work)
    work_size = int(cfg["work_dir_bytes"])
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={work_size},mode=700")
    os.chown(work, uid, uid)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.chroot(root)
    os.chdir("/work")


def _bind_readonly_dev(source: str, target: str) -> None:
    open(target, "a").close()
    _mount(source, target, None, MS_BIND, None)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID, None)


def _exec_python(cfg: dict, script_dir: str) -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": "/work" if cfg["mode"] == "namespace" else cfg["work_dir"],
        "TMPDIR": "/work" if cfg["mode"] == "namespace" else cfg["work_dir"],
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
    }
    argv = [cfg["python"], "-I", "-S", "-B", os.path.join(script_dir, "prelude.py")]
    os.execve(cfg["python"], argv, env)


def _namespace_init(cfg: dict, alive_r: int, report_w: int) -> None:
    """pid 1 of the new namespace: build the root, start the code, reap, report its status.

    The code must not be pid 1 itself: the kernel drops signals to a namespace's init that it
    has no handler for, which would swallow SIGXCPU from the CPU limit.
    """
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    # getppid() is 0 inside the new pid namespace, so the launcher's liveness is read from a
    # pipe only it holds open: EOF means it died before PDEATHSIG was armed.
    os.set_blocking(alive_r, False)
    try:
        if os.read(alive_r, 1) == b"":
            os._exit(137)
    except BlockingIOError:
        pass
    os.close(alive_r)
    _build_root(cfg)
    code_pid = os.fork()
    if code_pid == 0:
        try:
            os.close(report_w)
            _set_limits(cfg)
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
            uid = int(cfg["uid"])
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            _exec_python(cfg, "/sandbox")
        except BaseException as exc:
            os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
            os._exit(125)
    # Reap everything (orphans of the code are re-parented here) until the code process exits;
    # returning then tears the namespace down and the kernel kills whatever is left.
    while True:
        pid, status = os.wait()
        if pid == code_pid:
            _report(report_w, _decode_wait(status))
            return


def _report(fd: int, payload: dict) -> None:
    os.write(fd, (json.dumps(payload) + "\n").encode())


def _decode_wait(status: int) -> dict:
    if os.WIFSIGNALED(status):
        return {"exit": None, "signal": os.WTERMSIG(status)}
    return {"exit": os.WEXITSTATUS(status), "signal": None}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    status_fd = int(cfg["status_fd"])
    if cfg["mode"] == "rlimit":
        try:
            _set_limits(cfg)
            os.chdir(cfg["work_dir"])
        except OSError as exc:
            _report(status_fd, {"setup_error": str(exc)})
            os._exit(125)
        os.close(status_fd)
        # The exit status of the exec'd interpreter is the launcher's own; run_code reads it.
        _exec_python(cfg, cfg["script_dir"])
    try:
        if cfg.get("cgroup_procs"):
            with open(cfg["cgroup_procs"], "w") as fh:
                fh.write(str(os.getpid()))
        _check(
            _libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
            "unshare",
        )
    except OSError as exc:
        _report(status_fd, {"setup_error": str(exc)})
        os._exit(125)
    alive_r, alive_w = os.pipe()
    # pid 1 reports the code's status (or its own setup failure) through this pipe, since
    # stdout and stderr belong to the code.
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        os.close(alive_w)
        try:
            os.close(status_fd)
            _namespace_init(cfg, alive_r, report_w)
            os._exit(0)
        except BaseException as exc:
            _report(report_w, {"setup_error": f"{type(exc).__name__}: {exc}"[:2000]})
            os._exit(125)
    os.close(report_w)
    os.close(alive_r)
    _, status = os.waitpid(pid, 0)
    report = os.read(report_r, 65536).decode(errors="replace").strip()
    try:
        result = json.loads(report.splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        result = {"setup_error": f"namespace init ended without a report ({_decode_wait(status)})"}
    _report(status_fd, result)
    os._exit(0)


if __name__ == "__main__":
    main()
