"""The OpenAPI schema tells the truth: schemathesis, with every check it has, against a live
server. Undocumented status codes, answers that do not match their schema, invalid input
accepted, valid input refused or a 500 all fail this test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.live, pytest.mark.once, pytest.mark.timeout(600)]

CONFIG = Path(__file__).with_name("schemathesis.toml")


def test_it_holds_to_its_openapi_schema_under_schemathesis(
    live_server: Any, owner_key: tuple[Any, str], tmp_path: Path
) -> None:
    key = owner_key[1]
    headers = {"Authorization": f"Bearer {key}"}
    schema = httpx.get(f"{live_server.url}/api/schema/?format=json", headers=headers, timeout=30)
    assert schema.status_code == 200
    schema_path = tmp_path / "openapi.json"
    schema_path.write_text(json.dumps(schema.json()))
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run"),
        *(str(schema_path), "--url", live_server.url, "-H", f"Authorization: Bearer {key}"),
        *("--checks", "all", "--max-examples", "5", "--workers", "1", "--seed", "1"),
        # Revoking the key the run authenticates with would turn the rest into 401s; revocation
        # has its own tests (tests/api/test_keys_api.py).
        *("--exclude-path-regex", r"/keys/\{id\}/revoke"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=540, check=False)
    summary = result.stdout[-6000:]
    assert result.returncode == 0, summary
    assert " passed" in summary and "failure" not in summary.split("SUMMARY")[-1], summary
    print(summary.split("SUMMARY")[-1].strip())  # the counts, for `pytest -s`
