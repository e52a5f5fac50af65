"""Settings shared by every environment.

The environment is read here and only here (django-environ). Bad values raise
``ImproperlyConfigured`` at start-up rather than deep inside a request. Secrets may be given
directly (``NAME``) or as a path to a file holding them (``NAME_FILE``, for Docker secrets).
"""

from __future__ import annotations

import importlib.util
import os
import shlex
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent.parent

env = environ.Env()
if (BASE_DIR / ".env").is_file():
    environ.Env.read_env(BASE_DIR / ".env")


def read_secret(name: str, default: str | None = None, *, min_length: int = 1) -> str:
    """Read ``name`` from the environment, or the file named by ``name_FILE``.

    Without a default a missing value is a configuration error: production passes no default
    so a forgotten secret stops the process at start instead of running with a known key.
    """
    file_var = f"{name}_FILE"
    if name in os.environ and file_var in os.environ:
        raise ImproperlyConfigured(f"Set only one of {name} and {file_var}.")
    value: str | None
    if file_var in os.environ:
        path = Path(os.environ[file_var])
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise ImproperlyConfigured(f"{file_var}: cannot read {path}: {exc}") from exc
    else:
        value = os.environ.get(name, default)
    if value is None:
        raise ImproperlyConfigured(f"{name} (or {file_var}) must be set.")
    if len(value) < min_length:
        raise ImproperlyConfigured(f"{name} must be at least {min_length} characters long.")
    return value


def read_int(name: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
    """Read a bounded integer; a typo such as ``30s`` fails at start with the variable named."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        value = default
    else:
        try:
            value = int(raw)
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}.") from exc
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ImproperlyConfigured(f"{name} must be {bounds}, got {value}.")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def read_bool(name: str, default: bool) -> bool:
    """Read a boolean; anything but the usual spellings is an error, not a silent False."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (true/false), got {raw!r}.")


def read_word(name: str) -> str:
    """Read an optional name that goes into Redis keys and queue names: no blanks, no ':'."""
    value = os.environ.get(name, "").strip()
    if any(c in value for c in " :\t\n"):
        raise ImproperlyConfigured(f"{name} must be a word without ':' or blanks, got {value!r}.")
    return value


def read_index_list(name: str) -> str:
    """Read an optional list of distinct non-negative integers such as ``0,1,2``."""
    value = os.environ.get(name, "").strip()
    _check_indices(name, value)
    return value


def read_index_groups(name: str) -> str:
    """Read optional ``;``-separated index lists such as ``0,1;2,3``."""
    value = os.environ.get(name, "").strip()
    for part in value.split(";"):
        _check_indices(name, part)
    return value


def _check_indices(name: str, raw: str) -> None:
    parts = [p for p in raw.replace(" ", "").split(",") if p != ""]
    if not all(p.isdigit() for p in parts) or len(set(map(int, parts))) != len(parts):
        raise ImproperlyConfigured(
            f"{name} must list distinct GPU indices like '0,1,2', got {raw!r}."
        )


def read_command(name: str) -> str:
    """Read an optional shell-style command line; unbalanced quotes fail here, not at launch."""
    value = os.environ.get(name, "").strip()
    try:
        shlex.split(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} is not a valid command line: {exc}.") from exc
    return value


# --- Core -----------------------------------------------------------------------------------

# Overridden with a required value in production.py; this one only serves development.
SECRET_KEY = read_secret("SECRET_KEY", "django-insecure-opentinker-development-only-key")
# Off unless asked for, in development too: Django's debug pages show tracebacks, settings and
# the server's environment to whoever triggers an error.
OPENTINKER_DEBUG = read_bool("OPENTINKER_DEBUG", False)
DEBUG = OPENTINKER_DEBUG
ALLOWED_HOSTS: list[str] = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])

OPENTINKER_DATA_DIR = Path(env.str("OPENTINKER_DATA_DIR", default=str(BASE_DIR / "var")))
try:
    OPENTINKER_DATA_DIR.mkdir(parents=True, exist_ok=True)
except OSError as exc:
    raise ImproperlyConfigured(f"OPENTINKER_DATA_DIR {OPENTINKER_DATA_DIR}: {exc}") from exc

_SUPPORTED_DB_ENGINES = {"django.db.backends.sqlite3", "django.db.backends.postgresql"}
_db_url = env.str("DATABASE_URL", default=f"sqlite:///{OPENTINKER_DATA_DIR / 'db.sqlite3'}")
try:
    _db = environ.Env.db_url_config(_db_url)
except (ValueError, KeyError, ImproperlyConfigured) as exc:
    raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {exc}") from exc
if _db.get("ENGINE") not in _SUPPORTED_DB_ENGINES:
    raise ImproperlyConfigured(
        "DATABASE_URL must be a sqlite:/// or postgres:// URL "
        f"(got engine {_db.get('ENGINE') or 'none'!r})."
    )
DATABASES = {"default": _db}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Web process, Celery workers and tests share the file. Wait for locks instead of failing,
    # and take the write lock when a transaction begins: with SQLite's default (deferred) a
    # transaction that reads and then writes fails at once with "database is locked" when
    # another one got there first, and a read-then-insert quota check could admit too many.
    _sqlite_options = DATABASES["default"].setdefault("OPTIONS", {})
    _sqlite_options.setdefault("timeout", 20)
    _sqlite_options.setdefault("transaction_mode", "IMMEDIATE")

# Unset means "start the embedded Valkey" in local.py / test.py; production requires it.
REDIS_URL: str | None = env.str("REDIS_URL", default=None) or None
if REDIS_URL is not None and not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    raise ImproperlyConfigured(f"REDIS_URL must be a redis:// URL, got {REDIS_URL!r}.")

# --- OpenTinker -----------------------------------------------------------------------------

# HMAC key for API key hashes. Changing it invalidates every issued key.
OPENTINKER_KEY_HMAC_SECRET = read_secret(
    "OPENTINKER_KEY_HMAC_SECRET",
    "opentinker-development-only-hmac-secret-do-not-use",
    min_length=32,
)
OPENTINKER_KEY_ROTATION_GRACE_HOURS = read_int(
    "OPENTINKER_KEY_ROTATION_GRACE_HOURS", 24, minimum=0, maximum=24 * 365
)
# The one knob from which lease TTL, heartbeat interval and broker timeouts are derived.
OPENTINKER_JOB_LEASE_SECONDS = read_int("OPENTINKER_JOB_LEASE_SECONDS", 30, minimum=3)
OPENTINKER_MAX_ATTEMPTS = read_int("OPENTINKER_MAX_ATTEMPTS", 3, minimum=1, maximum=100)
# Largest dataset file an upload may store (bytes); bigger uploads are refused with 413.
OPENTINKER_MAX_DATASET_BYTES = read_int("OPENTINKER_MAX_DATASET_BYTES", 50 * 1024 * 1024, minimum=1)

# Scheduling: a queued job's priority rises by one per AGING_SECONDS of waiting; a blocked job
# lets smaller ones backfill for BACKFILL_WINDOW_SECONDS before it reserves the pool.
OPENTINKER_AGING_SECONDS = read_int("OPENTINKER_AGING_SECONDS", 60, minimum=1)
OPENTINKER_BACKFILL_WINDOW_SECONDS = read_int("OPENTINKER_BACKFILL_WINDOW_SECONDS", 300, minimum=0)

# This node, as its GPU worker announces it. Empty names mean the host name.
OPENTINKER_NODE_NAME = read_word("OPENTINKER_NODE_NAME")
# GPU indices this node offers ("0,1,2,3"; empty: CUDA_VISIBLE_DEVICES, else nvidia-smi) and
# their topology groups ("0,1;2,3"); without GPUs the node offers CPU_SLOTS CPU slots.
OPENTINKER_GPUS = read_index_list("OPENTINKER_GPUS")
OPENTINKER_GPU_GROUPS = read_index_groups("OPENTINKER_GPU_GROUPS")
OPENTINKER_CPU_SLOTS = read_int("OPENTINKER_CPU_SLOTS", 2, minimum=1, maximum=1024)
# The address other nodes reach this one at, for the rendezvous of a job across nodes (rank
# 0's torch.distributed store); empty means the address the host name resolves to.
OPENTINKER_NODE_ADDRESS = env.str("OPENTINKER_NODE_ADDRESS", default="")
# How long the ranks of a job across nodes wait for each other: at the rendezvous, and in any
# one collective (a rank that died fails its peers at once; this bounds one that hangs).
OPENTINKER_GANG_TIMEOUT_SECONDS = read_int("OPENTINKER_GANG_TIMEOUT_SECONDS", 300, minimum=5)

# The verl trainer's command line (shell words); empty means the verl venv's main_ppo.
OPENTINKER_VERL_COMMAND = read_command("OPENTINKER_VERL_COMMAND")
# The venv `make verl-env` builds (scripts/build_verl_env.sh reads the same variable).
OPENTINKER_VERL_VENV = Path(
    env.str("OPENTINKER_VERL_VENV", default=str(BASE_DIR / "var" / "verl-venv"))
)
# A verl trainer that prints nothing new for this long is stopped and failed: vLLM and Ray
# failures hang the trainer instead of ending it.
OPENTINKER_VERL_STALL_SECONDS = read_int("OPENTINKER_VERL_STALL_SECONDS", 600, minimum=10)
# The embedded Valkey's directory; empty means a fresh temporary one per process tree.
OPENTINKER_VALKEY_DIR = env.str("OPENTINKER_VALKEY_DIR", default="")
# The training library reads this switch from the environment itself (it has no Django);
# declaring it here checks its spelling when the service starts.
OPENTINKER_ONEDNN_LINEAR = read_bool("OPENTINKER_ONEDNN_LINEAR", True)

# Tinker protocol: per-team model limit, sample queue bound, long-poll wait, future lifetime,
# and the model workers' idle exit, session timeout, torch threads and batch gathering wait
# (unset: 0 ms on a CPU, 3 ms on an accelerator).
OPENTINKER_TINKER_MAX_MODELS_PER_TEAM = read_int(
    "OPENTINKER_TINKER_MAX_MODELS_PER_TEAM", 64, minimum=0
)
OPENTINKER_TINKER_SAMPLE_QUEUE_LIMIT = read_int(
    "OPENTINKER_TINKER_SAMPLE_QUEUE_LIMIT", 256, minimum=1
)
# OpenAI-style serving (/v1): requests one team may have in flight at once, across its keys
# and base models (more are answered 429), so that one team cannot take a whole queue.
OPENTINKER_OPENAI_TEAM_CONCURRENCY = read_int("OPENTINKER_OPENAI_TEAM_CONCURRENCY", 32, minimum=1)
# A stream's text leaves the model worker at most this often (its first text at once): each
# event costs the worker, Valkey, the web server and the client the same whatever it holds,
# so a few tokens per event instead of one cut that cost several times. 0: every token.
OPENTINKER_OPENAI_STREAM_INTERVAL_MS = read_int(
    "OPENTINKER_OPENAI_STREAM_INTERVAL_MS", 50, minimum=0, maximum=1000
)
# Fully fine-tuned policies a model worker holds at once beside its base model (each a whole
# model in device memory, with a decode batch of its own), and how long one may sit idle
# before its memory is given back.
OPENTINKER_OPENAI_FULL_MODELS = read_int("OPENTINKER_OPENAI_FULL_MODELS", 2, minimum=1)
OPENTINKER_OPENAI_FULL_IDLE_SECONDS = read_int(
    "OPENTINKER_OPENAI_FULL_IDLE_SECONDS", 300, minimum=1
)
# Browser origins allowed to call /v1 (a chat UI that runs in the browser): "*" or a list
# such as "https://chat.example.org". Empty (the default): no CORS headers, preflights 405.
# /v1 authenticates by Bearer key, never by cookie, so no credentials are allowed either way.
OPENTINKER_OPENAI_CORS_ORIGINS: list[str] = env.list("OPENTINKER_OPENAI_CORS_ORIGINS", default=[])
# A chat request that names no max_tokens may generate this many tokens at most; 0 (OpenAI's
# default): the rest of the base model's context.
OPENTINKER_OPENAI_DEFAULT_MAX_TOKENS = read_int(
    "OPENTINKER_OPENAI_DEFAULT_MAX_TOKENS", 0, minimum=0
)
OPENTINKER_TINKER_LONG_POLL_SECONDS = read_int(
    "OPENTINKER_TINKER_LONG_POLL_SECONDS", 10, minimum=0, maximum=300
)
OPENTINKER_TINKER_FUTURE_TTL_SECONDS = read_int(
    "OPENTINKER_TINKER_FUTURE_TTL_SECONDS", 3600, minimum=10
)
OPENTINKER_TINKER_WORKER_IDLE_SECONDS = read_int(
    "OPENTINKER_TINKER_WORKER_IDLE_SECONDS", 600, minimum=1
)
# ... or this long while a queued job waits for GPUs (its models' state goes to disk first).
OPENTINKER_TINKER_WORKER_YIELD_SECONDS = read_int(
    "OPENTINKER_TINKER_WORKER_YIELD_SECONDS", 30, minimum=1
)
OPENTINKER_TINKER_SESSION_TIMEOUT_SECONDS = read_int(
    "OPENTINKER_TINKER_SESSION_TIMEOUT_SECONDS", 300, minimum=10
)
OPENTINKER_TINKER_TORCH_THREADS = read_int("OPENTINKER_TINKER_TORCH_THREADS", 2, minimum=1)
# The most rows (samples and choices) a model worker's decode batch takes: the Tinker
# sample and OpenAI-style requests read beyond it wait until rows leave, so that a queue of
# large requests cannot build a batch whose KV cache outgrows the device. A request larger
# than this still runs, alone.
OPENTINKER_TINKER_SAMPLE_BATCH_ROWS = read_int(
    "OPENTINKER_TINKER_SAMPLE_BATCH_ROWS", 1024, minimum=1
)
# A model's requests wait this long on a seq_id that never arrives (a client that spent it
# and never sent it) before they fail, instead of waiting for the session to end.
OPENTINKER_TINKER_SEQ_GAP_SECONDS = read_int(
    "OPENTINKER_TINKER_SEQ_GAP_SECONDS", 120, minimum=1, maximum=24 * 3600
)
# How often a model worker adds the GPU time it spent on each team's requests to the
# database (the monthly GPU-hours quota): a team's spent month is refused this late at most.
OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS = read_int(
    "OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS", 10, minimum=0, maximum=3600
)
# Directories an ImageAssetPointerChunk may point into (a path list, os.pathsep-separated);
# empty: asset pointers must carry their image as a data URI.
OPENTINKER_IMAGE_ASSET_ROOTS: list[Path] = [
    Path(p).resolve()
    for p in env.str("OPENTINKER_IMAGE_ASSET_ROOTS", default="").split(os.pathsep)
    if p
]
OPENTINKER_TINKER_GATHER_MS: int | None = (
    read_int("OPENTINKER_TINKER_GATHER_MS", 0, minimum=0, maximum=1000)
    if os.environ.get("OPENTINKER_TINKER_GATHER_MS", "") != ""
    else None
)

# --- Django ---------------------------------------------------------------------------------

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "accounts",
    "jobs",
    "workers",
    "environments",
    "tinker_api",
    # Web UI: server-rendered pages and sign-in (django-allauth, TOTP through allauth.mfa).
    "allauth",
    "allauth.account",
    "allauth.mfa",
    "django_htmx",
    "web",
]

# The sidecar ships Swagger UI and Redoc inside the wheel, so /api/docs/ works without a CDN.
SPECTACULAR_SIDECAR = importlib.util.find_spec("drf_spectacular_sidecar") is not None
if SPECTACULAR_SIDECAR:
    INSTALLED_APPS.append("drf_spectacular_sidecar")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Serves collected static files under gunicorn, so production needs no separate server.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "allauth.account.middleware.AccountMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "opentinker_site.errors.RedisUnavailableMiddleware",
]

ROOT_URLCONF = "opentinker_site.urls"
WSGI_APPLICATION = "opentinker_site.wsgi.application"
ASGI_APPLICATION = "opentinker_site.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "web.context.web_context",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = OPENTINKER_DATA_DIR / "static"
# WhiteNoise scans it at start; it exists (empty) until collectstatic fills it.
STATIC_ROOT.mkdir(exist_ok=True)
STATICFILES_DIRS = [p for p in [BASE_DIR / "static"] if p.is_dir()]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGIN_URL = "account_login"

# --- Web sign-in (django-allauth) ------------------------------------------------------------

AUTHENTICATION_BACKENDS = [
    "django.contrib.auth.backends.ModelBackend",
    "allauth.account.auth_backends.AuthenticationBackend",
]
# Administrators switch self sign-up off here; invited users then get accounts from the admin.
OPENTINKER_ALLOW_SIGNUP = read_bool("OPENTINKER_ALLOW_SIGNUP", True)
ACCOUNT_ADAPTER = "web.adapter.AccountAdapter"
ACCOUNT_LOGIN_METHODS = {"username", "email"}
ACCOUNT_SIGNUP_FIELDS = ["email*", "username*", "password1*", "password2*"]
ACCOUNT_EMAIL_VERIFICATION = "mandatory"
ACCOUNT_UNIQUE_EMAIL = True
ACCOUNT_CONFIRM_EMAIL_ON_GET = False
ACCOUNT_LOGIN_ON_EMAIL_CONFIRMATION = True
ACCOUNT_EMAIL_SUBJECT_PREFIX = "[OpenTinker] "
LOGIN_REDIRECT_URL = "web:jobs"
ACCOUNT_LOGOUT_REDIRECT_URL = "account_login"
# How often the live parts of the pages (jobs list, job status, charts) poll, in seconds.
OPENTINKER_WEB_LIVE_SECONDS = read_int("OPENTINKER_WEB_LIVE_SECONDS", 2, minimum=1, maximum=300)
MFA_SUPPORTED_TYPES = ["totp", "recovery_codes"]
MFA_TOTP_ISSUER = "OpenTinker"
# Console by default (mail is printed by the web process); EMAIL_URL=smtp+tls://user:pw@host:587
# sends real mail.
_email = env.email_url("EMAIL_URL", default="consolemail://")
EMAIL_BACKEND = _email["EMAIL_BACKEND"]
EMAIL_HOST = _email.get("EMAIL_HOST") or "localhost"
EMAIL_PORT = int(_email.get("EMAIL_PORT") or 25)
EMAIL_HOST_USER = _email.get("EMAIL_HOST_USER") or ""
EMAIL_HOST_PASSWORD = _email.get("EMAIL_HOST_PASSWORD") or ""
EMAIL_USE_TLS = bool(_email.get("EMAIL_USE_TLS", False))
EMAIL_USE_SSL = bool(_email.get("EMAIL_USE_SSL", False))
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="OpenTinker <noreply@localhost>")

# --- API ------------------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # First class decides the 401 challenge header: clients are told to send a Bearer key.
        "accounts.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "accounts.pagination.CreatedCursorPagination",
    "DEFAULT_FILTER_BACKENDS": ["accounts.filters.StrictFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # JSON only (the dataset upload takes multipart itself): form encodings have no null and
    # no nesting, so an empty form field would pass for a missing value.
    "DEFAULT_PARSER_CLASSES": ["accounts.parsers.DepthLimitedJSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "accounts.renderers.SurrogateSafeJSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "OpenTinker API",
    "DESCRIPTION": "Self-hosted reinforcement-learning post-training as a service.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "accounts.schema.document_errors",
    ],
}
if SPECTACULAR_SIDECAR:
    SPECTACULAR_SETTINGS.update(
        SWAGGER_UI_DIST="SIDECAR",
        SWAGGER_UI_FAVICON_HREF="SIDECAR",
        REDOC_DIST="SIDECAR",
    )

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
