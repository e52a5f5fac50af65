"""OpenAI-compatible routes, included under ``/v1/`` (where OpenAI's clients put them)."""

from __future__ import annotations

from django.urls import path, re_path

from tinker_api.serving import views

app_name = "openai"

urlpatterns = [
    path("models", views.models, name="models"),
    # Names hold slashes and colons (``tinker://run/sampler_weights/x``, ``job:<id>:<ckpt>``).
    re_path(r"^models/(?P<name>.+)$", views.model, name="model"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("completions", views.completions, name="completions"),
    re_path(r"^(?P<rest>.*)$", views.not_found),
]
