"""API errors shared by the apps, in DRF's ``{"detail": ...}`` shape."""

from __future__ import annotations

from rest_framework import status
from rest_framework.exceptions import APIException


class Conflict(APIException):
    """Valid request, but the object's state forbids it (e.g. cancelling a finished job)."""

    status_code = status.HTTP_409_CONFLICT
    default_detail = "The object's current state does not allow this."
    default_code = "conflict"
