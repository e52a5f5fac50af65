"""OpenTinker thin client: the Python SDK and the ``opentinker`` CLI.

Needs only httpx, pydantic, typer, rich and PyYAML: no Django, no torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .client import Client, Job
from .errors import (
    ApiError,
    AuthError,
    ConfigError,
    Conflict,
    JobFailed,
    NetworkError,
    NotFound,
    OpenTinkerError,
    QuotaError,
    ServerError,
    SpecError,
    UnexpectedResponse,
    UsageError,
    ValidationError,
    WaitTimeout,
)
from .fit import FitResult, fit

__all__ = [
    "ApiError",
    "AuthError",
    "Client",
    "ConfigError",
    "Conflict",
    "FitResult",
    "Job",
    "JobFailed",
    "NetworkError",
    "NotFound",
    "OpenTinkerError",
    "QuotaError",
    "ServerError",
    "SpecError",
    "UnexpectedResponse",
    "UsageError",
    "ValidationError",
    "WaitTimeout",
    "__version__",
    "fit",
]
