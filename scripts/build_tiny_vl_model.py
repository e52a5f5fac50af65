"""Build the project's tiny vision-language model (models/tiny-vl) from nothing, deterministically.

    .venv/bin/python scripts/build_tiny_vl_model.py [--out models/tiny-vl] [--threads 1]

Steps: take the tiny chat model (models/tiny-chat: its tokenizer and its language model, which
already answers arithmetic in ChatML), add the image tokens ``<|vision_start|>``,
``<|vision_end|>`` and ``<|image_pad|>`` and a chat template that writes an image part as
``<|vision_start|><|image_pad|><|vision_end|>`` (as Qwen2.5-VL's does), put its language
model inside a Qwen2.5-VL architecture with a small vision tower (random), and pre-train the
whole model briefly on synthetic image-question pairs (`training.geometry`): naming a shape
and its colour, reading a number, and geometry3k-style problems; every fourth example is a
text-only chat example of the tiny model's own data, so it keeps what it knew. The loss is on
the assistant turns only. Pre-training stops once greedy accuracy on a validation split of the
geometry problems reaches STOP_ACCURACY (RL has the rest of the way to go), or at MAX_STEPS.
Accuracy is reported on a held-out split of seeds never trained on.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from tokenizers import AddedToken
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2ForCausalLM,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from training import data, geometry, vision
from training.sampler import generate
from training.types import SamplingParams

SEED = 4321
TEXT_MODEL = REPO / "models" / "tiny-chat"
IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]

VISION_CONFIG = {
    "depth": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_heads": 4,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "in_channels": 3,
}
# 112 x 112 images: 8 x 8 patches of 14 pixels, 16 tokens after the 2 x 2 merge. Larger
# images are scaled down to at most 224 x 224 (64 tokens).
PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 224 * 224, "patch_size": 14, "merge_size": 2}

BATCH = 32
LR = 1e-3
WARMUP = 30
MAX_STEPS = 1500
MIN_LR_FRACTION = 0.1
EVAL_FROM, EVAL_EVERY = 200, 50
STOP_ACCURACY = 0.3
# Seeds of the geometry problems: training, validation (the stop rule) and held-out test.
TRAIN_SEEDS = range(1_000_000, 2_000_000)
VAL_SEEDS = range(100, 300)
TEST_SEEDS = range(100)
TEXT_EVERY = 4


def build_tokenizer(out: Path) -> Any:
    tok = AutoTokenizer.from_pretrained(str(TEXT_MODEL))
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS], special_tokens=True
    )
    tok.chat_template = vision.CHATML_VISION_TEMPLATE
    tok.save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))


def build_model(tok: Any) -> Qwen2_5_VLForConditionalGeneration:
    text: Any = Qwen2ForCausalLM.from_pretrained(str(TEXT_MODEL), local_files_only=True)
    tc = text.config
    ids = tok.convert_tokens_to_ids(IMAGE_TOKENS)
    head_dim = tc.hidden_size // tc.num_attention_heads
    eighth = head_dim // 16
    config = Qwen2_5_VLConfig(
        text_config={
            "hidden_size": tc.hidden_size,
            "intermediate_size": tc.intermediate_size,
            "num_hidden_layers": tc.num_hidden_layers,
            "num_attention_heads": tc.num_attention_heads,
            "num_key_value_heads": tc.num_key_value_heads,
            "vocab_size": len(tok),
            "max_position_embeddings": tc.max_position_embeddings,
            "rms_norm_eps": tc.rms_norm_eps,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                # Temporal, height and width sections of the rotary half-dimension (as
                # Qwen2.5-VL's 16/24/24 of 64).
                "mrope_section": [2 * eighth, 3 * eighth, 3 * eighth],
            },
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "bos_token_id": None,
        },
        vision_config={**VISION_CONFIG, "out_hidden_size": tc.hidden_size},
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[1],
        image_token_id=ids[2],
        video_token_id=ids[2],
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(SEED)
    model = Qwen2_5_VLForConditionalGeneration(config)
    lm: Any = model.model.language_model
    state = {k.removeprefix("model."): v for k, v in text.state_dict().items()}
    embed = state.pop("embed_tokens.weight")
    state.pop("lm_head.weight", None)
    missing, unexpected = lm.load_state_dict(state, strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected, (missing, unexpected)
    with torch.no_grad():
        new = lm.embed_tokens.weight
        new[: embed.shape[0]] = embed
        # The image tokens start at the mean embedding: a neutral point of the model's space.
        new[embed.shape[0] :] = embed.mean(dim=0)
    model.tie_weights()
    return model


def _image_example(tok: Any, processor: Any, png: bytes, question: str, answer: str) -> Any:
    image = vision.encode_image(processor, png)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = vision.expand_placeholders(
        tok.encode(prompt, add_special_tokens=False),
        [image],
        tok.convert_tokens_to_ids("<|image_pad|>"),
    )
    body = tok.encode(answer + "<|im_end|>", add_special_tokens=False)
    return ids + body, [-100] * len(ids) + body, [image]


def _text_example(tok: Any, conv: data.Conversation) -> Any:
    ids: list[int] = []
    labels: list[int] = []
    for message in conv:
        head = tok.encode(f"<|im_start|>{message['role']}\n", add_special_tokens=False)
        body = tok.encode(message["content"] + "<|im_end|>", add_special_tokens=False)
        tail = tok.encode("\n", add_special_tokens=False)
        trained = message["role"] == "assistant"
        ids += head + body + tail
        labels += (
            [-100] * len(head) + (body if trained else [-100] * len(body)) + [-100] * len(tail)
        )
    return ids, labels, []


_ADDITION = data.addition_split()[0]


def geometry_question(p: geometry.Problem) -> str:
    return p.problem.removeprefix("<image>")


def example(rng: random.Random, tok: Any, processor: Any, index: int) -> Any:
    if index % TEXT_EVERY == TEXT_EVERY - 1:
        if rng.random() < 0.5:
            return _text_example(tok, data.misc_chat(rng))
        return _text_example(tok, data.addition_chat_from(rng, _ADDITION, "equation"))
    kind = rng.random()
    if kind < 0.4:
        p = geometry.problem(rng.choice(TRAIN_SEEDS), values_in_text=rng.random() < 0.5)
        return _image_example(
            tok, processor, p.image, geometry_question(p), f"\\boxed{{{p.answer}}}"
        )
    if kind < 0.7:
        png, value = geometry.number_picture(rng)
        return _image_example(
            tok, processor, png, "What number is written in the picture?", f"\\boxed{{{value}}}"
        )
    png, shape, color = geometry.shape_picture(rng)
    if rng.random() < 0.5:
        return _image_example(tok, processor, png, "What shape is in the picture?", f"a {shape}")
    return _image_example(tok, processor, png, "What color is the shape?", color)


def collate(
    rows: list[Any], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Any]]:
    width = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (ids, lab, _) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, : len(lab)] = torch.tensor(lab)
        mask[r, : len(ids)] = 1
    return input_ids, labels, mask, [images for _, _, images in rows]


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def accuracy(model: Any, tok: Any, processor: Any, seeds: range) -> tuple[float, dict[str, float]]:
    """Greedy accuracy on the geometry problems of ``seeds`` (values in the figure only)."""
    model.eval()
    problems = geometry.problems(list(seeds))
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    prompts, images = [], []
    for p in problems:
        image = vision.encode_image(processor, p.image)
        text = tok.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": geometry_question(p)}],
                }
            ],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompts.append(
            vision.expand_placeholders(tok.encode(text, add_special_tokens=False), [image], pad)
        )
        images.append([image])
    outs = generate(
        model, tok, prompts, SamplingParams(max_tokens=12, temperature=0.0), images=images
    )
    right: dict[str, list[int]] = {}
    for p, out in zip(problems, outs):
        found = _BOXED.findall(tok.decode(out.tokens, skip_special_tokens=True))
        right.setdefault(p.kind, []).append(int(bool(found) and found[-1].strip() == p.answer))
    model.train()
    total = sum(sum(v) for v in right.values()) / len(problems)
    return total, {k: sum(v) / len(v) for k, v in sorted(right.items())}


# Qwen2.5-VL's processor and vLLM's model name a video placeholder whether or not a model
# sees videos (vLLM looks it up for every image request; transformers takes the unknown
# token's id, the padding, for it otherwise). It is added after pre-training as one more
# vocabulary row of zeros: its logit is 0, about 1e-5 of the probability mass where the
# other rows' logits lie, and the samplers never draw a placeholder anyway.
VIDEO_TOKEN = "<|video_pad|>"


def add_video_token(model: Any, tok: Any) -> None:
    """Give ``model`` and ``tok`` the video placeholder (in place), if they lack it."""
    if VIDEO_TOKEN in tok.get_vocab():
        return
    tok.add_tokens([AddedToken(VIDEO_TOKEN, special=True, normalized=False)], special_tokens=True)
    rows = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[rows:] = 0
    model.config.video_token_id = tok.convert_tokens_to_ids(VIDEO_TOKEN)


def patch_video_token(directory: Path) -> None:
    """Add the video placeholder to a model this script built before it did so."""
    tok = AutoTokenizer.from_pretrained(str(directory))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(directory), dtype=torch.float32, local_files_only=True
    )
    add_video_token(model, tok)
    model.save_pretrained(str(directory), safe_serialization=True)
    tok.save_pretrained(str(directory))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(REPO / "models" / "tiny-vl"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS)
    parser.add_argument(
        "--patch-video-token",
        action="store_true",
        help="only add the video placeholder to the model already in --out (no pre-training)",
    )
    args = parser.parse_args()
    if args.patch_video_token:
        patch_video_token(Path(args.out))
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    tok = build_tokenizer(out)
    processor = Qwen2VLImageProcessorPil(**PROCESSOR)
    model = build_model(tok)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(SEED)

    def lr_factor(s: int) -> float:
        if s < WARMUP:
            return (s + 1) / WARMUP
        progress = min(1.0, (s - WARMUP) / max(1, args.max_steps - WARMUP))
        return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))

    history = []
    step = 0
    val = 0.0
    for step in range(args.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = LR * lr_factor(step)
        rows = [example(rng, tok, processor, i) for i in range(BATCH)]
        input_ids, labels, mask, images = collate(rows, tok.pad_token_id)
        logits = vision.logits(model, input_ids, mask, images)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - started:.0f}s)", flush=True)
        if step >= EVAL_FROM and (step - EVAL_FROM) % EVAL_EVERY == 0:
            val, per_kind = accuracy(model, tok, processor, VAL_SEEDS)
            history.append({"step": step, "val_accuracy": val})
            print(f"step {step}: validation accuracy {val:.3f} {per_kind}", flush=True)
            if val >= STOP_ACCURACY:
                break
    model.eval()
    test, per_kind = accuracy(model, tok, processor, TEST_SEEDS)
    add_video_token(model, tok)
    tok.save_pretrained(str(out))
    model.save_pretrained(str(out), safe_serialization=True)
    processor.save_pretrained(str(out))
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(
        str(out)
    )
    report = {
        "steps": step + 1,
        "seconds": round(time.time() - started),
        "threads": args.threads,
        "validation_accuracy": val,
        "test_accuracy": test,
        "test_accuracy_by_kind": per_kind,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vision_parameters": sum(p.numel() for p in model.model.visual.parameters()),
        "history": history,
    }
    (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
