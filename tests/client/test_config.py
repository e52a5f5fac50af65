"""Where the client finds its server and key: arguments, environment, the login file."""

from __future__ import annotations

import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opentinker import Client, config
from opentinker.errors import ConfigError
from tests.client.fakes import FakeApi


def test_it_saves_a_file_only_its_owner_can_read(client_config: Path) -> None:
    path = config.save_file(config.Settings(url="http://h:1/", api_key='otk_a"b\\c'))
    assert path == client_config
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # Quotes and backslashes survive the TOML round trip.
    assert config.load_file() == config.Settings(url="http://h:1/", api_key='otk_a"b\\c')


def test_it_tightens_the_mode_of_an_existing_file(client_config: Path) -> None:
    client_config.parent.mkdir(parents=True)
    client_config.write_text('url = "x"\n')
    client_config.chmod(0o644)
    config.save_file(config.Settings(url="http://h", api_key="k"))
    assert stat.S_IMODE(client_config.stat().st_mode) == 0o600


def test_it_reads_json_config_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.json"
    monkeypatch.setenv("OPENTINKER_CONFIG", str(path))
    config.save_file(config.Settings(url="http://j", api_key="kj"))
    assert path.read_text().startswith("{")
    assert config.load_file() == config.Settings(url="http://j", api_key="kj")


def test_arguments_beat_environment_beat_file(
    client_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config.save_file(config.Settings(url="http://file", api_key="k-file"))
    assert config.resolve() == config.Settings(url="http://file", api_key="k-file")
    monkeypatch.setenv("OPENTINKER_URL", "http://env/")
    assert config.resolve() == config.Settings(url="http://env", api_key="k-file")
    assert config.resolve(api_key="k-arg") == config.Settings(url="http://env", api_key="k-arg")


def test_it_says_how_to_configure_when_nothing_is_set(client_config: Path) -> None:
    with pytest.raises(ConfigError, match="opentinker login"):
        config.resolve()
    client_config.parent.mkdir(parents=True)
    client_config.write_text("url = [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read the config file"):
        config.resolve()
    client_config.write_text("url = 3\n")
    with pytest.raises(ConfigError, match="must be strings"):
        config.resolve()


def test_it_reads_the_retry_count_from_the_environment(
    client_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert config.retries() == config.DEFAULT_RETRIES
    monkeypatch.setenv("OPENTINKER_RETRIES", "0")
    assert config.retries() == 0
    monkeypatch.setenv("OPENTINKER_RETRIES", "lots")
    with pytest.raises(ConfigError, match="OPENTINKER_RETRIES must be an integer"):
        config.retries()


def test_a_config_file_that_is_not_an_object_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.json"
    path.write_text("[1, 2]")
    monkeypatch.setenv("OPENTINKER_CONFIG", str(path))
    with pytest.raises(ConfigError, match=f"{path}: expected an object .* got list"):
        config.resolve()


def test_login_reports_a_file_it_cannot_save_and_leaves_no_key_behind(
    fake_api: FakeApi, cli: Callable[..., Any], tmp_path: Path
) -> None:
    fake_api.reply("GET /api/v1/me", 200, {"username": "olivia", "teams": []})
    login = ("login", "--url", fake_api.url, "--api-key", "otk_secret_value_1")
    as_directory = tmp_path / "confdir"
    as_directory.mkdir()
    under_a_file = tmp_path / "plain" / "config.toml"
    (tmp_path / "plain").write_text("not a directory")
    for path, reason in (
        (as_directory, "it is a directory"),
        (under_a_file, f"{under_a_file.parent} is not a directory"),
    ):
        result = cli(*login, env={"OPENTINKER_CONFIG": str(path)})
        assert result.exit_code == 2
        assert result.stderr.strip() == f"error: cannot save the config file {path}: {reason}"
    # No temporary file holding the key anywhere.
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and "otk_" in p.read_text()]


def test_login_saves_the_key_without_the_whitespace_it_was_pasted_with(
    fake_api: FakeApi, cli: Callable[..., Any], client_config: Path
) -> None:
    fake_api.reply("GET /api/v1/me", 200, {"username": "olivia", "teams": []})
    result = cli("login", "--url", f" {fake_api.url}/ ", "--api-key", " otk_pasted_key\r\n")
    assert result.exit_code == 0, result.stderr
    assert config.load_file() == config.Settings(url=fake_api.url, api_key="otk_pasted_key")
    assert [p.name for p in client_config.parent.iterdir()] == ["config.toml"]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://[::1", "invalid server URL 'http://[::1': Invalid port"),
        ("notaurl", "invalid server URL 'notaurl': expected http://host"),
        ("ftp://host", "invalid server URL 'ftp://host': expected http://host"),
    ],
)
def test_a_bad_url_is_a_usage_error(
    fake_api: FakeApi, cli: Callable[..., Any], url: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Client(url, "otk_k")
    result = cli("--url", url, "jobs", env={"OPENTINKER_API_KEY": "otk_k"})
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {message}") and result.stderr.count("\n") == 1


SECRET = "otk_s3cr3tS3CR3Ts3cr3t"


@pytest.mark.parametrize(
    ("key", "char"),
    [
        (SECRET + "é", "U+00E9"),
        (SECRET[:10] + " " + SECRET[10:], "U+0020"),
        (SECRET + "\x00", "U+0000"),
    ],
)
def test_a_key_no_header_can_carry_is_refused_without_echoing_it(
    fake_api: FakeApi, cli: Callable[..., Any], key: str, char: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Client(fake_api.url, key)
    assert SECRET not in str(info.value) and "otk_s3cr\u2026" in str(info.value)
    result = cli("--api-key", key, "whoami", env={"OPENTINKER_URL": fake_api.url})
    assert result.exit_code == 2
    assert f"contains {char}" in result.stderr and SECRET[8:] not in result.stderr
    assert fake_api.hits == []  # refused locally: never sent, never retried


def test_keys_are_stripped_from_every_source(
    fake_api: FakeApi, cli: Callable[..., Any], client_config: Path
) -> None:
    fake_api.reply("GET /api/v1/me", 200, {"username": "olivia", "teams": []})
    env = {"OPENTINKER_URL": fake_api.url, "OPENTINKER_API_KEY": SECRET + "\r"}
    result = cli("whoami", env=env)
    assert result.exit_code == 0, result.stderr
    client_config.parent.mkdir(parents=True)
    client_config.write_text(f'url = "{fake_api.url}"\napi_key = " {SECRET}\\n"\n')
    assert config.resolve().api_key == SECRET


def test_the_transport_never_puts_the_key_in_an_error(fake_api: FakeApi) -> None:
    # Past the checks of config.resolve (a Transport built directly): still no key in errors.
    from opentinker._http import Transport

    transport = Transport(fake_api.url, SECRET + "\r", retries=3)
    with pytest.raises(ConfigError) as info:
        transport.get("/api/v1/me")
    assert SECRET not in str(info.value)
    assert fake_api.hits == []


def test_a_config_path_that_is_a_directory_is_named(
    client_config: Path, cli: Callable[..., Any]
) -> None:
    client_config.mkdir(parents=True)
    result = cli("whoami")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"error: cannot read the config file {client_config}: it is a directory"
    )
