"""The fused decoder against the model's own forward: same logits for prefill and every step."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config

from training.decoder import FusedDecoder, HFDecoder, decoder_for
from training.lora import DEFAULT_TARGET_MODULES, LoRAHost
from training.sampler import generate, sequence_logprobs
from training.types import SamplingParams

from .conftest import build_tiny_model
from .test_lora import random_adapter

# float32 sums in another order (packed prefill, explicit decode attention): differences of a
# few units in the 6th significant digit of logits of size ~1-3.
ATOL, RTOL = 3e-5, 1e-5
PROMPTS = [[5, 17, 40, 41, 99], [8, 120], [33, 34, 35, 36, 37, 38, 39, 60, 61], [250], [7, 7, 7]]


def _padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _run(decoder, prompts, keys, steps=6, drop_after=3, keep=(0, 2, 3)):
    """Prefill, then decode `steps` fixed tokens; rows not in `keep` leave after `drop_after`."""
    ids, mask, positions = _padded(prompts)
    keys = list(keys)
    with torch.no_grad():
        logits, state = decoder.prefill(ids, mask, positions, keys, ids.shape[1] + steps)
        out = [logits]
        next_pos = positions[:, -1] + 1
        for step in range(steps):
            if step == drop_after:
                index = torch.tensor(keep)
                decoder.select(state, index)
                next_pos = next_pos.index_select(0, index)
                keys = [keys[i] for i in keep]
            tokens = torch.arange(len(keys)) * 13 + step * 7 + 3
            out.append(decoder.step(tokens, next_pos, keys, state))
            next_pos = next_pos + 1
    return out


def _assert_same(fused, reference):
    assert len(fused) == len(reference)
    for got, expected in zip(fused, reference):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("stack_min", [2, 1000], ids=["grouped-bmm", "loop"])
def test_it_matches_the_model_forward_with_mixed_adapters(tiny_model, stack_min):
    host = LoRAHost(tiny_model, DEFAULT_TARGET_MODULES, stack_min_adapters=stack_min)
    for i in range(3):
        host.register(f"p{i}", random_adapter(host, seed=i), 2.0, frozen=i != 1)
    # Unequal groups, out of order, one row on the base model.
    keys = ["p1", None, "p0", "p1", "p2"]
    assert FusedDecoder.supports(tiny_model)
    fused = _run(FusedDecoder(tiny_model, host), PROMPTS, keys)
    reference = _run(HFDecoder(tiny_model, host), PROMPTS, keys)
    _assert_same(fused, reference)
    # The adapters make a difference (the comparison is not base model against base model).
    base = _run(FusedDecoder(tiny_model, host), PROMPTS, [None] * len(PROMPTS))
    assert (base[0][0] - fused[0][0]).abs().max() > 1e-2


def test_its_prefill_gives_the_same_logits_with_key_value_heads_repeated(tiny_model):
    """On CUDA the prefill repeats the shared key/value heads instead of grouping them (so
    that attention with a mask keeps a fused kernel): the same logits, checked here on the
    CPU by asking for it."""
    host = LoRAHost(tiny_model, DEFAULT_TARGET_MODULES)
    host.register("p0", random_adapter(host, seed=0), 2.0)
    keys = ["p0", None, "p0", None, "p0"]
    grouped = FusedDecoder(tiny_model, host)
    repeated = FusedDecoder(tiny_model, host)
    assert grouped.group > 1 and not grouped.repeat_kv
    repeated.repeat_kv = True
    _assert_same(_run(repeated, PROMPTS, keys), _run(grouped, PROMPTS, keys))


def test_it_matches_the_model_forward_on_llama_with_biases_and_rope_scaling():
    model = build_tiny_model(
        300,
        architecture=(LlamaConfig, LlamaForCausalLM),
        intermediate_size=96,
        num_attention_heads=8,
        attention_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        tie_word_embeddings=False,
    )
    assert FusedDecoder.supports(model)
    host = LoRAHost(model, DEFAULT_TARGET_MODULES)
    host.register("a", random_adapter(host, seed=4), 2.0)
    keys = ["a", None, "a", None, "a"]
    _assert_same(
        _run(FusedDecoder(model, host), PROMPTS, keys), _run(HFDecoder(model, host), PROMPTS, keys)
    )


def test_it_leaves_other_models_to_their_own_forward(tiny_tokenizer):
    sliding = build_tiny_model(len(tiny_tokenizer))
    config = Qwen2Config(**{**sliding.config.to_dict(), "use_sliding_window": True})
    sliding.config = config
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=1, n_head=2)
    ).eval()
    for model in (sliding, gpt2):
        assert not FusedDecoder.supports(model)
        assert isinstance(decoder_for(model), HFDecoder)
    # generate runs them through the Hugging Face loop, with exact logprobs.
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=1)
    seqs = generate(gpt2, tiny_tokenizer, PROMPTS[:3], params, stop_on_eos=False)
    scored = sequence_logprobs(gpt2, [p + s.tokens for p, s in zip(PROMPTS, seqs)])
    for prompt, seq, ref in zip(PROMPTS, seqs, scored):
        expected = torch.tensor(ref[len(prompt) :])
        assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=0)


def test_generate_gives_the_same_tokens_with_either_backend(
    tiny_model, tiny_tokenizer, monkeypatch
):
    host = LoRAHost(tiny_model, DEFAULT_TARGET_MODULES)
    for i in range(2):
        host.register(f"p{i}", random_adapter(host, seed=i), 2.0, frozen=True)
    prompts = PROMPTS * 2
    keys = ["p0", "p1", None, "p0", "p1"] * 2
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    indices = list(range(len(prompts)))

    def run():
        return generate(
            tiny_model,
            tiny_tokenizer,
            prompts,
            params,
            adapters=keys,
            host=host,
            sample_indices=indices,
        )

    fused = run()
    monkeypatch.setattr("training.sampler.decoder_for", lambda model, host: HFDecoder(model, host))
    reference = run()
    for got, expected in zip(fused, reference):
        assert got.tokens == expected.tokens
        assert got.stop_reason == expected.stop_reason
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(torch.float32, 1e-4), (torch.bfloat16, 0.15)],
    ids=["float32", "bfloat16"],
)
def test_it_matches_the_model_forward_on_cuda(tiny_tokenizer, dtype, atol):
    model = build_tiny_model(len(tiny_tokenizer)).to("cuda", dtype)
    host = LoRAHost(model, DEFAULT_TARGET_MODULES)
    for i in range(2):
        weights = {
            name: (a.to("cuda", dtype), b.to("cuda", dtype))
            for name, (a, b) in random_adapter(host, seed=i).items()
        }
        host.register(f"p{i}", weights, 2.0, frozen=True)
    keys = ["p0", None, "p1", "p0", "p1"]

    def on_cuda(decoder):
        ids, mask, positions = (t.cuda() for t in _padded(PROMPTS))
        with torch.no_grad():
            logits, state = decoder.prefill(ids, mask, positions, keys, ids.shape[1] + 4)
            out = [logits.float().log_softmax(-1)]
            next_pos = positions[:, -1] + 1
            for step in range(4):
                tokens = (torch.arange(len(keys)) * 13 + step * 7 + 3).cuda()
                out.append(decoder.step(tokens, next_pos, keys, state).float().log_softmax(-1))
                next_pos = next_pos + 1
        return out

    fused, reference = on_cuda(FusedDecoder(model, host)), on_cuda(HFDecoder(model, host))
    for got, expected in zip(fused, reference):
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    seqs = generate(
        model,
        tiny_tokenizer,
        PROMPTS,
        SamplingParams(max_tokens=6, temperature=1.0, seed=2),
        adapters=keys,
        host=host,
        stop_on_eos=False,
    )
    assert all(len(s.tokens) == 6 for s in seqs)
