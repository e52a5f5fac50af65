"""Tinker protocol routes, included under ``/api/v1/`` (paths as the tinker SDK sends them)."""

from __future__ import annotations

from django.urls import path, re_path

from tinker_api import views

app_name = "tinker"

_CKPT = "training_runs/<str:run_id>/checkpoints/<str:segment>/<str:name>"

urlpatterns = [
    path("healthz", views.healthz, name="healthz"),
    path("client/config", views.client_config, name="client-config"),
    path("client/dynamic_config", views.client_dynamic_config, name="client-dynamic-config"),
    path("telemetry", views.telemetry, name="telemetry"),
    path("get_server_capabilities", views.server_capabilities, name="capabilities"),
    path("create_session", views.create_session, name="create-session"),
    path("session_heartbeat", views.session_heartbeat, name="session-heartbeat"),
    path("sessions/<str:session_id>/finish", views.session_finish, name="session-finish"),
    path("create_model", views.create_model, name="create-model"),
    path("get_info", views.get_info, name="get-info"),
    path("forward_backward", views.forward_backward, name="forward-backward"),
    path("forward", views.forward, name="forward"),
    path("optim_step", views.optim_step, name="optim-step"),
    path("save_weights", views.save_weights, name="save-weights"),
    path("save_weights_for_sampler", views.save_weights_for_sampler, name="save-for-sampler"),
    path("load_weights", views.load_weights, name="load-weights"),
    path("save_weights_external", views.save_weights_external, name="save-external"),
    path(f"{_CKPT}/external_weights_urls", views.external_weights_urls, name="external-urls"),
    path("external_weights/<str:token>/<str:file>", views.external_file, name="external-file"),
    path("create_sampling_session", views.create_sampling_session, name="create-sampling"),
    path("samplers/<str:sampler_id>", views.get_sampler, name="sampler"),
    path("asample", views.asample, name="asample"),
    path("retrieve_future", views.retrieve_future, name="retrieve-future"),
    path("cancel_future", views.cancel_future, name="cancel-future"),
    path("training_runs", views.training_runs, name="training-runs"),
    path("training_runs/<str:run_id>", views.training_run, name="training-run"),
    path("training_runs/<str:run_id>/checkpoints", views.run_checkpoints, name="run-checkpoints"),
    path(_CKPT, views.checkpoint, name="checkpoint"),
    path(f"{_CKPT}/ttl", views.checkpoint_ttl, name="checkpoint-ttl"),
    path(f"{_CKPT}/publish", views.checkpoint_publish, name="checkpoint-publish"),
    path("checkpoints", views.all_checkpoints, name="checkpoints"),
    path("weights_info", views.weights_info, name="weights-info"),
    # The rest of the SDK 0.38 surface (PROTOCOL.md says why each is not offered).
    *(
        path(route, views.not_supported(feature))
        for route, feature in (
            ("copy_weights", "copying weights into another project"),
            ("create_custom_loss", "server-side custom losses (custom_loss_server_side=false)"),
            (
                "join_sampling_session",
                "joining sampling sessions (sample_join_sampling_session=false)",
            ),
            ("retrieve_futures", "batched future retrieval (sample_use_retrieve_futures=false)"),
            ("auth/token", "JWT authentication (pjwt_auth_enabled=false)"),
            ("auth/apikey/me", "API key self-service (manage keys in the web UI)"),
            ("audit", "the audit log API"),
            ("billing/usage/events", "billing"),
            ("billing/usage/checkpoints/current", "billing"),
            ("sessions/search", "session search"),
            ("sessions/<str:session_id>/project", "projects"),
            ("sessions/<str:session_id>/trace_export", "trace export"),
        )
    ),
    path("sessions", views.sessions, name="sessions"),
    path("sessions/<str:session_id>", views.session, name="session"),
    # Anything else under the prefix is a JSON 404, not Django's page (HTML with DEBUG on).
    re_path(r"^(?P<rest>.*)$", views.unknown, name="unknown"),
]
