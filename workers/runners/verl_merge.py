"""One verl FSDP checkpoint -> a PEFT adapter or an HF model directory, in full precision.

Run by ``workers.runners.verl_export`` with the verl venv's python, as a script:

    python verl_merge.py --actor <global_step_N/actor> --out <dir> --kind lora|full

verl's own merger (``verl.model_merger``) casts every tensor to bfloat16; the actor trains in
float32, and an adapter rounded to bfloat16 no longer reproduces it. This one joins the
shards of ``model_world_size_<W>_rank_<R>.pt`` by their DTensor placement and keeps their
dtype. It imports torch, safetensors, transformers and peft only (no Django, no project).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

SHARD = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt$")
PEFT_PREFIX = "base_model.model."
# peft's exclude_modules (a regex matched against the whole module name) for the vision tower
# of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, which keep it under `visual`: the verl runner keeps
# LoRA off it (verl_config), and an exported adapter's bare target names (`gate_proj`) would
# match its layers too.
VISION_TOWER_MODULES = ".*visual.*"


def is_vision_language(actor: Path) -> bool:
    """The checkpoint's model has a vision tower (verl saved its config in huggingface/)."""
    path = actor / "huggingface" / "config.json"
    return path.is_file() and "vision_config" in json.loads(path.read_text())


def load_full_state_dict(actor: Path) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    shards = sorted(
        (int(m.group(2)), p) for p in actor.iterdir() if (m := SHARD.match(p.name)) is not None
    )
    if not shards:
        raise FileNotFoundError(f"no model shards in {actor}")
    parts = [torch.load(p, map_location="cpu", weights_only=False) for _, p in shards]
    merged: dict[str, Any] = {}
    for key, first in parts[0].items():
        if not isinstance(first, DTensor):
            merged[key] = first
            continue
        # FSDP2 shards along one mesh dimension (Shard(0)); a replicated entry is whole.
        placement = first.placements[-1]
        locals_ = [part[key]._local_tensor for part in parts]
        if placement.is_shard():
            merged[key] = torch.cat(locals_, dim=placement.dim)
        else:
            merged[key] = locals_[0]
    return {k: v.contiguous() for k, v in merged.items()}


def export_lora(state: dict[str, Any], actor: Path, out: Path) -> None:
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors = {}
    modules = set()
    for key, value in state.items():
        if ".lora_A." not in key and ".lora_B." not in key:
            continue
        # peft's in-memory name carries the adapter name ("default"); on disk it does not.
        name = key.replace(".default.weight", ".weight")
        tensors[name] = value
        modules.add(name.split(".")[-3])
    if not tensors:
        raise ValueError(f"the checkpoint in {actor} holds no LoRA weights")
    meta = json.loads((actor / "lora_train_meta.json").read_text())
    config = LoraConfig(
        r=int(meta["r"]),
        lora_alpha=meta["lora_alpha"],
        target_modules=sorted(modules),
        exclude_modules=VISION_TOWER_MODULES if is_vision_language(actor) else None,
        task_type=meta.get("task_type") or "CAUSAL_LM",
    ).to_dict()
    for field in ("task_type", "peft_type"):
        config[field] = getattr(config[field], "value", config[field])
    config["target_modules"] = sorted(config["target_modules"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(out / "adapter_model.safetensors"))


def export_full(state: dict[str, Any], actor: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    hf_dir = actor / "huggingface"
    config = AutoConfig.from_pretrained(str(hf_dir))
    dtype = next(iter(state.values())).dtype
    # A vision-language model has no causal-LM class: its own holds the tower and the LM.
    auto = AutoModelForImageTextToText if is_vision_language(actor) else AutoModelForCausalLM
    model = auto.from_config(config, torch_dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint does not match the model: {missing=} {unexpected=}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    # The tokenizer and generation config verl saved beside the model config.
    for path in hf_dir.iterdir():
        if path.is_file() and not (out / path.name).exists():
            shutil.copy2(path, out / path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--actor", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kind", choices=("lora", "full"), required=True)
    args = parser.parse_args(argv)
    state = load_full_state_dict(args.actor)
    if args.kind == "lora":
        export_lora(state, args.actor, args.out)
    else:
        export_full(state, args.actor, args.out)
    print(f"exported {args.kind} weights of {args.actor} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
