"""Data migrations of tinker_api, run back and forth on a real database."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client

from tests.tinker_api.test_protocol import api, new_model, new_session
from tinker_api.models import Checkpoint

pytestmark = pytest.mark.usefixtures("clean_tinker_keys", "tinker_data_dir")

BEFORE = [("tinker_api", "0003_session_display_name")]


def _migrate(target: list[tuple[str, str]]) -> Any:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    return executor.migrate(target)


def test_the_seq_id_leaves_the_clients_metadata_for_a_column(
    tinker_base: Any, owner_key: tuple[Any, str], transactional_db: None
) -> None:
    client, key = Client(), owner_key[1]
    _, model_id = new_model(client, key, new_session(client, key))
    save = {"model_id": model_id, "seq_id": 4, "path": "m", "user_metadata": {"run": "7"}}
    assert api(client, key, "save_weights", save).status_code == 200
    pk = Checkpoint.objects.get(model_id=model_id, name="m").pk
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes("tinker_api")
    try:
        state = _migrate(BEFORE)
        old = state.apps.get_model("tinker_api", "Checkpoint").objects.get(pk=pk)
        # Backwards, the seq_id went where the earlier code looks for it.
        assert old.user_metadata == {"run": "7", "_seq": "4"}
        old.user_metadata = {"_seq": "9"}
        old.save()
    finally:
        _migrate(latest)
    row = Checkpoint.objects.get(pk=pk)
    assert (row.seq, row.user_metadata) == (9, None)
