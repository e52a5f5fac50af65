"""The official ``tinker`` SDK against a live OpenTinker: real HTTP server, real API keys,
real Celery worker, real model worker on a tiny base model.

Every test runs the SDK unchanged (``ServiceClient(base_url=..., api_key="tml-otk_...")``);
the worker starts on demand when the first request for the base model arrives.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)
from tinker import types  # noqa: E402

from tests.tinker_api.conftest import BASE_NAME  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def server(
    live_server: Any,
    tinker_base: Any,
    start_worker: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[str]:
    """The live server's URL, with a real Celery worker serving the ``gpu`` queue."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    # The worker subprocess inherits these: a short idle time lets it end with the test.
    monkeypatch.setenv("OPENTINKER_TINKER_WORKER_IDLE_SECONDS", "20")
    monkeypatch.setenv("OPENTINKER_TINKER_TORCH_THREADS", "1")
    monkeypatch.setenv("OPENTINKER_TINKER_LONG_POLL_SECONDS", "5")
    start_worker()
    yield live_server.url + "/"


def service_client(url: str, plaintext_key: str) -> Any:
    return tinker.ServiceClient(base_url=url, api_key="tml-" + plaintext_key)


def sft_datum(tokenizer: Any, prompt: str, answer: str) -> types.Datum:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = prompt_ids + answer_ids
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.array(weights, dtype=np.float32),
        },
    )


def batch_loss(result: Any, data: list[types.Datum]) -> float:
    """Mean per-token NLL from the returned logprobs, as the cookbook's SFT loop computes it."""
    total, count = 0.0, 0.0
    for out, datum in zip(result.loss_fn_outputs, data, strict=True):
        lp = out["logprobs"].to_numpy()
        w = datum.loss_fn_inputs["weights"].to_numpy()
        total += float(-(lp * w).sum())
        count += float(w.sum())
    return total / count


EXAMPLES = [("12+7=", "19"), ("3+4=", "7"), ("25+25=", "50"), ("8+1=", "9")]


def test_it_runs_an_sft_loop_whose_loss_falls_and_samples_from_it(
    server: str, owner_key: tuple[Any, str]
) -> None:
    with service_client(server, owner_key[1]) as service:
        caps = service.get_server_capabilities()
        assert BASE_NAME in [m.model_name for m in caps.supported_models]
        training = service.create_lora_training_client(base_model=BASE_NAME, rank=8, seed=1)
        tokenizer = training.get_tokenizer()
        data = [sft_datum(tokenizer, p, a) for p, a in EXAMPLES]
        losses = []
        for _ in range(8):
            fwd = training.forward_backward(data, "cross_entropy")
            opt = training.optim_step(types.AdamParams(learning_rate=1e-2))
            result = fwd.result()
            opt.result()
            assert math.isfinite(result.metrics["loss:sum"])
            losses.append(batch_loss(result, data))
        assert losses[-1] < 0.5 * losses[0], losses

        sampler = training.save_weights_and_get_sampling_client(name="sft-final")
        prompt = types.ModelInput.from_ints(tokenizer.encode("12+7=", add_special_tokens=False))
        response = sampler.sample(
            prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)
        ).result()
        assert len(response.sequences) == 2
        for seq in response.sequences:
            assert 1 <= len(seq.tokens) <= 4
            assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        # Greedy decoding of a trained example reproduces the answer.
        assert tokenizer.decode(response.sequences[0].tokens).startswith("19")

        scored = tokenizer.encode("12+7=19", add_special_tokens=False)
        logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(scored)).result()
        assert logprobs[0] is None and len(logprobs) == len(scored)
        assert all(lp is not None and lp <= 0 for lp in logprobs[1:])
        # The fine-tuned answer tokens are likely under the sampler's weights.
        assert sum(logprobs[-2:]) > -2.0
