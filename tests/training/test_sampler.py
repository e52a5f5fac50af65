"""The batched KV-cache sampler: logprobs, seeds, stops, padding, multi-LoRA rows."""

from __future__ import annotations

import pytest
import torch

from training.engine import Engine
from training.sampler import (
    SampleRequest,
    compute_logprobs,
    generate,
    sample,
    sequence_logprobs,
)
from training.types import SamplingParams

PROMPTS = [[5, 17, 40, 41, 99], [8, 120], [33, 34, 35, 36, 37, 38, 39, 60, 61], [250]]


def _randomize_lora(policy, seed: int) -> None:
    """peft starts B at zero (adapter = base); give the adapter a visible effect."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, b in policy.lora_weights.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)


def test_it_returns_logprobs_equal_to_a_forward_pass_at_temperature_1(tiny_model, tiny_tokenizer):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    # Repeated prompts share one prefill whose cache is expanded: check those rows too.
    prompts = PROMPTS + PROMPTS[:2]
    seqs = generate(
        tiny_model,
        tiny_tokenizer,
        prompts,
        params,
        sample_indices=[0, 0, 0, 0, 1, 1],
        stop_on_eos=False,
    )
    assert seqs[0].tokens != seqs[4].tokens
    full = [p + s.tokens for p, s in zip(prompts, seqs)]
    scored = sequence_logprobs(tiny_model, full)
    for prompt, seq, ref in zip(prompts, seqs, scored):
        assert len(seq.tokens) == 12 and seq.stop_reason == "length"
        expected = torch.tensor(ref[len(prompt) :])
        assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_it_draws_tokens_with_the_softmax_probabilities(tiny_model, tiny_tokenizer, temperature):
    rows = 8000
    torch.manual_seed(0)
    seqs = generate(
        tiny_model,
        tiny_tokenizer,
        [PROMPTS[1]] * rows,
        SamplingParams(max_tokens=1, temperature=temperature),
    )
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([PROMPTS[1]])).logits[0, -1]
    expected = torch.softmax(logits / temperature, dim=-1)
    counts = torch.bincount(torch.tensor([s.tokens[0] for s in seqs]), minlength=expected.numel())
    total_variation = 0.5 * (counts / rows - expected).abs().sum().item()
    assert total_variation < 0.12, total_variation


def test_it_reproduces_seeded_samples_and_varies_with_the_seed(tiny_model, tiny_tokenizer):
    def run(seed: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=seed)
        return [s.tokens for s in generate(tiny_model, tiny_tokenizer, PROMPTS, params)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_it_draws_different_samples_for_n_of_one_seeded_request(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tokenizer=tiny_tokenizer)
    request = SampleRequest(PROMPTS[0], SamplingParams(max_tokens=8, seed=11), n=3)
    first = sample(engine, [request])[0]
    again = sample(engine, [request])[0]
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert len({tuple(s.tokens) for s in first}) == 3


def test_it_keeps_the_same_seeded_sample_whatever_else_is_in_the_batch(tiny_model, tiny_tokenizer):
    seeded = SamplingParams(max_tokens=10, seed=5)
    alone = generate(tiny_model, tiny_tokenizer, [PROMPTS[0]], seeded)[0]
    mixed = generate(
        tiny_model,
        tiny_tokenizer,
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
        [SamplingParams(max_tokens=4), seeded, SamplingParams(max_tokens=10, temperature=0.7)],
    )[1]
    assert mixed.tokens == alone.tokens


def test_it_stops_on_stop_token_ids_and_reports_stop(tiny_model, tiny_tokenizer):
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    ref = generate(tiny_model, tiny_tokenizer, [PROMPTS[0]], greedy, stop_on_eos=False)[0].tokens
    target = ref[4]
    cut = ref.index(target) + 1
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(target,))
    seq = generate(tiny_model, tiny_tokenizer, [PROMPTS[0]], params, stop_on_eos=False)[0]
    assert seq.tokens == ref[:cut]
    assert seq.stop_reason == "stop"


def test_it_stops_on_stop_strings_at_the_completing_token(tiny_model, tiny_tokenizer):
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    ref = generate(tiny_model, tiny_tokenizer, [PROMPTS[2]], greedy, stop_on_eos=False)[0].tokens
    text = tiny_tokenizer.decode(ref[:8], skip_special_tokens=False)
    stop = text[-2:]
    assert stop.strip(), "the reference text must end in visible characters"
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=(stop,))
    seq = generate(tiny_model, tiny_tokenizer, [PROMPTS[2]], params, stop_on_eos=False)[0]
    assert seq.stop_reason == "stop"
    assert seq.tokens == ref[: len(seq.tokens)]
    assert stop in tiny_tokenizer.decode(seq.tokens, skip_special_tokens=False)
    assert stop not in tiny_tokenizer.decode(seq.tokens[:-1], skip_special_tokens=False)


def test_it_stops_at_max_tokens_with_length_and_on_eos_by_default(tiny_model, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    seqs = generate(
        tiny_model,
        tiny_tokenizer,
        PROMPTS,
        [SamplingParams(max_tokens=m, temperature=0.0) for m in (1, 3, 5, 7)],
        stop_on_eos=False,
    )
    assert [len(s.tokens) for s in seqs] == [1, 3, 5, 7]
    assert all(s.stop_reason == "length" for s in seqs)
    # Force eos to be the argmax: the default stop set must end the row right there.
    with torch.no_grad():
        tiny_model.lm_head.weight[eos] *= 0
        tiny_model.model.norm.weight.abs_()
    bias_hook = tiny_model.lm_head.register_forward_hook(
        lambda _m, _i, out: out.index_add(
            -1, torch.tensor([eos]), torch.full_like(out[..., :1], 50.0)
        )
    )
    try:
        seq = generate(tiny_model, tiny_tokenizer, [PROMPTS[0]], SamplingParams(max_tokens=9))[0]
    finally:
        bias_hook.remove()
    assert seq.tokens == [eos] and seq.stop_reason == "stop"


def test_it_gives_left_padded_batches_the_results_of_one_by_one(tiny_model, tiny_tokenizer):
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (9, 4, 12, 6)]
    batched = generate(tiny_model, tiny_tokenizer, PROMPTS, params, stop_on_eos=False)
    for prompt, p, got in zip(PROMPTS, params, batched):
        alone = generate(tiny_model, tiny_tokenizer, [prompt], p, stop_on_eos=False)[0]
        assert got.tokens == alone.tokens
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(alone.logprobs), atol=1e-5)


def test_it_applies_top_k_and_top_p_filters(tiny_model, tiny_tokenizer):
    greedy = generate(
        tiny_model, tiny_tokenizer, PROMPTS, SamplingParams(temperature=0.0, max_tokens=8)
    )
    top1 = generate(
        tiny_model, tiny_tokenizer, PROMPTS, SamplingParams(top_k=1, seed=1, max_tokens=8)
    )
    tiny_p = generate(
        tiny_model, tiny_tokenizer, PROMPTS, SamplingParams(top_p=1e-6, seed=2, max_tokens=8)
    )
    assert [s.tokens for s in top1] == [s.tokens for s in greedy]
    assert [s.tokens for s in tiny_p] == [s.tokens for s in greedy]
    # top_k=3: every sampled token is among the 3 most likely under the model.
    seqs = generate(
        tiny_model, tiny_tokenizer, PROMPTS, SamplingParams(top_k=3, seed=4, max_tokens=8)
    )
    for prompt, seq in zip(PROMPTS, seqs):
        full = torch.tensor([prompt + seq.tokens])
        with torch.no_grad():
            logits = tiny_model(input_ids=full).logits[0]
        for t, token in enumerate(seq.tokens):
            top3 = logits[len(prompt) - 1 + t].topk(3).indices.tolist()
            assert token in top3


def test_it_batches_rows_of_many_adapters_like_each_adapter_alone(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tokenizer=tiny_tokenizer)
    first = engine.create_policy(rank=4, alpha=8, seed=1)
    second = engine.create_policy(rank=8, alpha=16, seed=2, target_modules=("q_proj", "up_proj"))
    _randomize_lora(first, 10)
    version = first.snapshot()
    _randomize_lora(first, 11)  # live weights now differ from the snapshot
    _randomize_lora(second, 12)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    requests = [
        SampleRequest(PROMPTS[0], greedy, policy_id=first.id, version=version),
        SampleRequest(PROMPTS[1], greedy),
        SampleRequest(PROMPTS[2], greedy, policy_id=second.id),
        SampleRequest(PROMPTS[0], greedy, policy_id=first.id),
        SampleRequest(PROMPTS[3], greedy, policy_id=second.id),
    ]
    together = sample(engine, requests)
    alone = [sample(engine, [r])[0] for r in requests]
    for got, ref in zip(together, alone):
        assert got[0].tokens == ref[0].tokens
        assert torch.allclose(
            torch.tensor(got[0].logprobs), torch.tensor(ref[0].logprobs), atol=1e-5
        )
    # The adapters matter: the snapshot, the live weights and the base disagree.
    assert together[0][0].tokens != together[3][0].tokens
    base = sample(engine, [SampleRequest(PROMPTS[0], greedy)])[0][0]
    assert base.tokens not in (together[0][0].tokens, together[3][0].tokens)


def test_it_scores_sequences_per_adapter_like_the_sampler(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tokenizer=tiny_tokenizer)
    policy = engine.create_policy(rank=4, alpha=8, seed=3)
    _randomize_lora(policy, 21)
    version = policy.snapshot()
    request = SampleRequest(
        PROMPTS[2], SamplingParams(max_tokens=8, seed=9), policy_id=policy.id, version=version
    )
    seq = sample(engine, [request])[0][0]
    full = PROMPTS[2] + seq.tokens
    for adapter in ((policy.id, version), f"{policy.id}@{version}"):
        scored = compute_logprobs(engine, adapter, full)
        assert scored[0] is None and len(scored) == len(full)
        assert torch.allclose(
            torch.tensor(scored[len(PROMPTS[2]) :]), torch.tensor(seq.logprobs), atol=1e-4
        )
    base = compute_logprobs(engine, None, full)
    assert not torch.allclose(torch.tensor(base[1:]), torch.tensor(scored[1:]), atol=1e-3)


def test_it_rejects_bad_prompts_clearly(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="empty"):
        SampleRequest([], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(tiny_model, tiny_tokenizer, [[1, 10**6]], SamplingParams())
    with pytest.raises(ValueError, match="positions"):
        generate(tiny_model, tiny_tokenizer, [[1, 2]], SamplingParams(max_tokens=10_000))
    with pytest.raises(ValueError, match="LoRAHost"):
        generate(tiny_model, tiny_tokenizer, [[1, 2]], SamplingParams(), adapters=["x"])
    engine = Engine(tiny_model, tokenizer=tiny_tokenizer)
    with pytest.raises(KeyError):
        sample(engine, [SampleRequest([1, 2], policy_id="nope")])


def _penalised_reference(model, prompt, params: SamplingParams) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forwards, OpenAI's penalties and bias applied by hand."""
    tokens: list[int] = []
    logprobs: list[float] = []
    bias = dict(params.logit_bias)
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
        adjusted = logits.clone()
        for token, value in bias.items():
            adjusted[token] += value
        for token in set(tokens):
            adjusted[token] -= params.frequency_penalty * tokens.count(token)
            adjusted[token] -= params.presence_penalty
        choice = int(adjusted.argmax())
        tokens.append(choice)
        logprobs.append(float(torch.log_softmax(logits, -1)[choice]))
    return tokens, logprobs


def test_penalties_and_logit_bias_steer_the_choice_and_leave_the_logprobs_the_models(
    tiny_model, tiny_tokenizer
):
    prompt = [5, 17, 40, 41, 99]
    plain = SamplingParams(max_tokens=12, temperature=0.0)
    penalised = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        frequency_penalty=2.0,
        presence_penalty=1.5,
        logit_bias={"7": 3.0, 9: -100.0},
    )
    (base,), (seq,) = (
        generate(tiny_model, tiny_tokenizer, [prompt], p, stop_on_eos=False)
        for p in (plain, penalised)
    )
    tokens, logprobs = _penalised_reference(tiny_model, prompt, penalised)
    assert seq.tokens == tokens
    assert seq.tokens != base.tokens
    assert seq.logprobs == pytest.approx(logprobs, abs=1e-4)
    # A penalty that large forbids nothing but repeats: the greedy run repeats less.
    assert len(set(seq.tokens)) > len(set(base.tokens))
    assert 9 not in seq.tokens
    forced = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias=((42, 100.0),))
    (always,) = generate(tiny_model, tiny_tokenizer, [prompt], forced, stop_on_eos=False)
    assert always.tokens == [42] * 6


def test_penalties_of_one_row_change_no_other_row(tiny_model, tiny_tokenizer):
    prompts = [[5, 17, 40, 41, 99], [8, 120]]
    params = [
        SamplingParams(max_tokens=10, temperature=1.0, seed=1, presence_penalty=2.0),
        SamplingParams(max_tokens=10, temperature=1.0, seed=2),
    ]
    together = generate(tiny_model, tiny_tokenizer, prompts, params, stop_on_eos=False)
    for prompt, p, seq in zip(prompts, params, together, strict=True):
        (alone,) = generate(tiny_model, tiny_tokenizer, [prompt], p, stop_on_eos=False)
        assert seq.tokens == alone.tokens


def test_sampling_params_check_penalties_and_bias():
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=2.5)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    assert SamplingParams(logit_bias={"3": 1}).logit_bias == ((3, 1.0),)
