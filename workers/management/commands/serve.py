"""``manage.py serve``: the whole service on one machine, on embedded defaults, supervised.

Valkey (embedded unless ``REDIS_URL`` is set), migrations, a Celery worker with beat for this
node, and the web server. A part that exits, whatever its status, is restarted with
exponential backoff (1 s doubling to 30 s, back to 1 s once it has run for a minute); each
part runs in its own process group, and the whole group goes with it, so a worker killed
with SIGKILL leaves no orphaned beat behind to run twice beside its successor. Ctrl-C or
SIGTERM stops every part, and the embedded Valkey last (it is this process's). The embedded
Valkey is restarted too, at once, on its port and with its password.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from opentinker_site.embedded import ensure_valkey, revive_valkey
from workers.processes import stop_process_group

MANAGE_PY = Path(settings.BASE_DIR) / "manage.py"


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


# Restart backoff: 1 s, doubling per quick failure up to 30 s; a part that ran this long
# before it exited starts over at 1 s.
BACKOFF_MAX_SECONDS = 30.0
STABLE_SECONDS = 60.0


@dataclass
class Part:
    """One supervised child: its command and where its restarts stand."""

    name: str
    cmd: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    quick_failures: int = 0
    restart_at: float = 0.0

    def start(self, env: dict[str, str]) -> int:
        self.proc = subprocess.Popen(
            self.cmd, env=env, cwd=settings.BASE_DIR, start_new_session=True
        )
        self.started = time.monotonic()
        return self.proc.pid

    def reap(self, now: float) -> tuple[int, float, float] | None:
        """If the part exited: stop what is left of its group and plan its restart; returns
        (status, seconds it ran, seconds until the restart)."""
        if self.proc is None or self.proc.poll() is None:
            return None
        status = self.proc.returncode
        stop_process_group(self.proc, grace_s=5)
        ran = now - self.started
        self.quick_failures = 0 if ran >= STABLE_SECONDS else self.quick_failures + 1
        delay = min(BACKOFF_MAX_SECONDS, 2.0 ** max(0, self.quick_failures - 1))
        self.proc = None
        self.restart_at = now + delay
        return status, ran, delay


class Command(BaseCommand):
    help = "Run the whole service: embedded Valkey, migrations, worker + beat, web server."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--gunicorn", action="store_true", help="gunicorn, not runserver.")
        parser.add_argument("--no-worker", action="store_true", help="Web server only.")
        parser.add_argument("--no-migrate", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        if not 0 < options["port"] < 65536:
            raise CommandError("--port must be in 1..65535")
        # settings.REDIS_URL came from the environment or from ensure_valkey() when the
        # settings were loaded; exporting it makes the children use the same server.
        redis_url = settings.REDIS_URL or ensure_valkey()
        os.environ["REDIS_URL"] = redis_url
        if not options["no_migrate"]:
            call_command("migrate", interactive=False, verbosity=0)
        env = dict(os.environ)
        env.setdefault("DJANGO_SETTINGS_MODULE", os.environ["DJANGO_SETTINGS_MODULE"])
        address = f"{options['host']}:{options['port']}"
        commands: list[tuple[str, list[str]]] = []
        if not options["no_worker"]:
            commands.append(("worker", [sys.executable, str(MANAGE_PY), "runworker"]))
        if options["gunicorn"]:
            web = [
                sys.executable,
                "-m",
                "gunicorn",
                "opentinker_site.wsgi:application",
                "--config",
                "python:opentinker_site.gunicorn_conf",
                "--bind",
                address,
                "--workers",
                "2",
            ]
        else:
            web = [sys.executable, str(MANAGE_PY), "runserver", "--noreload", address]
        commands.append(("web", web))

        # Explicit handlers: a shell starting us in the background leaves SIGINT ignored.
        previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        parts = [Part(name, cmd) for name, cmd in commands]
        try:
            for part in parts:
                self._say(f"started {part.name} (pid {part.start(env)})")
            # The URL's password stays out of the log.
            redis_at = redis_url.rpartition("@")[2]
            self._say(f"OpenTinker at http://{address}/ (Redis {redis_at}); Ctrl-C stops")
            while True:
                revived = self._revive_valkey()
                if revived is not None:
                    self._say(
                        f"the embedded Valkey died; restarted it on port {revived}", error=True
                    )
                now = time.monotonic()
                for part in parts:
                    exited = part.reap(now)
                    if exited is not None:
                        status, ran, delay = exited
                        self._say(
                            f"{part.name} exited with status {status} after {ran:.0f} s; "
                            f"restarting in {delay:.0f} s",
                            error=True,
                        )
                    if part.proc is None and now >= part.restart_at:
                        self._say(f"restarted {part.name} (pid {part.start(env)})")
                time.sleep(0.5)
        except (KeyboardInterrupt, _Stop):
            pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for part in parts:
                if part.proc is not None:
                    stop_process_group(part.proc, grace_s=20)

    def _revive_valkey(self) -> int | None:
        """The embedded Valkey is a part too; a failed restart is tried again next round."""
        try:
            return revive_valkey()
        except Exception as exc:
            self._say(f"could not restart the embedded Valkey: {exc}", error=True)
            return None

    def _say(self, message: str, *, error: bool = False) -> None:
        (self.stderr if error else self.stdout).write(message)
        (self.stderr if error else self.stdout).flush()
