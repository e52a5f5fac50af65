"""The shards `make test` runs side by side cover the suite exactly once, balanced by cost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sharding import assign, parse_shard

ROOT = Path(__file__).resolve().parents[2]


def test_units_go_longest_first_to_the_least_loaded_shard() -> None:
    costs = {"a.py": 10.0, "b.py": 6.0, "c.py": 5.0, "d.py": 4.0, "e.py": 1.0}
    shards = assign(costs, 2)
    loads = [sum(c for u, c in costs.items() if shards[u] == s) for s in range(2)]
    assert shards["a.py"] != shards["b.py"]
    assert sorted(loads) == [12.0, 14.0]
    assert assign(costs, 2) == shards  # the same split in every shard's process


@pytest.mark.parametrize("value", ["3", "0/2", "3/2", "a/b", "1/2/3"])
def test_a_bad_shard_value_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match="OPENTINKER_TEST_SHARD"):
        parse_shard(value)


def _pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Collect the tests under ``tmp_path`` with only the sharding plugin loaded."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.sharding", "--collect-only", "-q"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _collect(tmp_path: Path, shard: str, unit: str = "file") -> set[str]:
    result = _pytest(tmp_path, OPENTINKER_TEST_SHARD=shard, OPENTINKER_TEST_SHARD_UNIT=unit)
    assert result.returncode in (0, 5), result.stdout + result.stderr
    return {line for line in result.stdout.splitlines() if "::" in line}


def test_the_shards_partition_the_collected_tests(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for f in range(5):
        body = "".join(f"def test_{t}():\n    pass\n" for t in range(f + 1))
        (tmp_path / f"test_f{f}.py").write_text(body)
    everything = _collect(tmp_path, "1/1")
    assert len(everything) == 15
    for unit in ("file", "test"):
        parts = [_collect(tmp_path, f"{i}/3", unit) for i in (1, 2, 3)]
        assert set().union(*parts) == everything
        assert sum(len(p) for p in parts) == len(everything)
        assert all(parts)
        if unit == "file":
            files = [{t.split("::")[0] for t in p} for p in parts]
            assert not (files[0] & files[1]) and not (files[1] & files[2])


def test_a_bad_shard_value_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    result = _pytest(tmp_path, OPENTINKER_TEST_SHARD="5/2")
    assert result.returncode == 4
    assert "OPENTINKER_TEST_SHARD='5/2'" in result.stderr
