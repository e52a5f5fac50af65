from __future__ import annotations

from django.apps import AppConfig


class TinkerApiConfig(AppConfig):
    name = "tinker_api"
    verbose_name = "Tinker protocol"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here: the service uses the ORM, usable only once the registry is ready.
        from jobs import sampling
        from tinker_api.services.job_samples import sample_job

        sampling.set_sampler(sample_job)
