"""``manage.py runworker``: a Celery worker for this node (GPU work, control, env), with beat.

A thin wrapper over ``celery worker``: it picks the queues (``control,gpu,gpu.<node>,env``),
sizes the pool to the node's slots plus one for control tasks, and embeds beat unless told
not to. The worker announces the node's GPUs (or CPU slots) when it is ready.
"""

from __future__ import annotations

import os
from typing import Any

from celery import current_app
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from workers import conf
from workers.inventory import detect_inventory


class Command(BaseCommand):
    help = "Run a Celery worker for this node: queues control, gpu, gpu.<node>, env; beat on."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--node", help="Node name (default: OPENTINKER_NODE_NAME or host).")
        parser.add_argument(
            "--queues",
            default="control,gpu,env",
            help="Queues to consume; a worker on gpu also consumes gpu.<node>.",
        )
        parser.add_argument(
            "--concurrency", type=int, help="Pool size (default: the node's slots + 1)."
        )
        parser.add_argument("--pool", default="prefork", help="Celery pool (default prefork).")
        parser.add_argument("--no-beat", action="store_true", help="Do not embed celery beat.")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["node"]:
            if ":" in options["node"] or not options["node"].strip():
                raise CommandError("--node must be a non-empty name without ':'")
            configured = conf.setting("OPENTINKER_NODE_NAME")
            if configured and configured != options["node"]:
                raise CommandError(
                    f"OPENTINKER_NODE_NAME={configured!r} contradicts --node {options['node']!r}"
                )
            # This process's signal handlers read the setting; processes it starts with a fresh
            # interpreter build their settings from the environment.
            settings.OPENTINKER_NODE_NAME = options["node"]
            os.environ["OPENTINKER_NODE_NAME"] = options["node"]
        inventory = detect_inventory()
        node = conf.node_name()
        queues = [q.strip() for q in options["queues"].split(",") if q.strip()]
        if not queues:
            raise CommandError("--queues must name at least one queue")
        # gpu.<node> is added by the worker itself (workers.signals), declared exactly
        # as the dispatcher declares it when it publishes there.
        queues = [q for q in queues if q != f"gpu.{node}"]
        shown = [*queues, f"gpu.{node}"] if "gpu" in queues else queues
        concurrency = options["concurrency"] or len(inventory.gpus) + 1
        if concurrency < 1:
            raise CommandError("--concurrency must be >= 1")
        argv = [
            "worker",
            f"--queues={','.join(queues)}",
            f"--concurrency={concurrency}",
            f"--pool={options['pool']}",
            f"--hostname={node}@%h",
            f"--loglevel={options['loglevel']}",
            # Gossip and mingle chatter slow start-up and buy nothing with one Redis broker.
            "--without-gossip",
            "--without-mingle",
        ]
        if not options["no_beat"]:
            argv.append("--beat")
        self.stdout.write(
            f"worker for node {node}: {inventory.kind} {inventory.gpus}, queues {shown}, "
            f"concurrency {concurrency}, beat {'off' if options['no_beat'] else 'on'}"
        )
        current_app.worker_main(argv)
