"""Loading base models from local paths, with the Hugging Face hub switched off.

The same call loads the project's tiny model on a laptop CPU and Qwen2.5-0.5B (or any other
causal LM saved in Hugging Face format) from a path on a GPU machine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASE_MODEL = str(REPO_ROOT / "models" / "tiny-chat")

# Short names accepted wherever a base model path is, so specs and tests need no absolute paths.
TINY_VL_MODEL = str(REPO_ROOT / "models" / "tiny-vl")
ALIASES: dict[str, str] = {
    "tiny": DEFAULT_BASE_MODEL,
    "tiny-chat": DEFAULT_BASE_MODEL,
    "tiny-vl": TINY_VL_MODEL,
}

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ModelNotFound(FileNotFoundError):
    """The base model path does not hold a Hugging Face model directory."""


def resolve_base_path(path: str | os.PathLike[str] | None) -> Path:
    """Turn an alias, a relative or an absolute path into an existing model directory."""
    if path is None:
        path = DEFAULT_BASE_MODEL
    text = str(path)
    resolved = Path(ALIASES.get(text, text)).expanduser()
    if not resolved.is_absolute() and not resolved.exists():
        # Relative paths are tried against the repository too (e.g. "models/tiny-chat").
        resolved = REPO_ROOT / resolved
    if not resolved.is_dir():
        raise ModelNotFound(
            f"base model {text!r}: no directory at {resolved} (aliases: {sorted(ALIASES)}; "
            "build the tiny model with `python scripts/build_tiny_model.py`)"
        )
    if not (resolved / "config.json").is_file():
        raise ModelNotFound(f"base model {text!r}: {resolved} has no config.json")
    return resolved


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        # CPUs compute float32 fastest and exactly; GPUs take bf16 when they support it.
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_DTYPES)}") from None


def _hub_off() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a base model; pad falls back to eos so batched padding always works."""
    _hub_off()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_base_path(path)), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base(
    path: str | os.PathLike[str] | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from a local directory or alias; the model is in eval mode.

    `device` defaults to CUDA when available; `dtype` to bf16 on capable GPUs, else float32.
    """
    _hub_off()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from training.vision import VISION_MODEL_TYPES

    base = resolve_base_path(path)
    target = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, target)
    config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    # A vision-language model (Qwen2-VL family) is an image-text-to-text model, not a causal
    # LM in transformers' registry; its forward still gives next-token logits.
    auto = (
        AutoModelForImageTextToText
        if config.model_type in VISION_MODEL_TYPES
        else AutoModelForCausalLM
    )
    model = auto.from_pretrained(str(base), local_files_only=True, dtype=torch_dtype)
    # PreTrainedModel.to is wrapped with functools.wraps(nn.Module.to), whose stub type
    # takes the module as its first argument.
    model.to(target)  # type: ignore[arg-type]
    model.eval()
    tokenizer = load_tokenizer(base)
    return model, tokenizer
