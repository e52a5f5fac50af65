"""Vision-language models: images as the engine feeds them to Qwen2-VL-family models.

A vision-language policy sees a sequence in which every image is a run of placeholder tokens
(the model's ``image_token_id``, as many as the image gives after the vision tower's patch
merge); the image itself travels beside the tokens as an `ImageInput` (its patches and their
grid, what the model's image processor returns). The vision tower turns the patches into one
embedding per placeholder, and the language model reads them in place of the placeholder
embeddings.

Everything here goes through the model's own modules (`model.model`: the tower, the merge, the
language model; `get_rope_index` for the 3-D rotary positions), so Qwen2-VL, Qwen2.5-VL and
Qwen3-VL checkpoints run through the same calls, the tiny one the project builds included. The
engine computes the rotary positions itself instead of letting the model keep them between
calls (it caches `rope_deltas` on the module): a batch of rows of different images and lengths,
and rows joining and leaving a decode, each need their own.

LoRA adapts the language model only: the vision tower runs once over the patches of every
image of a batch at once, not per batch row, so per-row adapter routing does not apply to it.
A fully fine-tuned policy trains its tower as well.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# ChatML with Qwen2.5-VL's rendering of image parts (one placeholder between the vision
# markers, which the engine then repeats as many times as the image fills): the chat template
# of the project's tiny vision-language model.
CHATML_VISION_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Model types whose forward takes ``pixel_values`` and ``image_grid_thw`` and whose inner
# model has ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=, attention_mask=)``.
VISION_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image as the vision tower takes it."""

    pixel_values: torch.Tensor
    """(patches, channels x temporal patch x patch x patch) float32, the processor's output."""
    grid_thw: tuple[int, int, int]
    """Patches along time, height and width (before the merge)."""
    tokens: int
    """Placeholder tokens the image fills in the sequence: t x h x w / merge^2."""
    digest: str = field(default="")
    """Content hash: rows with the same prompt and the same images share a prefill."""

    def __post_init__(self) -> None:
        if self.pixel_values.dim() != 2:
            raise ValueError(
                f"pixel_values must be (patches, dim), got {tuple(self.pixel_values.shape)}"
            )
        t, h, w = self.grid_thw
        if t * h * w != self.pixel_values.shape[0]:
            raise ValueError(
                f"grid {self.grid_thw} holds {t * h * w} patches, pixel_values has "
                f"{self.pixel_values.shape[0]}"
            )
        if self.tokens < 1:
            raise ValueError("an image fills at least one token")
        if not self.digest:
            data = self.pixel_values.detach().to("cpu", torch.float32).contiguous().numpy()
            digest = hashlib.blake2b(data.tobytes(), digest_size=16)
            digest.update(repr(self.grid_thw).encode())
            object.__setattr__(self, "digest", digest.hexdigest())


@dataclass(frozen=True)
class VisionSpec:
    """What the engine needs to know of a vision-language model."""

    image_token_id: int
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    merge_size: int
    tower_prefix: str
    """Module name prefix of the vision tower (its Linears are never LoRA targets)."""


def spec_of(model: nn.Module) -> VisionSpec | None:
    """The model's vision spec; None for a text-only model."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in VISION_MODEL_TYPES:
        return None
    inner: Any = getattr(model, "model", None)
    tower = getattr(inner, "visual", None)
    if tower is None:
        return None
    prefix = next(name for name, module in model.named_modules() if module is tower)
    return VisionSpec(
        image_token_id=int(config.image_token_id),
        vision_start_token_id=getattr(config, "vision_start_token_id", None),
        vision_end_token_id=getattr(config, "vision_end_token_id", None),
        merge_size=int(config.vision_config.spatial_merge_size),
        tower_prefix=prefix,
    )


def is_vision_model(model: nn.Module) -> bool:
    return spec_of(model) is not None


def in_tower(name: str, spec: VisionSpec | None) -> bool:
    if spec is None:
        return False
    return name == spec.tower_prefix or name.startswith(spec.tower_prefix + ".")


# ------------------------------------------------------------------------------ processing


def load_processor(path: str) -> Any:
    """The model's image processor (PIL backend: it needs neither torchvision nor a GPU)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)


def open_image(data: bytes | Any) -> Any:
    """A PIL image in RGB from encoded bytes (PNG, JPEG) or a PIL image."""
    from PIL import Image

    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            image = Image.open(io.BytesIO(bytes(data)))
            image.load()
        except Exception as exc:
            raise ValueError(f"not a readable image: {exc}") from None
    else:
        image = data
    return image if image.mode == "RGB" else image.convert("RGB")


def encode_image(processor: Any, image: bytes | Any) -> ImageInput:
    """Run the model's image processor over one image (bytes or PIL)."""
    out = processor(images=[open_image(image)], return_tensors="pt")
    grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
    merge = int(getattr(processor, "merge_size", 2))
    t, h, w = grid
    return ImageInput(
        pixel_values=out["pixel_values"].to(torch.float32),
        grid_thw=(t, h, w),
        tokens=t * h * w // (merge * merge),
    )


# ------------------------------------------------------------------------------ forward


def batch_images(
    spec: VisionSpec,
    input_ids_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    images_B: Sequence[Sequence[ImageInput]] | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(pixel_values, image_grid_thw, mm_token_type_ids) of a batch, after checking that each
    row holds exactly the placeholders its images fill."""
    device = input_ids_B_T.device
    placeholders_B_T = (input_ids_B_T == spec.image_token_id) & (mask_B_T != 0)
    counts = placeholders_B_T.sum(dim=1).tolist()
    rows = list(images_B) if images_B is not None else [[] for _ in counts]
    if len(rows) != len(counts):
        raise ValueError(f"{len(rows)} image lists for {len(counts)} rows")
    for b, (count, images) in enumerate(zip(counts, rows)):
        wanted = sum(image.tokens for image in images)
        if count != wanted:
            raise ValueError(
                f"row {b}: {count} image placeholder tokens, but its {len(images)} image(s) "
                f"fill {wanted}"
            )
    flat = [image for images in rows for image in images]
    if not flat:
        return None, None, placeholders_B_T.int()
    pixels = torch.cat([image.pixel_values for image in flat]).to(device)
    grid = torch.tensor([image.grid_thw for image in flat], dtype=torch.long, device=device)
    return pixels, grid, placeholders_B_T.int()


def rope_positions(
    model: nn.Module,
    input_ids_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    grid: torch.Tensor | None,
    mm_B_T: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, B, T) rotary positions and (B,) the offset of the next text position from the
    row's length (an image advances the position by its side, not by its token count)."""
    inner: Any = getattr(model, "model")  # noqa: B009 - the Hugging Face inner model
    positions, deltas = inner.get_rope_index(
        input_ids_B_T, mm_B_T, image_grid_thw=grid, attention_mask=mask_B_T
    )
    return positions, deltas.reshape(-1)


def hidden_states(
    model: nn.Module,
    input_ids_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    images_B: Sequence[Sequence[ImageInput]] | None,
) -> torch.Tensor:
    """(B, T, H) last hidden states of a batch whose rows may hold images."""
    spec = spec_of(model)
    if spec is None:
        raise ValueError("this model has no vision tower")
    mask = mask_B_T.long()
    pixels, grid, mm = batch_images(spec, input_ids_B_T, mask, images_B)
    positions, _ = rope_positions(model, input_ids_B_T, mask, grid, mm)
    inner: Any = getattr(model, "model")  # noqa: B009
    out = inner(
        input_ids=input_ids_B_T,
        attention_mask=mask,
        position_ids=positions,
        pixel_values=pixels,
        image_grid_thw=grid,
        mm_token_type_ids=mm,
        use_cache=False,
    )
    return out.last_hidden_state


def logits(
    model: nn.Module,
    input_ids_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    images_B: Sequence[Sequence[ImageInput]] | None = None,
) -> torch.Tensor:
    """(B, T, V) logits of any causal LM; rows of a vision-language model may hold images."""
    if spec_of(model) is None:
        if images_B is not None and any(images_B):
            raise ValueError("this model has no vision tower: it cannot take images")
        return model(input_ids=input_ids_B_T, attention_mask=mask_B_T).logits
    hidden = hidden_states(model, input_ids_B_T, mask_B_T, images_B)
    head: Any = model.get_output_embeddings()  # type: ignore[operator]
    return head(hidden)


def expand_placeholders(
    tokens: Sequence[int], images: Sequence[ImageInput], image_token_id: int
) -> list[int]:
    """Tokens of a rendered prompt whose images are one placeholder each (what a chat
    template writes) with each placeholder repeated as many times as its image fills."""
    out: list[int] = []
    pending = iter(images)
    found = 0
    for token in tokens:
        if token != image_token_id:
            out.append(int(token))
            continue
        image = next(pending, None)
        if image is None:
            raise ValueError(
                f"the prompt has more image placeholders than its {len(images)} images"
            )
        out.extend([image_token_id] * image.tokens)
        found += 1
    if found != len(images):
        raise ValueError(f"the prompt has {found} image placeholders for {len(images)} images")
    return out
