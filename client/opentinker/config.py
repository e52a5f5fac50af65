"""Where the client finds its server and key.

Order: explicit arguments, then ``OPENTINKER_URL`` / ``OPENTINKER_API_KEY``, then the config
file that ``opentinker login`` writes: ``$OPENTINKER_CONFIG`` or
``~/.config/opentinker/config.toml`` (``$XDG_CONFIG_HOME`` respected), mode 0600 since it
holds a secret.
"""

from __future__ import annotations

import json
import os
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import httpx

from .errors import ConfigError

ENV_URL = "OPENTINKER_URL"
ENV_KEY = "OPENTINKER_API_KEY"
ENV_CONFIG = "OPENTINKER_CONFIG"
ENV_RETRIES = "OPENTINKER_RETRIES"
DEFAULT_RETRIES = 4


def config_path() -> Path:
    override = os.environ.get(ENV_CONFIG)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "opentinker" / "config.toml"


@dataclass(frozen=True)
class Settings:
    url: str | None = None
    api_key: str | None = None


def load_file(path: Path | None = None) -> Settings:
    """The saved settings, or empty ones when there is no file."""
    path = path or config_path()
    if path.is_dir():
        # Not "no file": that would send the user to `opentinker login`, which cannot save it.
        raise ConfigError(f"cannot read the config file {path}: it is a directory")
    if not path.is_file():
        return Settings()
    try:
        raw = path.read_text(encoding="utf-8")
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: expected an object with `url` and `api_key`, got {type(data).__name__}"
        )
    url, key = data.get("url"), data.get("api_key")
    if (url is not None and not isinstance(url, str)) or (
        key is not None and not isinstance(key, str)
    ):
        raise ConfigError(f"{path}: `url` and `api_key` must be strings")
    return Settings(url=url, api_key=key)


def save_file(settings: Settings, path: Path | None = None) -> Path:
    """Write the settings, readable by the owner only (created 0600, never world-readable)."""
    path = path or config_path()
    if path.is_dir():
        raise ConfigError(f"cannot save the config file {path}: it is a directory")
    if path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(f"cannot save the config file {path}: {path.parent} is not a directory")
    data = {k: v for k, v in (("url", settings.url), ("api_key", settings.api_key)) if v}
    if path.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        # A JSON string literal is a valid TOML basic string for these values.
        text = "".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items())
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # mkstemp creates the file 0600 under a fresh name: the key is never readable by
        # others, not even for a moment, and no stale temporary file is ever reused.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode("utf-8"))
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise ConfigError(f"cannot save the config file {path}: {exc.strerror or exc}") from None
    return path


def redact(api_key: str) -> str:
    """Enough of a key to tell which one it is, never the secret: ``otk_abcd…``."""
    shown = api_key[: min(8, len(api_key) // 2)]
    return "".join(c if "!" <= c <= "~" else "?" for c in shown) + "\u2026"


def check_api_key(api_key: str) -> str:
    """The key without surrounding whitespace; refused (and never echoed) unless an HTTP
    header can carry it, since httpx's error for a bad header value quotes the header."""
    key = api_key.strip()
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if not key:
        raise ConfigError("the API key is empty")
    if bad is not None:
        raise ConfigError(
            f"the API key {redact(key)} contains U+{ord(bad):04X}: a key is printable ASCII "
            "without spaces (was it pasted with extra characters?)"
        )
    return key


def check_url(url: str) -> str:
    """The server URL without surrounding whitespace or a trailing slash, if it is one."""
    clean = url.strip().rstrip("/")
    try:
        parsed = httpx.URL(clean)
    except httpx.InvalidURL as exc:
        raise ConfigError(f"invalid server URL {clean!r}: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(
            f"invalid server URL {clean!r}: expected http://host[:port] or https://host[:port]"
        )
    return clean


def resolve(url: str | None = None, api_key: str | None = None) -> Settings:
    """Arguments win over the environment, which wins over the config file. Both values are
    checked here, so a bad one is a usage error before any request."""
    url = _given(url) or _given(os.environ.get(ENV_URL))
    api_key = _given(api_key) or _given(os.environ.get(ENV_KEY))
    if not url or not api_key:
        saved = load_file()
        url = url or _given(saved.url)
        api_key = api_key or _given(saved.api_key)
    if not url:
        raise ConfigError(f"no server URL: pass url=..., set {ENV_URL}, or run `opentinker login`")
    if not api_key:
        raise ConfigError(f"no API key: pass api_key=..., set {ENV_KEY}, or run `opentinker login`")
    return Settings(url=check_url(url), api_key=check_api_key(api_key))


def _given(value: str | None) -> str | None:
    # A value of only whitespace (an empty line pasted into a variable) counts as unset.
    return value.strip() or None if value else None


def retries() -> int:
    """Retries of an idempotent call on a network failure (``OPENTINKER_RETRIES``)."""
    raw = os.environ.get(ENV_RETRIES)
    if raw is None or raw == "":
        return DEFAULT_RETRIES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 20:
        raise ConfigError(f"{ENV_RETRIES} must be an integer from 0 to 20, got {raw!r}")
    return value
