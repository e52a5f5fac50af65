"""Lets torchvision's Python code import beside the CPU torch of the verl venv.

The torchvision wheels the package index has for this torch are CUDA builds: their compiled
ops (`_C.so`) need libtorch_cuda and do not load, and `import torchvision` then fails where
it registers fake kernels for two ops that were never defined ("operator torchvision::nms
does not exist"). The vision-language path needs torchvision importable (transformers builds
Qwen2.5-VL's video processor with it, qwen_vl_utils imports it) but runs none of its compiled
ops: images are resized and normalised with torch and PIL. So, right before torchvision is
first imported, in any process of the venv (Ray's workers, vLLM's engine and the subprocess
in which vLLM inspects a model), this defines those two ops' schemas. Calling them would
still fail: there is no kernel.

`scripts/build_verl_env.sh` copies this module into the venv's site-packages with a `.pth`
line that imports it at interpreter start; it imports nothing heavy until torchvision is
asked for.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

# The library object must live as long as the process: its definitions go with it.
_LIBRARY: Any = None


def _define_ops() -> None:
    global _LIBRARY
    import torch

    if torch.version.cuda is not None:
        return  # a CUDA torch loads torchvision's own compiled ops
    try:
        torch.ops.torchvision.nms  # noqa: B018 (defined already: the real ops or an earlier call)
        return
    except (AttributeError, RuntimeError):
        pass
    # FRAGMENT: a second "DEF" library of the namespace in one process is an error.
    _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
    _LIBRARY.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARY.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            _define_ops()
        return None  # the regular finders import torchvision itself


if not any(isinstance(finder, _BeforeTorchvision) for finder in sys.meta_path):
    sys.meta_path.insert(0, _BeforeTorchvision())
