"""Tiny random vision-language models (Qwen2.5-VL and Qwen3-VL architectures) built from
configs, their image processor, and synthetic images: engine tests of the vision path need no
files and no network."""

from __future__ import annotations

import io
import random
from typing import Any

import torch
from tokenizers import AddedToken
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.training.conftest import build_tiny_tokenizer

IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
ARCHITECTURES = ("qwen2_5_vl", "qwen3_vl")


def vl_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS], special_tokens=True
    )
    return tokenizer


def image_ids(tokenizer: Any) -> tuple[int, int, int]:
    start, end, pad = tokenizer.convert_tokens_to_ids(IMAGE_TOKENS)
    return int(start), int(end), int(pad)


def build_vl_model(architecture: str, tokenizer: Any, seed: int = 0) -> Any:
    start, end, pad = image_ids(tokenizer)
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    common = {
        "image_token_id": pad,
        "video_token_id": pad,
        "vision_start_token_id": start,
        "vision_end_token_id": end,
        "tie_word_embeddings": True,
    }
    if architecture == "qwen2_5_vl":
        config: Any = Qwen2_5_VLConfig(
            text_config={
                **text,
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                },
            },
            vision_config={
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": 64,
                "window_size": 56,
                "fullatt_block_indexes": [1],
            },
            **common,
        )
        model_class: Any = Qwen2_5_VLForConditionalGeneration
    elif architecture == "qwen3_vl":
        config = Qwen3VLConfig(
            text_config={
                **text,
                "head_dim": 16,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                    "mrope_interleaved": True,
                },
            },
            vision_config={
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "out_hidden_size": 64,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
            },
            **common,
        )
        model_class = Qwen3VLForConditionalGeneration
    else:
        raise ValueError(architecture)
    torch.manual_seed(seed)
    model = model_class(config)
    # Random init is too close to uniform for images and adapters to matter; widen it.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    return model.eval()


def processor() -> Any:
    return Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=112 * 112, patch_size=14, merge_size=2
    )


def picture(seed: int, size: tuple[int, int] = (84, 56)) -> bytes:
    """A PNG of random coloured rectangles."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, y0 = rng.randrange(size[0] - 10), rng.randrange(size[1] - 10)
        x1, y1 = x0 + rng.randint(5, 30), y0 + rng.randint(5, 30)
        color = tuple(rng.randrange(256) for _ in range(3))
        draw.rectangle([(x0, y0), (x1, y1)], fill=color)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def save_vl_model(path: Any, architecture: str = "qwen2_5_vl") -> Any:
    """A tiny random vision-language model directory: weights, tokenizer with the project's
    ChatML vision template, and image processor config (what `training.model.load_base` and
    `Engine` read)."""
    from training.vision import CHATML_VISION_TEMPLATE

    tokenizer = vl_tokenizer()
    tokenizer.chat_template = CHATML_VISION_TEMPLATE
    tokenizer.eos_token = "<|eos|>"
    build_vl_model(architecture, tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor().save_pretrained(path)
    return path


def solid(color: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> bytes:
    """A PNG of one colour: pictures as different as pictures get."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()
