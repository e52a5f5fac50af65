from __future__ import annotations

from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Workers and GPU leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: these modules use the ORM, which is usable only once
        # the app registry is ready.
        from jobs import hooks
        from workers import control, dispatcher, inventory, signals

        hooks.set_control_plane(
            dispatch=dispatcher.request_dispatch,
            cancel_running=control.cancel_running,
            max_block_size=inventory.max_block_size,
            node_sizes=inventory.node_sizes,
        )
        signals.connect()
