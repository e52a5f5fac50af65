"""Where the client finds its server and key: arguments, environment, the login file."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from opentinker import config
from opentinker.errors import ConfigError


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
