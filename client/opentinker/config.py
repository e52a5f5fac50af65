"""Where the client finds its server and key.

Order: explicit arguments, then ``OPENTINKER_URL`` / ``OPENTINKER_API_KEY``, then the config
file that ``opentinker login`` writes: ``$OPENTINKER_CONFIG`` or
``~/.config/opentinker/config.toml`` (``$XDG_CONFIG_HOME`` respected), mode 0600 since it
holds a secret.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

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
    if not path.is_file():
        return Settings()
    try:
        raw = path.read_text(encoding="utf-8")
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc}") from exc
    url, key = data.get("url"), data.get("api_key")
    if (url is not None and not isinstance(url, str)) or (
        key is not None and not isinstance(key, str)
    ):
        raise ConfigError(f"{path}: `url` and `api_key` must be strings")
    return Settings(url=url, api_key=key)


def save_file(settings: Settings, path: Path | None = None) -> Path:
    """Write the settings, readable by the owner only (created 0600, never world-readable)."""
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = {k: v for k, v in (("url", settings.url), ("api_key", settings.api_key)) if v}
    if path.suffix == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        # A JSON string literal is a valid TOML basic string for these values.
        text = "".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items())
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def resolve(url: str | None = None, api_key: str | None = None) -> Settings:
    """Arguments win over the environment, which wins over the config file."""
    url = url or os.environ.get(ENV_URL)
    api_key = api_key or os.environ.get(ENV_KEY)
    if not url or not api_key:
        saved = load_file()
        url = url or saved.url
        api_key = api_key or saved.api_key
    if not url:
        raise ConfigError(f"no server URL: pass url=..., set {ENV_URL}, or run `opentinker login`")
    if not api_key:
        raise ConfigError(f"no API key: pass api_key=..., set {ENV_KEY}, or run `opentinker login`")
    return Settings(url=url.rstrip("/"), api_key=api_key)


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
