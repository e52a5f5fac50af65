"""Sampling features of the 0.38 SDK, LoRA on the unembedding (``train_unembed``) and
inflight sampler saves.

Wire tests run the SDK's own request and response converters against ``tinker_api.wire``;
the live tests drive ``tinker.ServiceClient`` against the live server and check every
number against a direct torch computation on the same base model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

tinker = pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)
from tinker import types
from tinker.lib.public_interfaces.sampling_client import _tensor_data_to_model
from tinker.proto import response_conv

from tests.tinker_api._sdk import SdkWire
from tests.tinker_api.conftest import BASE_NAME
from tests.tinker_api.test_sdk_live import server, service_client, sft_datum  # noqa: F401
from tinker_api import schemas as s
from tinker_api import services, wire

# --------------------------------------------------------------------------- wire


def sent_sample_request(**fields: Any) -> s.SampleRequest:
    """The SampleRequest as the server parses what the SDK sends to /asample."""
    sdk = SdkWire(body=wire.future_created("req-1", sample_sequence_ids=["a"]).body)
    sdk.call(
        lambda c: c.sampling.asample(
            request=types.SampleRequest(
                sampling_session_id="samp-1",
                seq_id=0,
                sampling_params=types.SamplingParams(max_tokens=2),
                **fields,
            ),
            max_retries=0,
        )
    )
    return wire.parse_json(s.SampleRequest, sdk.last.content)


def test_it_reads_target_prompt_logprobs_and_answers_in_the_requests_layout() -> None:
    prompt = types.ModelInput.from_ints([4, 5, 6, 7, 8, 9])
    ids = torch.full((5, 3), -1, dtype=torch.int64)
    ids[1, 0], ids[3, 2], ids[4, 1] = 11, 12, 0
    for td, sparse in (
        (types.TensorData.from_torch_sparse(ids, pad_value=-1), True),
        (types.TensorData.from_torch(ids), False),
    ):
        assert (td.sparse_crow_indices is not None) == sparse
        req = sent_sample_request(prompt=prompt, target_prompt_logprobs=_tensor_data_to_model(td))
        targets = wire.prompt_targets(req.target_prompt_logprobs, len(wire.sample_prompt(req)[0]))
        # Unlisted sparse cells ask for nothing (-1), not for token 0.
        np.testing.assert_array_equal(targets.ids, ids.numpy())

        scores = np.where(targets.ids >= 0, -(targets.ids + 1.0) / 8, 0.0)
        data, csr = targets.answer(scores)
        out = wire.TensorOut(data=data, shape=[5, 3], csr=csr)
        body = wire.encode_sample_response(
            [wire.SampledSequenceOut(tokens=[1], stop_reason="length")],
            protobuf=True,
            target_prompt_logprobs=out,
        )
        got = response_conv.deserialize_sample_response(body.content).target_prompt_logprobs
        assert got is not None and got.shape == [5, 3]
        assert (got.sparse_crow_indices is not None) == sparse
        np.testing.assert_allclose(got.to_numpy(), scores.astype(np.float32))
        as_json = s.SampleResponseJson.model_validate_json(
            wire.encode_sample_response(
                [wire.SampledSequenceOut(tokens=[1], stop_reason="length")],
                protobuf=False,
                target_prompt_logprobs=out,
            ).content
        ).target_prompt_logprobs
        assert as_json is not None and as_json.shape == [5, 3]
        assert as_json.sparse_col_indices == (td.sparse_col_indices if sparse else None)


def test_it_encodes_prompt_alt_tokens_the_sdk_parses() -> None:
    tokens = np.array([[3, 3], [7, 1], [0, 9]], dtype=np.int64)
    logprobs = np.array([[-0.5, -0.5], [-1.0, -2.0], [-3.0, -0.25]], dtype=np.float32)
    body = wire.encode_sample_response(
        [wire.SampledSequenceOut(tokens=[1], stop_reason="stop")],
        protobuf=True,
        prompt_alt_tokens=(
            wire.TensorOut(data=tokens, shape=[3, 2]),
            wire.TensorOut(data=logprobs, shape=[3, 2]),
        ),
    )
    got = response_conv.deserialize_sample_response(body.content).prompt_alt_tokens
    assert got is not None
    assert got.tokens.dtype == "int64" and got.logprobs.dtype == "float32"
    np.testing.assert_array_equal(got.tokens.to_numpy().reshape(3, 2), tokens)
    np.testing.assert_array_equal(got.logprobs.to_numpy().reshape(3, 2), logprobs)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.full((4, 2), -1, dtype=torch.int64), "names no token id"),
        (torch.full((3, 2), 5, dtype=torch.int64), "exactly len\\(prompt\\) - 1 = 4 rows"),
        (torch.full((4, 2), -2, dtype=torch.int64), "must be 0 or more"),
        (torch.full((4, 2), 0.5), "must be an int64 tensor"),
    ],
)
def test_it_refuses_target_prompt_logprobs_it_cannot_answer(
    ids: torch.Tensor, message: str
) -> None:
    req = sent_sample_request(
        prompt=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
        target_prompt_logprobs=_tensor_data_to_model(types.TensorData.from_torch(ids)),
    )
    with pytest.raises(wire.WireError, match=message) as err:
        wire.prompt_targets(req.target_prompt_logprobs, 5)
    assert err.value.status == 400


def test_it_bounds_what_one_sample_may_ask_for() -> None:
    prompt = types.ModelInput.from_ints(list(range(1, 101)))
    wide = sent_sample_request(prompt=prompt, topk_prompt_logprobs=wire.MAX_SCORE_CELLS // 50)
    with pytest.raises(wire.WireError, match="topk_prompt_logprobs: len\\(prompt\\) x"):
        wire.sample_prompt(wide)
    # The schema caps k itself; a long enough prompt still crosses the cell bound under it.
    long_prompt = types.ModelInput.from_ints([1] * (wire.MAX_SCORE_CELLS // 1024 + 1))
    draws = sent_sample_request(prompt=long_prompt, prompt_alt_tokens_k=s.MAX_PROMPT_ALT_TOKENS_K)
    with pytest.raises(wire.WireError, match="prompt_alt_tokens_k: len\\(prompt\\) x"):
        wire.sample_prompt(draws)
    sampled = sent_sample_request(prompt=prompt, num_samples=4, topk_sample_logprobs=1 << 16)
    wire.sample_prompt(sampled)
    with pytest.raises(wire.WireError, match="topk_sample_logprobs"):
        wire.check_topk_sample(sampled, max_tokens=64)
    wire.check_topk_sample(sampled, max_tokens=16)


def test_it_reads_every_stop_form_the_sdk_sends() -> None:
    def stop_of(stop: Any) -> dict[str, Any]:
        req = sent_sample_request(prompt=types.ModelInput.from_ints([1, 2]))
        req = req.model_copy(
            update={"sampling_params": s.SamplingParams.model_validate({"stop": stop})}
        )
        return services.sampling.stop_params(req.sampling_params.stop)

    assert stop_of(None) == {"stop_strings": [], "stop_ids": [], "stop_on_eos": True}
    assert stop_of([]) == {"stop_strings": [], "stop_ids": [], "stop_on_eos": False}
    assert stop_of("\n\n")["stop_strings"] == ["\n\n"]
    assert stop_of(["a", "b"]) == {"stop_strings": ["a", "b"], "stop_ids": [], "stop_on_eos": True}
    assert stop_of([7, 8]) == {"stop_strings": [], "stop_ids": [7, 8], "stop_on_eos": True}
    with pytest.raises(wire.WireError, match="must not be empty"):
        stop_of([""])
    with pytest.raises(wire.WireError, match="must not be negative"):
        stop_of([-3])
    # A list mixing strings and ids is none of the SDK's forms.
    with pytest.raises(wire.WireError, match=r"invalid SampleRequest: sampling_params\.stop"):
        wire.parse_json(
            s.SampleRequest,
            b'{"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},'
            b' "sampling_params": {"stop": ["a", 3]}}',
        )


# --------------------------------------------------------------------------- live


def _hf_model(path: Path) -> tuple[Any, Any]:
    """The base model and its tokenizer, from the directory the server serves (a base
    model's SamplingClient would look its name up on the hub)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(path))


@torch.no_grad()
def _logp(model: Any, tokens: list[int]) -> torch.Tensor:
    """(len(tokens) - 1, V): log p(. | tokens[: i + 1]) for row i."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@torch.no_grad()
def _prompt_whose_greedy_token_is_eos(model: Any, eos: set[int]) -> list[int]:
    vocab = int(model.config.vocab_size)
    firsts = torch.arange(vocab)
    out = model(input_ids=firsts[:, None]).logits[:, -1].argmax(-1)
    hits = [int(t) for t, nxt in zip(firsts.tolist(), out.tolist()) if nxt in eos]
    if hits:
        return [hits[0]]
    pairs = torch.cartesian_prod(firsts[: min(vocab, 64)], firsts)
    out = model(input_ids=pairs).logits[:, -1].argmax(-1)
    hit = next(i for i, nxt in enumerate(out.tolist()) if nxt in eos)
    return pairs[hit].tolist()


@pytest.fixture
def base_sampler(
    server: str,  # noqa: F811
    owner_key: tuple[Any, str],
    base_model_dir: Path,
) -> Iterator[tuple[Any, Any, Any]]:
    """(torch model, tokenizer, an SDK sampling client of the base model on the live server):
    the live tests compare the server's numbers with the model's own."""
    model, tokenizer = _hf_model(base_model_dir)
    with service_client(server, owner_key[1]) as service:
        yield model, tokenizer, service.create_sampling_client(base_model=BASE_NAME).result()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_it_samples_with_topk_target_and_alternative_logprobs_that_match_torch(
    base_sampler: tuple[Any, Any, Any],
) -> None:
    model, tokenizer, sampler = base_sampler
    prompt = tokenizer.encode("12+7=19. the quick", add_special_tokens=False)
    n = len(prompt)
    logp = _logp(model, prompt)
    targets = torch.full((n - 1, 2), -1, dtype=torch.int64)
    targets[0, 0], targets[n - 2, 1], targets[n // 2, 0] = 5, 9, prompt[n // 2 + 1]

    greedy = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=3, temperature=0.0, stop=[]),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
        topk_sample_logprobs=4,
        target_prompt_logprobs=types.TensorData.from_torch(targets),
        prompt_alt_tokens_k=2,
    ).result()

    expected = logp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert greedy.prompt_logprobs[0] is None
    np.testing.assert_allclose(greedy.prompt_logprobs[1:], expected.numpy(), atol=1e-4)
    topk = greedy.topk_prompt_logprobs
    assert topk is not None and topk[0] is None and len(topk) == n
    for row, entries in enumerate(topk[1:]):
        ref = logp[row].topk(3)
        assert [t for t, _ in entries] == ref.indices.tolist()
        np.testing.assert_allclose([v for _, v in entries], ref.values.numpy(), atol=1e-4)
    got_targets = greedy.target_prompt_logprobs.to_torch().reshape(n - 1, 2)
    ref_targets = torch.where(targets >= 0, logp.gather(1, targets.clamp(min=0)), torch.zeros(()))
    torch.testing.assert_close(got_targets, ref_targets, atol=1e-4, rtol=0)
    alt = greedy.prompt_alt_tokens
    alt_tokens = alt.tokens.to_torch().reshape(n - 1, 2)
    # Temperature 0: every draw is the most likely token.
    assert (alt_tokens == logp.argmax(-1, keepdim=True)).all()
    torch.testing.assert_close(
        alt.logprobs.to_torch().reshape(n - 1, 2),
        logp.gather(1, alt_tokens),
        atol=1e-4,
        rtol=0,
    )
    for seq in greedy.sequences:
        assert seq.stop_reason == "length" and len(seq.tokens) == 3
        full = _logp(model, prompt + seq.tokens)[n - 1 :]
        assert len(seq.topk_logprobs) == 3
        for pos, entries in enumerate(seq.topk_logprobs):
            ref = full[pos].topk(4)
            assert [t for t, _ in entries] == ref.indices.tolist()
            assert entries[0][0] == seq.tokens[pos]
            assert entries[0][1] == pytest.approx(seq.logprobs[pos], abs=1e-5)

    # Sparse targets keep their layout; last_n scores only the tail; draws at T=1.
    sparse = types.TensorData.from_torch_sparse(targets, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    tail = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1, temperature=1.0, seed=7),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        target_prompt_logprobs=sparse,
        prompt_alt_tokens_k=5,
        prompt_logprobs_last_n=2,
    ).result()
    assert tail.prompt_logprobs[: n - 2] == [None] * (n - 2)
    np.testing.assert_allclose(tail.prompt_logprobs[n - 2 :], expected[-2:].numpy(), atol=1e-4)
    assert tail.topk_prompt_logprobs[: n - 2] == [None] * (n - 2)
    assert all(len(e) == 2 for e in tail.topk_prompt_logprobs[n - 2 :])
    assert tail.target_prompt_logprobs.sparse_col_indices == sparse.sparse_col_indices
    torch.testing.assert_close(
        tail.target_prompt_logprobs.to_torch().reshape(n - 1, 2),
        ref_targets,
        atol=1e-4,
        rtol=0,
    )
    draws = tail.prompt_alt_tokens.tokens.to_torch().reshape(n - 1, 5)
    torch.testing.assert_close(
        tail.prompt_alt_tokens.logprobs.to_torch().reshape(n - 1, 5),
        logp.gather(1, draws),
        atol=1e-4,
        rtol=0,
    )
    assert np.isfinite(tail.prompt_alt_tokens.logprobs.to_numpy()).all()

    with pytest.raises(tinker.BadRequestError, match="len\\(prompt\\) - 1"):
        sampler.sample(
            types.ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=1),
            target_prompt_logprobs=types.TensorData.from_torch(targets[:-1]),
        ).result()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_it_honours_every_stop_form(
    base_sampler: tuple[Any, Any, Any],
    server: str,  # noqa: F811
    owner_key: tuple[Any, str],
) -> None:
    from training.sampler import default_stop_ids

    model, tokenizer, sampler = base_sampler
    eos = set(default_stop_ids(model, tokenizer))
    prompt = types.ModelInput.from_ints(_prompt_whose_greedy_token_is_eos(model, eos))

    def greedy(stop: Any, max_tokens: int = 4) -> Any:
        params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
        return sampler.sample(prompt, num_samples=1, sampling_params=params).result()

    # None keeps EOS stopping: the first (greedy) token is EOS and ends the sample.
    implicit = greedy(None).sequences[0]
    assert implicit.stop_reason == "stop" and len(implicit.tokens) == 1
    assert implicit.tokens[0] in eos
    # [] disables every stop, EOS included: decoding runs on to max_tokens.
    unstopped = greedy([]).sequences[0]
    assert unstopped.stop_reason == "length" and len(unstopped.tokens) == 4
    assert unstopped.tokens[0] == implicit.tokens[0]
    # Token ids stop as well as EOS; so do strings. Continue after the EOS the greedy
    # sample produced: the continuation is unstopped.tokens[1:].
    after_eos = types.ModelInput.from_ints(prompt.to_ints() + unstopped.tokens[:1])
    follow = unstopped.tokens[1:]

    def continued(stop: Any) -> Any:
        params = types.SamplingParams(max_tokens=3, temperature=0.0, stop=stop)
        return sampler.sample(after_eos, num_samples=1, sampling_params=params).result()

    by_id = continued([follow[1]]).sequences[0]
    end = next(j for j, t in enumerate(follow) if t == follow[1] or t in eos)
    assert by_id.stop_reason == "stop" and by_id.tokens == follow[: end + 1]
    text = tokenizer.decode(follow[1:2])
    by_text = continued(text).sequences[0]
    assert by_text.stop_reason == "stop" and len(by_text.tokens) <= 2
    assert continued([text, "\x00never"]).sequences[0].tokens == by_text.tokens

    # Clients that name base_model instead of a sampling session (curl, older SDKs) get the
    # same answer, as JSON when they do not ask for protobuf.
    import httpx

    from tests.tinker_api.test_protocol import poll

    with httpx.Client(base_url=server + "api/v1/", timeout=30) as http:
        res = http.post(
            "asample",
            json={
                "base_model": BASE_NAME,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt.to_ints()}]},
                "sampling_params": {"max_tokens": 4, "temperature": 0.0, "stop": []},
                "topk_prompt_logprobs": 1,
            },
            headers={"X-API-Key": "tml-" + owner_key[1]},
        )
        assert res.status_code == 200, res.text
        answer = poll(http, owner_key[1], res.json()["request_id"]).json()
    (seq,) = answer["sequences"]
    assert (seq["tokens"], seq["stop_reason"]) == (unstopped.tokens, "length")
    assert answer["topk_prompt_logprobs"][0] is None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_it_trains_lora_on_the_unembedding_and_samples_with_it(
    server: str,  # noqa: F811
    owner_key: tuple[Any, str],
    tinker_data_dir: Path,
) -> None:
    from safetensors import safe_open

    with service_client(server, owner_key[1]) as service:
        # The SDK itself refuses a config that trains nothing; an optimizer family this
        # server does not run is refused at creation, not at the first optim_step.
        with pytest.raises(tinker.BadRequestError, match=r"optimizer_config\.type 'dimuon'"):
            service.create_lora_training_client(
                base_model=BASE_NAME, rank=4, optimizer=types.DimuonOptimizerConfig()
            ).result()

        training = service.create_lora_training_client(
            base_model=BASE_NAME, rank=4, seed=5, train_attn=False, train_mlp=False
        ).result()
        tokenizer = training.get_tokenizer()
        data = [sft_datum(tokenizer, p, a) for p, a in (("12+7=", "19"), ("3+4=", "7"))]

        def nll() -> float:
            out = training.forward(data, "cross_entropy").result()
            return -sum(
                float((o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum())
                for o, d in zip(out.loss_fn_outputs, data, strict=True)
            )

        before = nll()
        for _ in range(4):
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        # Only the head has an adapter: the loss can fall only through it.
        assert nll() < 0.7 * before

        trained = [
            o["logprobs"].to_numpy()
            for o in training.forward(data, "cross_entropy").result().loss_fn_outputs
        ]
        sampler = training.save_weights_and_get_sampling_client().result()
        base = service.create_sampling_client(base_model=BASE_NAME).result()
        for datum, lp in zip(data, trained, strict=True):
            last = int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1])
            tokens = [*datum.model_input.to_ints(), last]
            scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
            # The sampler applies the head adapter exactly as the training forward does.
            np.testing.assert_allclose(scored[1:], lp, atol=1e-4)
            untuned = base.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
            assert not np.allclose(untuned[1:], lp, atol=1e-3)

        # kind="inflight": a later inflight save moves earlier inflight clients onto its
        # weights; a snapshot client keeps its own.
        probe = types.ModelInput.from_ints(tokens)
        snapshot_before = sampler.compute_logprobs(probe).result()
        first = training.save_weights_and_get_sampling_client(kind="inflight").result()
        first_before = first.compute_logprobs(probe).result()
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        second = training.save_weights_and_get_sampling_client(kind="inflight").result()
        newest = second.compute_logprobs(probe).result()
        assert not np.allclose(first_before[1:], newest[1:], atol=1e-4)
        np.testing.assert_allclose(first.compute_logprobs(probe).result()[1:], newest[1:])
        kept = sampler.compute_logprobs(probe).result()
        np.testing.assert_allclose(kept[1:], snapshot_before[1:])

    adapters = list(tinker_data_dir.rglob("adapter_model.safetensors"))
    assert len(adapters) == 3
    for adapter in adapters:
        with safe_open(str(adapter), "pt") as f:
            names = f.keys()
        modules = {k.split(".lora_")[0].removeprefix("base_model.model.") for k in names}
        assert modules == {"lm_head"}


def test_it_gives_the_unembedding_adapter_the_same_gradients_in_chunks(
    base_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training forward runs the head on gathered positions, chunked past a size: the
    head adapter must see each position's own row and get exact gradients either way."""
    from training import ops
    from training.engine import Engine
    from training.sampler import sequence_logprobs
    from training.types import Datum

    engine = Engine(str(base_model_dir), device="cpu")
    head = engine.create_policy(rank=4, target_modules=("q_proj", "lm_head"), policy_id="h")
    other = engine.create_policy(rank=4, target_modules=("q_proj",), seed=1, policy_id="o")
    assert "lm_head" in head.lora_weights and "lm_head" not in other.lora_weights
    with torch.no_grad():
        for _a, b in head.lora_weights.values():
            b.normal_(0.0, 0.05)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, 200, (n,), generator=gen) for n in (7, 5, 9)]
    data = [
        Datum(
            model_input=t[:-1],
            loss_fn_inputs={"target_tokens": t[1:], "weights": torch.ones(len(t) - 1)},
        )
        for t in tokens
    ]
    policies = [head, other, head]

    forward = ops.forward(policies, data, "cross_entropy")
    sampled = sequence_logprobs(
        engine.model, [t.tolist() for t in tokens], adapters=["h", "o", "h"], host=engine.host
    )
    for lp, ref in zip(forward.logprobs, sampled, strict=True):
        torch.testing.assert_close(lp, torch.tensor(ref[1:]), atol=1e-4, rtol=0)

    def grads() -> list[torch.Tensor]:
        head.zero_grad()
        other.zero_grad()
        ops.forward_backward(policies, data, "cross_entropy")
        return [p.grad.clone() for p in head.parameters()]

    whole = grads()
    monkeypatch.setattr(ops, "_HEAD_CHUNK_ELEMENTS", 3 * engine.model.config.vocab_size)
    chunked = grads()
    assert whole[-1].norm() > 0  # lm_head's B learns from the first step
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
