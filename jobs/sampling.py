"""``POST /api/v1/jobs/{id}/sample`` and the job page's sample box: quick generations from a
finished job's final weights (its adapter, or its model when it trained every weight).

The web process holds no model: a sample is answered by the model worker of the job's base
model, the one that serves the policy ``job:<id>`` on the OpenAI endpoint. Queueing requests
for model workers belongs to ``tinker_api``, which sits above ``jobs`` in the layers, so it
hands its sampler in here when Django starts (``set_sampler``, from ``tinker_api.apps``), as
``workers`` hands in the control plane (``jobs.hooks``). This module keeps the contract the
endpoint's callers rely on: the bounds, the arguments, the sample shape and the errors.
"""

from __future__ import annotations

from typing import Any, Protocol

from .models import BaseModel, Job

__all__ = [
    "MAX_SAMPLES",
    "MAX_SAMPLE_IMAGE_BYTES",
    "MAX_SAMPLE_TOKENS",
    "BadSampleRequest",
    "NoAdapter",
    "SamplerBusy",
    "SamplerUnavailable",
    "sample_from_job",
    "set_sampler",
]

# Quick looks at a policy, not a serving path (that is /v1/completions): small on purpose.
MAX_SAMPLE_TOKENS = 256
MAX_SAMPLES = 8
MAX_SAMPLE_IMAGE_BYTES = 8 * 1024 * 1024


class NoAdapter(Exception):
    """The job has no final weights to sample from (not finished, or failed)."""


class BadSampleRequest(ValueError):
    """The request cannot run as given: ``field`` names what to change."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class SamplerBusy(Exception):
    """No room now (the team's requests in flight, the base model's queue, or the team's
    per-minute quota): retry after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SamplerUnavailable(Exception):
    """No model worker answered: none could start, or the one serving the request stopped."""


class Sampler(Protocol):
    def __call__(
        self,
        job: Job,
        *,
        prompt: str | None,
        messages: list[dict[str, str]] | None,
        max_tokens: int,
        temperature: float,
        n: int,
        seed: int | None,
        image: bytes | None = None,
    ) -> list[dict[str, Any]]: ...


_sampler: Sampler | None = None


def set_sampler(sampler: Sampler) -> None:
    global _sampler
    _sampler = sampler


def sample_from_job(
    job: Job,
    *,
    prompt: str | None,
    messages: list[dict[str, str]] | None,
    max_tokens: int,
    temperature: float,
    n: int,
    seed: int | None,
    image: bytes | None = None,
) -> list[dict[str, Any]]:
    """``n`` continuations of the prompt (raw text) or of the chat (rendered with the base
    model's chat template, ending at the end of the assistant turn), each
    ``{"text", "tokens", "stop_reason"}``. ``image`` (PNG or JPEG bytes) goes with the chat's
    last message, after its text, on a vision-language base model."""
    if image is not None:
        if messages is None:
            raise BadSampleRequest("image", "an image goes with a chat (messages), not a prompt")
        if len(image) > MAX_SAMPLE_IMAGE_BYTES:
            raise BadSampleRequest("image", f"the image is over {MAX_SAMPLE_IMAGE_BYTES} bytes")
        name = str((job.spec or {}).get("base_model") or "")
        base = BaseModel.objects.filter(name=name).first()
        if base is None or not base.takes_images():
            raise BadSampleRequest("image", f"base model {name} takes no images")
    if _sampler is None:
        raise SamplerUnavailable("this process serves no model workers (tinker_api is absent)")
    return _sampler(
        job,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        n=n,
        seed=seed,
        image=image,
    )
