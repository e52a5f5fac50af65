"""Vision-language policies in the engine: images through forward, backward, LoRA and sampling.

Every check runs on tiny random Qwen2.5-VL and Qwen3-VL models built from configs
(tests/training/vl_models.py). The reference is always the model's own Hugging Face forward
(which computes its rotary positions and image features itself) on a copy whose LoRA deltas are
merged into the weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.training import vl_models
from training import ops, vision
from training.engine import Engine
from training.sampler import SampleRequest, generate, sample
from training.types import Datum, SamplingParams

pytestmark = pytest.mark.parametrize("arch", vl_models.ARCHITECTURES)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return vl_models.vl_tokenizer()


@pytest.fixture(scope="module")
def images() -> list[vision.ImageInput]:
    processor = vl_models.processor()
    sizes = [(84, 56), (56, 56), (112, 84)]
    return [
        vision.encode_image(processor, vl_models.picture(seed, size))
        for seed, size in enumerate(sizes)
    ]


def _sequence(tokenizer: Any, imgs: list[vision.ImageInput], text: list[int]) -> list[int]:
    start, end, pad = vl_models.image_ids(tokenizer)
    ids = [5, 6]
    for image in imgs:
        ids += [start] + [pad] * image.tokens + [end]
    return ids + text


def _datum(sequence: list[int], imgs: list[vision.ImageInput]) -> Datum:
    return Datum(
        model_input=sequence[:-1],
        loss_fn_inputs={"target_tokens": sequence[1:], "weights": [1.0] * (len(sequence) - 1)},
        images=tuple(imgs),
    )


def _perturbed_policy(engine: Engine, seed: int, rank: int = 4) -> Any:
    policy = engine.create_policy(rank=rank, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    return policy


def _alone(
    engine: Engine,
    prompt: list[int],
    params: SamplingParams,
    key: str | None,
    imgs: Any,
    sample_index: int = 0,
) -> Any:
    """What the sampler gives one row decoded by itself."""
    (seq,) = generate(
        engine.model,
        engine.tokenizer,
        [prompt],
        params,
        adapters=[key],
        host=engine.host,
        sample_indices=[sample_index],
        stop_on_eos=False,
        images=[imgs],
    )
    return seq


def _merged(arch: str, tokenizer: Any, policy: Any) -> Any:
    """A fresh copy of the base model with `policy`'s LoRA deltas in its weights."""
    model = vl_models.build_vl_model(arch, tokenizer)
    with torch.no_grad():
        for name, (a, b) in policy.lora_weights.items():
            model.get_submodule(name).weight.add_(policy.config.scaling * b @ a)
    return model


def _hf_logprobs(model: Any, sequence: list[int], imgs: list[vision.ImageInput], pad: int) -> Any:
    ids = torch.tensor([sequence])
    kwargs: dict[str, Any] = {"mm_token_type_ids": (ids == pad).int()}
    if imgs:
        kwargs["pixel_values"] = torch.cat([i.pixel_values for i in imgs])
        kwargs["image_grid_thw"] = torch.tensor([i.grid_thw for i in imgs])
    with torch.no_grad():
        logp = model(input_ids=ids, **kwargs).logits.log_softmax(-1)
    values = logp[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    return values * (ids[0, 1:] != pad)


def test_it_scores_images_and_text_as_the_models_own_forward(
    arch: str, tokenizer: Any, images: list[vision.ImageInput]
) -> None:
    engine = Engine(vl_models.build_vl_model(arch, tokenizer), tokenizer=tokenizer)
    first, second = _perturbed_policy(engine, 1), _perturbed_policy(engine, 2)
    rows = [
        ([images[0], images[1]], [7, 8, 9, 10], first),
        ([images[2]], [11, 12, 13], second),
        ([], [14, 15, 16, 17, 18], first),
    ]
    datums = [_datum(_sequence(tokenizer, imgs, text), imgs) for imgs, text, _ in rows]
    result = ops.forward([policy for _, _, policy in rows], datums)
    pad = vl_models.image_ids(tokenizer)[2]
    for (imgs, text, policy), got in zip(rows, result.logprobs):
        expected = _hf_logprobs(
            _merged(arch, tokenizer, policy), _sequence(tokenizer, imgs, text), imgs, pad
        )
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_it_keeps_placeholders_out_of_the_loss_and_gives_the_models_gradient(
    arch: str, tokenizer: Any, images: list[vision.ImageInput]
) -> None:
    engine = Engine(vl_models.build_vl_model(arch, tokenizer), tokenizer=tokenizer)
    policy = engine.create_policy(rank=4, seed=3)  # B = 0: the merged model is the base
    sequence = _sequence(tokenizer, images[:2], [7, 8, 9])
    result = ops.forward_backward(policy, [_datum(sequence, images[:2])], "cross_entropy")
    pad = vl_models.image_ids(tokenizer)[2]
    scored = sum(1 for t in sequence[1:] if t != pad)
    assert result.metrics["tokens:sum"] == scored
    # A datum whose targets at the placeholders say anything else (a hand-built one, 0s)
    # gets the same: the positions before a placeholder carry no loss.
    other = _datum(sequence, images[:2])
    other.loss_fn_inputs["target_tokens"] = torch.tensor(
        [0 if t == pad else t for t in sequence[1:]]
    )
    again = ops.forward(policy, [other], "cross_entropy")
    assert again.metrics["tokens:sum"] == scored
    assert again.metrics["loss:sum"] == pytest.approx(result.metrics["loss:sum"], abs=1e-4)

    reference = vl_models.build_vl_model(arch, tokenizer)
    reference.requires_grad_(True)
    ids = torch.tensor([sequence])
    logits = reference(
        input_ids=ids,
        pixel_values=torch.cat([i.pixel_values for i in images[:2]]),
        image_grid_thw=torch.tensor([i.grid_thw for i in images[:2]]),
        mm_token_type_ids=(ids == pad).int(),
    ).logits
    targets = ids[0, 1:].masked_fill(ids[0, 1:] == pad, -100)
    torch.nn.functional.cross_entropy(logits[0, :-1], targets, reduction="sum").backward()
    for name, (a, b) in policy.lora_weights.items():
        grad_w = reference.get_submodule(name).weight.grad
        expected = policy.config.scaling * grad_w @ a.detach().t()
        assert b.grad is not None
        assert torch.allclose(b.grad, expected, atol=1e-4, rtol=1e-4), name


def test_it_never_puts_lora_on_the_vision_tower_and_trains_it_in_full_fine_tuning(
    arch: str, tokenizer: Any, images: list[vision.ImageInput]
) -> None:
    engine = Engine(vl_models.build_vl_model(arch, tokenizer), tokenizer=tokenizer)
    assert engine.host.modules
    assert not [n for n in engine.host.modules if n.startswith("model.visual")]
    full = engine.create_policy(full_finetune=True)
    sequence = _sequence(tokenizer, images[:1], [7, 8])
    ops.forward_backward(full, [_datum(sequence, images[:1])], "cross_entropy")
    assert full.model is not None
    tower = [p for n, p in full.model.named_parameters() if n.startswith("model.visual")]
    assert tower and all(p.grad is not None for p in tower)
    assert any(float(p.grad.abs().sum()) > 0 for p in tower if p.grad is not None)


def test_it_refuses_a_row_whose_placeholders_do_not_fill_its_images(
    arch: str, tokenizer: Any, images: list[vision.ImageInput]
) -> None:
    engine = Engine(vl_models.build_vl_model(arch, tokenizer), tokenizer=tokenizer)
    policy = engine.create_policy(rank=2)
    sequence = _sequence(tokenizer, images[:1], [7, 8])
    with pytest.raises(ValueError, match="placeholder"):
        ops.forward(policy, [_datum(sequence, images[:2])])
    with pytest.raises(ValueError, match="placeholder"):
        vision.expand_placeholders([5, vl_models.image_ids(tokenizer)[2]], images[:2], 295)


def test_it_gives_each_row_of_a_mixed_batch_what_it_gets_alone(
    arch: str, tokenizer: Any, images: list[vision.ImageInput]
) -> None:
    engine = Engine(vl_models.build_vl_model(arch, tokenizer), tokenizer=tokenizer)
    first, second = _perturbed_policy(engine, 1), _perturbed_policy(engine, 2)
    rows = [
        ([images[0]], [7, 8, 9], first),
        ([], [10, 11, 12, 13], second),
        ([images[1], images[2]], [14, 15], second),
        ([], [16, 17], first),
    ]
    datums = [_datum(_sequence(tokenizer, imgs, text), imgs) for imgs, text, _ in rows]
    together = ops.forward([p for _, _, p in rows], datums).logprobs
    for datum, (_, _, policy), got in zip(datums, rows, together):
        alone = ops.forward(policy, [datum]).logprobs[0]
        assert torch.allclose(got, alone, atol=1e-5)

    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    prompts = [_sequence(tokenizer, imgs, text) for imgs, text, _ in rows]
    keys = [p.id for _, _, p in rows]
    batch = generate(
        engine.model,
        tokenizer,
        prompts,
        params,
        adapters=keys,
        host=engine.host,
        images=[imgs for imgs, _, _ in rows],
        stop_on_eos=False,
    )
    for prompt, key, (imgs, _, _), got in zip(prompts, keys, rows, batch):
        alone = _alone(engine, prompt, params, key, imgs)
        assert got.tokens == alone.tokens
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_it_samples_with_images_deterministically_and_reports_forward_logprobs(
    arch: str, tokenizer: Any, images: list[vision.ImageInput]
) -> None:
    engine = Engine(vl_models.build_vl_model(arch, tokenizer), tokenizer=tokenizer)
    policy = _perturbed_policy(engine, 5)
    version = policy.snapshot()
    prompt = _sequence(tokenizer, images[:2], [7])
    request = SampleRequest(
        prompt,
        SamplingParams(max_tokens=8, temperature=1.0, seed=42),
        n=3,
        policy_id=policy.id,
        version=version,
        images=tuple(images[:2]),
    )
    first, again = sample(engine, [request])[0], sample(engine, [request])[0]
    assert [s.tokens for s in first] == [s.tokens for s in again]
    assert len({tuple(s.tokens) for s in first}) > 1  # n samples draw their own streams
    for seq in first:
        full = prompt + seq.tokens
        datum = Datum(
            model_input=full[:-1],
            loss_fn_inputs={"target_tokens": full[1:]},
            images=tuple(images[:2]),
        )
        scored = ops.forward(policy, [datum]).logprobs[0][len(prompt) - 1 :]
        assert scored.tolist() == pytest.approx(seq.logprobs, abs=1e-4)
    # Another image gives another distribution.
    other = SampleRequest(
        _sequence(tokenizer, [images[2]], [7]),
        SamplingParams(max_tokens=8, temperature=0.0),
        policy_id=policy.id,
        version=version,
        images=(images[2],),
    )
    greedy = SampleRequest(
        prompt,
        SamplingParams(max_tokens=8, temperature=0.0),
        policy_id=policy.id,
        version=version,
        images=tuple(images[:2]),
    )
    a, b = sample(engine, [greedy, other])
    assert a[0].logprobs != b[0].logprobs


def test_it_never_samples_an_image_placeholder(
    arch: str, tokenizer: Any, images: list[vision.ImageInput]
) -> None:
    # Pushed toward the placeholder by a logit bias the model could not resist otherwise,
    # greedy and sampled rows alike still generate text: the tower fills placeholders, a
    # policy never writes one.
    engine = Engine(vl_models.build_vl_model(arch, tokenizer), tokenizer=tokenizer)
    _start, _end, pad = vl_models.image_ids(tokenizer)
    prompt = _sequence(tokenizer, images[:1], [7])
    pushed = {str(pad): 100.0}
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, logit_bias=pushed)
        (seq,) = generate(
            engine.model, tokenizer, [prompt], params, images=[images[:1]], stop_on_eos=False
        )
        assert len(seq.tokens) == 6 and pad not in seq.tokens, seq.tokens
    # Unpushed, the placeholder keeps its place in the reported distribution.
    (free,) = generate(
        engine.model,
        tokenizer,
        [prompt],
        SamplingParams(max_tokens=1, temperature=0.0),
        images=[images[:1]],
        topk_logprobs=int(engine.model.config.get_text_config().vocab_size),
    )
    assert pad in [token for token, _ in free.topk_logprobs[0]]


def test_rows_with_images_joining_a_continuous_batch_get_what_they_get_alone(
    arch: str, tokenizer: Any, images: list[vision.ImageInput], tiny_model: Any
) -> None:
    from training.continuous import ContinuousBatch, Row

    engine = Engine(vl_models.build_vl_model(arch, tokenizer), tokenizer=tokenizer)
    policy = _perturbed_policy(engine, 3)
    # Rows of the base and an adapter, with images and without, two samples of one prompt,
    # joining the running batch mid-decode with prompts longer and shorter than its cache.
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    cases = [
        (_sequence(tokenizer, images[:2], [7]), tuple(images[:2]), policy.id, 0),
        (_sequence(tokenizer, images[:2], [7]), tuple(images[:2]), policy.id, 1),
        (_sequence(tokenizer, [images[2]], [9, 4]), (images[2],), None, 0),
        ([5, 6, 7, 8], (), policy.id, 0),
    ]
    rows = [
        Row(p, params, adapter=k, sample_index=j, stop_on_eos=False, images=imgs)
        for p, imgs, k, j in cases
    ]
    batch = ContinuousBatch(engine.model, tokenizer, engine.host)
    got: dict[int, list[int]] = {}
    for step in range(12):
        joining = {0: rows[:2], 2: rows[2:3], 3: rows[3:]}.get(step, [])
        if joining:
            assert batch.can_join or not len(batch)
        got.update({ident: [] for ident in batch.add(joining)})
        for token in batch.step():
            got[token.row].append(token.token)
    assert not len(batch)
    for ident, (prompt, imgs, key, j) in enumerate(cases):
        assert got[ident] == _alone(engine, prompt, params, key, imgs, j).tokens, ident
    assert got[0] != got[1]  # two samples of one prompt draw their own streams
    with pytest.raises(ValueError, match="no vision tower"):
        ContinuousBatch(tiny_model, None).check(Row([5, 6], params, images=(images[0],)))
