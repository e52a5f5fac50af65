"""What a node offers: configured GPUs, CUDA_VISIBLE_DEVICES, or CPU slots."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from workers import devices, inventory


@pytest.fixture
def node_settings(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    settings.OPENTINKER_NODE_NAME = "n7"
    settings.OPENTINKER_GPUS = ""
    settings.OPENTINKER_GPU_GROUPS = ""
    for var in ("OPENTINKER_GPUS", "OPENTINKER_GPU_GROUPS", "OPENTINKER_CPU_SLOTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return settings


def test_it_offers_cpu_slots_without_gpus(node_settings: Any) -> None:
    node_settings.OPENTINKER_CPU_SLOTS = 3
    inv = inventory.detect_inventory()
    assert (inv.node, inv.kind, inv.gpus, inv.groups) == ("n7", "cpu", [0, 1, 2], [])
    assert devices.device_names("cpu", [1]) == ["cpu"]


def test_it_reads_configured_gpus_and_groups(node_settings: Any) -> None:
    node_settings.OPENTINKER_GPUS = "0,1,2,3"
    node_settings.OPENTINKER_GPU_GROUPS = "0,1;2,3"
    inv = inventory.detect_inventory()
    assert (inv.kind, inv.gpus, inv.groups) == ("gpu", [0, 1, 2, 3], [[0, 1], [2, 3]])


def test_it_reads_cuda_visible_devices_and_maps_devices(
    node_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    inv = inventory.detect_inventory()
    assert (inv.kind, inv.gpus) == ("gpu", [2, 3])
    # Physical GPU 3 is the process's second visible device.
    assert devices.device_names("gpu", [3]) == ["cuda:1"]


def test_it_rejects_a_malformed_gpu_list(node_settings: Any) -> None:
    node_settings.OPENTINKER_GPUS = "0,x"
    with pytest.raises(ImproperlyConfigured, match="OPENTINKER_GPUS"):
        inventory.detect_inventory()
    node_settings.OPENTINKER_GPUS = "1,1"
    with pytest.raises(ImproperlyConfigured, match="distinct"):
        inventory.detect_inventory()


def test_it_reports_the_largest_announced_node(
    node_settings: Any, clean_control_plane: Any
) -> None:
    assert inventory.max_block_size() == 0  # nobody announced: unknown
    table = inventory.lock_table()
    table.announce("a", [0, 1], ttl=30)
    table.announce("b", list(range(4)), ttl=30)
    table.withdraw("b")  # a node that is down still counts: it may come back
    assert inventory.max_block_size() == 4


def test_it_accepts_gpu_settings_given_as_lists(node_settings: Any) -> None:
    node_settings.OPENTINKER_GPUS = [0, 1, 2, 3]
    node_settings.OPENTINKER_GPU_GROUPS = [[0, 1], [2, 3]]
    inv = inventory.detect_inventory()
    assert (inv.gpus, inv.groups) == ([0, 1, 2, 3], [[0, 1], [2, 3]])
