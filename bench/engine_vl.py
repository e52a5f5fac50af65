"""Vision-language rows of `bench/engine.py` (`--only vl`): the tiny VL model (models/tiny-vl,
Qwen2.5-VL architecture), geometry problems with their diagram in every prompt.

5. vl-train:  `forward_backward` + `optim_step` tokens/s vs transformers + peft (LoRA on the
              language model, the vision tower frozen in both) on the same batch, the same
              images (goal >= 1.0x).
6. vl-sample: 8 adapters x 8 prompts with images in one multi-LoRA batch vs 8 sequential
              single-adapter peft `generate` calls with the same images, fixed length
              (goal >= 1.0x).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from training import geometry, ops, vision
from training.engine import Engine
from training.lora import DEFAULT_TARGET_MODULES
from training.sampler import generate
from training.types import AdamParams, Datum, SamplingParams

VL_MODEL = "tiny-vl"
RANK, ALPHA, LR = 8, 16, 1e-4
TRAIN_ROWS = 16
N_ADAPTERS, PROMPTS_PER_ADAPTER, SAMPLE_TOKENS = 8, 8, 16


def _prompts(engine: Engine, n: int, seed: int) -> list[tuple[list[int], vision.ImageInput, str]]:
    """(prompt tokens with the image's placeholders expanded, the image, the answer)."""
    spec = vision.spec_of(engine.model)
    assert spec is not None, f"{VL_MODEL} is not a vision-language model"
    out = []
    for p in geometry.problems(range(seed, seed + n)):
        image = engine.encode_image(p.image)
        text = p.problem.replace("<image>", "").strip()
        messages = [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": text}],
            }
        ]
        text = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        tokens = vision.expand_placeholders(ids, [image], spec.image_token_id)
        out.append((tokens, image, p.answer))
    return out


def _peft_model(adapters: int) -> Any:
    from peft import LoraConfig, get_peft_model

    from training.model import load_base

    model, _ = load_base(VL_MODEL, device="cpu", dtype=torch.float32)
    spec = vision.spec_of(model)
    assert spec is not None
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=list(DEFAULT_TARGET_MODULES),
        exclude_modules=rf"{re.escape(spec.tower_prefix)}\..*",
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config, adapter_name="a0")
    for i in range(1, adapters):
        peft_model.add_adapter(f"a{i}", config)
    return peft_model


def _hf_images(images: list[vision.ImageInput]) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.cat([i.pixel_values for i in images]),
        "image_grid_thw": torch.tensor([i.grid_thw for i in images]),
    }


def bench_vl_train(interleaved: Any) -> dict[str, float]:
    engine = Engine(VL_MODEL, device="cpu")
    spec = vision.spec_of(engine.model)
    assert spec is not None
    eos = engine.tokenizer.eos_token_id
    rows = []
    for prompt, image, answer in _prompts(engine, TRAIN_ROWS, seed=7000):
        reply = engine.tokenizer.encode(f"\\boxed{{{answer}}}", add_special_tokens=False)
        rows.append((prompt + reply + [eos], len(prompt), image))
    datums = []
    for sequence, prompt_len, image in rows:
        weights = [0.0] * (prompt_len - 1) + [1.0] * (len(sequence) - prompt_len)
        datums.append(
            Datum(
                model_input=sequence[:-1],
                loss_fn_inputs={"target_tokens": sequence[1:], "weights": weights},
                images=(image,),
            )
        )
    n_tokens = sum(len(s) - 1 for s, _, _ in rows)
    policy = engine.create_policy(rank=RANK, alpha=ALPHA, seed=0)
    adam = AdamParams(learning_rate=LR)

    def ours() -> None:
        ops.forward_backward(policy, datums, "cross_entropy")
        ops.optim_step(policy, adam)

    peft_model = _peft_model(1)
    peft_model.train()
    optim = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR)
    width = max(len(s) for s, _, _ in rows)
    ids = torch.full((len(rows), width), engine.tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    weights = torch.zeros((len(rows), width - 1))
    for i, (sequence, prompt_len, _) in enumerate(rows):
        ids[i, : len(sequence)] = torch.tensor(sequence)
        attn[i, : len(sequence)] = 1
        weights[i, prompt_len - 1 : len(sequence) - 1] = 1.0
    targets = ids[:, 1:]
    pictures = _hf_images([image for _, _, image in rows])
    inputs = ids[:, :-1]
    token_types = (inputs == spec.image_token_id).int()

    def theirs() -> None:
        logits = peft_model(
            input_ids=inputs,
            attention_mask=attn[:, :-1],
            mm_token_type_ids=token_types,
            **pictures,
        ).logits
        logp = (
            torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        )
        loss = -(logp * weights).sum()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    mine, base = interleaved(ours, theirs, rounds=3, reps=3)
    return {
        "tokens": n_tokens,
        "ours_tok_s": n_tokens / mine,
        "peft_tok_s": n_tokens / base,
        "ratio": base / mine,
    }


def bench_vl_sample(interleaved: Any) -> dict[str, float]:
    engine = Engine(VL_MODEL, device="cpu")
    tokenizer = engine.tokenizer
    gen = torch.Generator().manual_seed(0)
    keys = []
    for i in range(N_ADAPTERS):
        policy = engine.create_policy(rank=RANK, alpha=ALPHA, seed=i)
        with torch.no_grad():
            for _, b in policy.lora_weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
        keys.append(policy.version_key(policy.snapshot()))
    prompts = _prompts(engine, PROMPTS_PER_ADAPTER, seed=9000)
    params = SamplingParams(max_tokens=SAMPLE_TOKENS, temperature=1.0, seed=0)
    all_prompts = [p for p, _, _ in prompts] * N_ADAPTERS
    all_images = [[image] for _, image, _ in prompts] * N_ADAPTERS
    all_keys = [k for k in keys for _ in prompts]
    n_tokens = len(all_prompts) * SAMPLE_TOKENS

    def ours() -> None:
        seqs = generate(
            engine.model,
            tokenizer,
            all_prompts,
            params,
            adapters=all_keys,
            host=engine.host,
            images=all_images,
            stop_on_eos=False,
        )
        assert all(len(s.tokens) == SAMPLE_TOKENS for s in seqs)

    peft_model = _peft_model(N_ADAPTERS)
    peft_model.eval()
    width = max(len(p) for p, _, _ in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, _, _) in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    pictures = _hf_images([image for _, image, _ in prompts])

    def theirs() -> None:
        with torch.no_grad():
            for i in range(N_ADAPTERS):
                peft_model.set_adapter(f"a{i}")
                out = peft_model.generate(
                    input_ids=ids,
                    attention_mask=attn,
                    **pictures,
                    max_new_tokens=SAMPLE_TOKENS,
                    min_new_tokens=SAMPLE_TOKENS,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    pad_token_id=tokenizer.pad_token_id,
                )
                assert out.shape[1] == width + SAMPLE_TOKENS

    mine, base = interleaved(ours, theirs, rounds=3, reps=2)
    return {
        "tokens": n_tokens,
        "ours_tok_s": n_tokens / mine,
        "peft_tok_s": n_tokens / base,
        "ratio": base / mine,
    }
