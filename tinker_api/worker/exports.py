"""External weights as the cookbook's ``weights`` module reads Tinker's adapters.

``build_hf_model`` strips ``base_model.model.`` from each adapter key and looks the rest up
in the base model's weights, except the output head: Tinker names it ``model.unembed_tokens``
and the cookbook merges it into ``lm_head`` when the model has one, or into the shared
``model.embed_tokens`` when the head is tied to the input embeddings (where no
``lm_head.weight`` exists). An untied head keeps peft's ``lm_head`` name, which both read;
a tied head's adapter is renamed the cookbook's way and left out of peft's
``target_modules``, so peft loads the rest of the adapter (it cannot express that merge).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

ADAPTER = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_HEAD = "base_model.model.lm_head."
_UNEMBED = "base_model.model.model.unembed_tokens."


def ties_head(model: Any) -> bool:
    """Whether the base model's output head shares the input embeddings (the config says;
    the engine's LoRA host may have wrapped the head module itself)."""
    config = model.config
    text = getattr(config, "get_text_config", lambda: config)()
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def as_cookbook_adapter(folder: Path, *, tied_head: bool) -> None:
    if not tied_head:
        return
    path = folder / ADAPTER
    weights = load_file(str(path))
    if not any(k.startswith(_HEAD) for k in weights):
        return
    renamed = {
        _UNEMBED + k.removeprefix(_HEAD) if k.startswith(_HEAD) else k: v
        for k, v in weights.items()
    }
    save_file(renamed, str(path), metadata={"format": "pt"})
    config = json.loads((folder / CONFIG).read_text())
    targets = config.get("target_modules") or []
    if isinstance(targets, list):
        config["target_modules"] = [t for t in targets if t != "lm_head"]
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def encrypt(folder: Path, recipients: list[str]) -> None:
    """Encrypt every file to the age keys (``<name>.age``, the plain file removed), as the
    cookbook's ``weights.download`` decrypts them."""
    if not recipients:
        return
    import pyrage

    keys = [pyrage.x25519.Recipient.from_str(r) for r in recipients]
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        pyrage.encrypt_file(str(f), str(f.with_name(f.name + ".age")), keys)
        f.unlink()
