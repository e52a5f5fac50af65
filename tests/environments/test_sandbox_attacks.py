"""Attacks on the sandbox: each is stopped or denied and reported, and the caller survives.

These run as root in CI (namespace isolation); a few also pin the rlimit fallback.
"""

from __future__ import annotations

import os

import pytest

from environments.sandbox import SandboxLimits, namespace_available, run_code

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=3.0, max_processes=8)

needs_namespace = pytest.mark.skipif(
    not namespace_available()[0],
    reason=f"namespace isolation unavailable: {namespace_available()[1]}",
)


def _processes_of_uid(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                for line in fh:
                    if line.startswith("Uid:") and int(line.split()[1]) == uid:
                        found.append(int(entry))
        except OSError:
            continue
    return found


def test_it_runs_plain_code_and_returns_its_output() -> None:
    result = run_code("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)", FAST)
    assert result.ok, result.reason
    assert result.stdout == "42\n"
    assert result.stderr == "warn\n"
    assert result.killed_by is None


def test_it_kills_an_infinite_loop_at_the_cpu_limit() -> None:
    result = run_code("while True:\n    pass\n", FAST)
    assert not result.ok
    assert result.killed_by == "cpu_time"
    assert "CPU-time limit" in result.reason
    assert result.wall_seconds < FAST.wall_seconds


def test_it_kills_a_sleeping_process_at_the_wall_limit() -> None:
    result = run_code(
        "import time\nprint('started', flush=True)\ntime.sleep(60)\n",
        SandboxLimits(wall_seconds=1.0),
    )
    assert result.killed_by == "wall_time"
    assert result.exit is None
    assert result.stdout == "started\n"
    assert 1.0 <= result.wall_seconds < 4.0


@needs_namespace
def test_it_caps_a_fork_bomb_and_kills_every_child() -> None:
    code = (
        "import os, time\n"
        "children = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as exc:\n"
        "        os.write(1, f'forks={children} error={exc.errno}\\n'.encode())\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    children += 1\n"
    )
    result = run_code(code, FAST)
    assert result.exit == 0, result.reason
    forks = int(result.stdout.split("forks=")[1].split()[0])
    # The code process itself counts against the cap.
    assert forks < FAST.max_processes
    # The children were sleeping; the namespace teardown must have killed them all.
    assert _processes_of_uid(int(result.metrics["uid"])) == []


@needs_namespace
def test_it_stops_a_fork_bomb_that_never_stops_forking() -> None:
    code = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    result = run_code(code, SandboxLimits(cpu_seconds=1, wall_seconds=2.0, max_processes=8))
    assert result.killed_by in ("wall_time", "cpu_time")
    assert run_code("print('alive')", FAST).stdout == "alive\n"


def test_it_refuses_a_10_gb_allocation() -> None:
    result = run_code("block = bytearray(10 * 1024**3)\nprint('allocated')\n", FAST)
    assert result.killed_by == "memory"
    assert "allocated" not in result.stdout
    assert "memory limit" in result.reason


@needs_namespace
def test_it_hides_etc_passwd() -> None:
    result = run_code("print(open('/etc/passwd').read())", FAST)
    assert result.exit == 1
    assert "root:" not in result.stdout
    assert "FileNotFoundError" in result.stderr


@needs_namespace
def test_it_hides_the_project_settings() -> None:
    settings = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "opentinker_site",
        "settings",
        "base.py",
    )
    code = f"import os\nprint(os.path.exists({settings!r}))\nprint(open({settings!r}).read())\n"
    result = run_code(code, FAST)
    assert result.stdout.startswith("False")
    assert result.exit == 1
    assert "SECRET" not in result.stdout


def test_it_denies_opening_a_socket() -> None:
    result = run_code("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n", FAST)
    assert result.exit == 1
    assert "network access" in result.reason


@needs_namespace
def test_it_has_no_network_even_below_the_audit_hook() -> None:
    # Raw libc calls skip Python's audit events; the empty network namespace still holds.
    code = (
        "import ctypes, struct\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.socket(2, 1, 0)\n"
        "addr = struct.pack('=H', 2) + struct.pack('!H', 80) + bytes([1, 1, 1, 1]) + bytes(8)\n"
        "rc = libc.connect(fd, addr, len(addr))\n"
        "print(fd >= 0, rc, ctypes.get_errno())\n"
    )
    result = run_code(code, FAST)
    assert result.ok, result.reason
    created, rc, errno = result.stdout.split()
    assert created == "True"
    assert rc == "-1"
    assert int(errno) == 101  # ENETUNREACH: no interface but a downed loopback


@needs_namespace
def test_it_denies_writing_outside_the_work_dir() -> None:
    code = (
        "import os\n"
        "open('inside.txt', 'w').write('ok')\n"
        "print(os.getcwd(), os.listdir('.'))\n"
        "for path in ('/tmp/escape', '/escape', '/usr/escape', '/sandbox/main.py'):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError as exc:\n"
        "        print('denied', path, type(exc).__name__)\n"
    )
    result = run_code(code, FAST)
    assert result.ok, result.reason
    assert "WROTE" not in result.stdout
    assert result.stdout.count("denied") == 4
    assert "/work ['inside.txt']" in result.stdout
    assert not os.path.exists("/tmp/escape") and not os.path.exists("/escape")


def test_it_stops_a_file_larger_than_the_limit() -> None:
    limits = SandboxLimits(cpu_seconds=2, wall_seconds=4.0, file_size_bytes=1024**2)
    result = run_code("open('big', 'wb').write(b'x' * (4 * 1024**2))\n", limits)
    assert result.exit == 1
    assert "File too large" in result.stderr


def test_it_cuts_runaway_output() -> None:
    result = run_code("print('x' * 10**6)", SandboxLimits(max_output_bytes=1000))
    assert result.truncated
    assert len(result.stdout) == 1000


def test_it_starts_from_a_clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENTINKER_SECRET_PROBE", "leaked")
    result = run_code("import os\nprint(sorted(os.environ))", FAST)
    assert "OPENTINKER_SECRET_PROBE" not in result.stdout
    assert "DJANGO_SETTINGS_MODULE" not in result.stdout


def test_it_denies_sockets_files_and_subprocesses_in_rlimit_mode(tmp_path) -> None:
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=3.0, isolation="rlimit")
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    assert "network access" in run_code("import socket\nsocket.socket()", limits).reason
    read = run_code(f"print(open({str(secret)!r}).read())", limits)
    assert "hunter2" not in read.stdout and "not allowed" in read.reason
    spawn = run_code("import subprocess\nsubprocess.run(['true'])", limits)
    assert spawn.exit == 1 and "not allowed" in spawn.reason
    fork = run_code("import os\nos.fork()", limits)
    assert fork.exit == 1 and "os.fork is not allowed" in fork.reason
    assert run_code("open('ok.txt', 'w').write('x')\nprint('ok')", limits).stdout == "ok\n"
