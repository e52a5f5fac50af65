"""Production settings: every secret is required, nothing is started implicitly."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import env, read_bool, read_secret

if DEBUG:  # noqa: F405
    raise ImproperlyConfigured("OPENTINKER_DEBUG must be off in production.")

# No defaults: a deployment that forgets a secret must not start with a well-known one.
SECRET_KEY = read_secret("SECRET_KEY", min_length=32)
OPENTINKER_KEY_HMAC_SECRET = read_secret("OPENTINKER_KEY_HMAC_SECRET", min_length=32)

if REDIS_URL is None:  # noqa: F405
    raise ImproperlyConfigured("REDIS_URL must be set in production.")

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=[])
if not ALLOWED_HOSTS:
    raise ImproperlyConfigured("ALLOWED_HOSTS must be set in production.")
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

SESSION_COOKIE_SECURE = read_bool("SESSION_COOKIE_SECURE", True)
CSRF_COOKIE_SECURE = read_bool("CSRF_COOKIE_SECURE", True)
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
