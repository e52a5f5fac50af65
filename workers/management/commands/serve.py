"""``manage.py serve``: the whole service on one machine, on embedded defaults.

Valkey (embedded unless ``REDIS_URL`` is set), migrations, a Celery worker with beat for this
node, and the web server. Ctrl-C (or SIGTERM) stops everything; if one part dies the rest is
stopped too, and the exit status is that part's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from opentinker_site.embedded import ensure_valkey

MANAGE_PY = Path(settings.BASE_DIR) / "manage.py"


class _Stop(Exception):
    pass


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop()


def terminate(procs: list[subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    """SIGTERM every child (Celery finishes its current task step: warm shutdown), then
    SIGKILL whatever is still there after ``timeout``."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


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
        procs: list[subprocess.Popen[bytes]] = []
        names: dict[int, str] = {}
        status = 0
        try:
            for name, cmd in commands:
                proc = subprocess.Popen(cmd, env=env, cwd=settings.BASE_DIR)
                procs.append(proc)
                names[proc.pid] = name
            self.stdout.write(f"OpenTinker at http://{address}/ (Redis {redis_url}); Ctrl-C stops")
            self.stdout.flush()
            while True:
                for proc in procs:
                    code = proc.poll()
                    if code is not None:
                        self.stderr.write(f"{names[proc.pid]} exited with status {code}")
                        status = code if code >= 0 else 128 - code
                        raise _Stop()
                time.sleep(0.5)
        except (KeyboardInterrupt, _Stop):
            pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            terminate(procs)
        if status:
            sys.exit(status)
