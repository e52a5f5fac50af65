"""The official ``tinker`` SDK against a live OpenTinker: real HTTP server, real API keys,
real Celery worker, real model worker on a tiny base model.

Every test runs the SDK unchanged (``ServiceClient(base_url=..., api_key="tml-otk_...")``);
the worker starts on demand when the first request for the base model arrives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)
from tinker import types

from tests.tinker_api.conftest import BASE_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def server(live_tinker: str) -> str:
    """The live server's URL, with a real Celery worker serving the ``gpu`` queue."""
    return live_tinker + "/"


def service_client(url: str, plaintext_key: str) -> Any:
    return tinker.ServiceClient(base_url=url, api_key="tml-" + plaintext_key)


def rest_client(url: str, plaintext_key: str) -> Any:
    return tinker.RestClient(base_url=url, api_key="tml-" + plaintext_key)


def sft_datum(tokenizer: Any, prompt: str, answer: str) -> types.Datum:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
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


def bandit_trainer(service: Any) -> tuple[Any, Any, list[int]]:
    """A LoRA training client on the tiny model, its tokenizer and the bandit prompt's ids."""
    from training.data import bandit_prompt

    training = service.create_lora_training_client(base_model=BASE_NAME, rank=8, seed=3).result()
    tokenizer = training.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": bandit_prompt(5)}], add_generation_prompt=True, tokenize=False
    )
    return training, tokenizer, tokenizer.encode(prompt, add_special_tokens=False)


def bandit_rewards(tokenizer: Any, sequences: Any) -> np.ndarray:
    """1 for each sampled answer that picks arm 3 (the only one that pays), else 0."""
    from training.data import final_answer

    return np.array([float(final_answer(tokenizer.decode(s.tokens)) == "3") for s in sequences])


def test_it_runs_an_sft_loop_whose_loss_falls_and_samples_from_it(
    server: str, owner_key: tuple[Any, str]
) -> None:
    with service_client(server, owner_key[1]) as service:
        caps = rest_client(server, owner_key[1]).get_server_capabilities().result()
        assert BASE_NAME in [m.model_name for m in caps.supported_models]
        training = service.create_lora_training_client(
            base_model=BASE_NAME, rank=8, seed=1
        ).result()
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

        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(tokenizer.encode("12+7=", add_special_tokens=False))
        response = sampler.sample(
            prompt,
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0),
        ).result()
        assert len(response.sequences) == 2
        for seq in response.sequences:
            assert 1 <= len(seq.tokens) <= 4
            assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        # Greedy decoding is deterministic: both samples agree.
        assert response.sequences[0].tokens == response.sequences[1].tokens

        scored = tokenizer.encode("12+7=19", add_special_tokens=False)
        tuned = sampler.compute_logprobs(types.ModelInput.from_ints(scored)).result()
        assert tuned[0] is None and len(tuned) == len(scored)
        assert all(lp is not None and lp <= 0 for lp in tuned[1:])
        base = service.create_sampling_client(base_model=BASE_NAME).result()
        untuned = base.compute_logprobs(types.ModelInput.from_ints(scored)).result()
        # The sampler serves the fine-tuned weights: the trained answer got likelier.
        assert sum(tuned[-2:]) > sum(untuned[-2:]) + 1.0, (tuned, untuned)


def forward_logprobs(training: Any, data: list[types.Datum]) -> list[np.ndarray]:
    out = training.forward(data, "cross_entropy").result()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def test_it_saves_and_restores_state_with_and_without_the_optimizer(
    server: str, owner_key: tuple[Any, str]
) -> None:
    adam = types.AdamParams(learning_rate=5e-3)
    with service_client(server, owner_key[1]) as service:
        training = service.create_lora_training_client(base_model=BASE_NAME, rank=4).result()
        tokenizer = training.get_tokenizer()
        data = [sft_datum(tokenizer, p, a) for p, a in EXAMPLES]
        for _ in range(2):
            training.forward_backward(data, "cross_entropy")
            training.optim_step(adam)
        path = training.save_state("two-steps").result().path
        assert path == f"tinker://{training.model_id}/weights/two-steps"
        at_save = forward_logprobs(training, data)
        training.forward_backward(data, "cross_entropy")
        training.optim_step(adam).result()
        after_third = forward_logprobs(training, data)

        resumed = service.create_training_client_from_state_with_optimizer(path).result()
        for got, want in zip(forward_logprobs(resumed, data), at_save, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)
        resumed.forward_backward(data, "cross_entropy")
        # With the optimizer the run resumes: its third step is counted as the third.
        assert resumed.optim_step(adam).result().metrics["optim/step:mean"] == 3
        # Same weights and same Adam moments: the third step lands on the same weights.
        for got, want in zip(forward_logprobs(resumed, data), after_third, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4)

        fresh_optimizer = service.create_training_client_from_state(path).result()
        fresh_optimizer.forward_backward(data, "cross_entropy")
        # Weights only start a new run: Adam's moments and its step count begin again.
        assert fresh_optimizer.optim_step(adam).result().metrics["optim/step:mean"] == 1
        # Weights only: Adam restarts, so the same step moves the weights differently.
        diffs = [
            float(np.abs(g - w).max())
            for g, w in zip(forward_logprobs(fresh_optimizer, data), after_third, strict=True)
        ]
        assert max(diffs) > 1e-3

        # The deprecated in-place load (model_id + seq_id) rewinds the original model.
        with pytest.warns(FutureWarning, match="deprecated"):
            training.load_state(path).result()
        for got, want in zip(forward_logprobs(training, data), at_save, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)

        rest = rest_client(server, owner_key[1])
        listed = rest.list_checkpoints(training.model_id).result()
        assert [c.tinker_path for c in listed.checkpoints] == [path]
        assert listed.checkpoints[0].expires_at is None
        assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 4
        rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
        assert rest.list_checkpoints(training.model_id).result().checkpoints[0].expires_at
        rest.delete_checkpoint_from_tinker_path(path).result()
        assert rest.list_checkpoints(training.model_id).result().checkpoints == []
        with pytest.raises(tinker.NotFoundError):
            service.create_training_client_from_state(path).result()


def test_it_runs_forward_backward_custom_like_the_built_in_loss(
    server: str, owner_key: tuple[Any, str]
) -> None:
    import torch

    def custom_ce(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[Any, dict]:
        loss = sum(
            -(lp * torch.tensor(d.loss_fn_inputs["weights"].to_numpy())).sum()
            for d, lp in zip(data, logprobs, strict=True)
        )
        return loss, {"custom_loss": float(loss.detach())}

    adam = types.AdamParams(learning_rate=5e-3)
    with service_client(server, owner_key[1]) as service:
        builtin = service.create_lora_training_client(base_model=BASE_NAME, rank=4, seed=7).result()
        custom = service.create_lora_training_client(base_model=BASE_NAME, rank=4, seed=7).result()
        tokenizer = builtin.get_tokenizer()
        data = [sft_datum(tokenizer, p, a) for p, a in EXAMPLES]
        ce = builtin.forward_backward(data, "cross_entropy").result()
        out = custom.forward_backward_custom(data, custom_ce).result()
        assert out.metrics["custom_loss"] == pytest.approx(ce.metrics["loss:sum"], rel=1e-4)
        builtin.optim_step(adam).result()
        custom.optim_step(adam).result()
        # -dLoss/dlogprob as weights reproduces the built-in loss's gradient exactly.
        for got, want in zip(
            forward_logprobs(custom, data), forward_logprobs(builtin, data), strict=True
        ):
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_it_keeps_two_teams_apart(
    server: str, owner_key: tuple[Any, str], outsider_key: tuple[Any, str]
) -> None:
    import httpx

    with (
        service_client(server, owner_key[1]) as mine,
        service_client(server, outsider_key[1]) as theirs,
    ):
        training = mine.create_lora_training_client(base_model=BASE_NAME, rank=4).result()
        state = training.save_state("secret").result().path
        sampler_path = training.save_weights_for_sampler("secret-sampler").result().path

        other_rest = rest_client(server, outsider_key[1])
        runs = other_rest.list_training_runs().result()
        assert training.model_id not in [r.training_run_id for r in runs.training_runs]
        with pytest.raises(tinker.NotFoundError):
            other_rest.get_training_run(training.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            theirs.create_training_client_from_state(state).result()
        with pytest.raises(tinker.NotFoundError):
            theirs.create_sampling_client(model_path=sampler_path).result()
        assert training.model_id in [
            r.training_run_id
            for r in rest_client(server, owner_key[1]).list_training_runs().result().training_runs
        ]

    # The raw endpoints answer another team's ids as unknown.
    headers = {"X-API-Key": "tml-" + outsider_key[1]}
    info = httpx.post(
        server + "api/v1/get_info", json={"model_id": training.model_id}, headers=headers
    )
    assert info.status_code == 404
    step = httpx.post(
        server + "api/v1/optim_step",
        json={"model_id": training.model_id, "seq_id": 99, "adam_params": {}},
        headers=headers,
    )
    assert step.status_code == 404


def test_it_runs_an_rl_loop_with_importance_sampling_whose_reward_rises(
    server: str, owner_key: tuple[Any, str], base_model_dir: Any
) -> None:
    from training.model import DEFAULT_BASE_MODEL

    if str(base_model_dir) != DEFAULT_BASE_MODEL:
        pytest.skip("needs the project's tiny chat model (scripts/build_tiny_model.py)")
    group = 16
    with service_client(server, owner_key[1]) as service:
        training, tokenizer, prompt_ids = bandit_trainer(service)
        rewards_per_step = []
        for step in range(6):
            sampler = training.save_weights_and_get_sampling_client().result()
            result = sampler.sample(
                types.ModelInput.from_ints(prompt_ids),
                num_samples=group,
                sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=step),
            ).result()
            rewards = bandit_rewards(tokenizer, result.sequences)
            rewards_per_step.append(float(rewards.mean()))
            advantages = rewards - rewards.mean()
            data = []
            for seq, adv in zip(result.sequences, advantages, strict=True):
                tokens = prompt_ids + list(seq.tokens)
                n_prompt = len(prompt_ids) - 1
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": np.array(tokens[1:], dtype=np.int64),
                            "logprobs": np.array(
                                [0.0] * n_prompt + list(seq.logprobs), dtype=np.float32
                            ),
                            "advantages": np.array(
                                [0.0] * n_prompt + [adv] * len(seq.tokens), dtype=np.float32
                            ),
                        },
                    )
                )
            fwd = training.forward_backward(data, "importance_sampling")
            training.optim_step(types.AdamParams(learning_rate=4e-3))
            assert math.isfinite(fwd.result().metrics["loss:sum"])
        # Step 0 samples the untrained adapter (about 1 arm in 5 pays).
        assert np.mean(rewards_per_step[-2:]) > rewards_per_step[0] + 0.4, rewards_per_step


def test_it_trains_stable_reinforce_on_recorded_sequences_and_refuses_unrecorded_ones(
    server: str, owner_key: tuple[Any, str], base_model_dir: Any
) -> None:
    from training.model import DEFAULT_BASE_MODEL

    if str(base_model_dir) != DEFAULT_BASE_MODEL:
        pytest.skip("needs the project's tiny chat model (scripts/build_tiny_model.py)")
    group = 16
    with service_client(server, owner_key[1]) as service:
        training, tokenizer, prompt_ids = bandit_trainer(service)

        def datum(seq: Any, adv: float) -> types.Datum:
            # As the cookbook's rl_loop builds it: the client's logprobs are zeros here, so
            # only the server's recorded ones can make the ratio sensible.
            tokens = prompt_ids + list(seq.tokens)
            n_prompt = len(prompt_ids) - 1
            d = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.array(tokens[1:], dtype=np.int64),
                    "logprobs": np.zeros(len(tokens) - 1, dtype=np.float32),
                    "advantages": np.array(
                        [0.0] * n_prompt + [adv] * len(seq.tokens), dtype=np.float32
                    ),
                },
            )
            sid = seq.sequence_id
            return d.with_provenance(
                model_input=[
                    types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt_ids)),
                    types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens) - 1),
                ],
                loss_fn_inputs=[
                    types.PromptProvenanceSpan(
                        sequence_id=sid, offset=1, length=len(prompt_ids) - 1
                    ),
                    types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens)),
                ],
            )

        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=99)
        plain = training.save_weights_and_get_sampling_client().result()
        unrecorded = plain.sample(
            types.ModelInput.from_ints(prompt_ids), num_samples=1, sampling_params=params
        ).result()
        with pytest.raises(Exception, match="record_stability_info"):
            training.forward_backward(
                [datum(unrecorded.sequences[0], 1.0)], "stable_reinforce"
            ).result()

        rewards_per_step = []
        for step in range(6):
            sampler = training.save_weights_and_get_sampling_client(
                record_stability_info=True
            ).result()
            result = sampler.sample(
                types.ModelInput.from_ints(prompt_ids),
                num_samples=group,
                sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=step),
            ).result()
            rewards = bandit_rewards(tokenizer, result.sequences)
            rewards_per_step.append(float(rewards.mean()))
            advantages = rewards - rewards.mean()
            data = [datum(s, float(a)) for s, a in zip(result.sequences, advantages, strict=True)]
            fwd = training.forward_backward(data, "stable_reinforce")
            training.optim_step(types.AdamParams(learning_rate=4e-3))
            metrics = fwd.result().metrics
            # Recorded sampler logprobs replaced the zeros: on-policy, the ratio is about 1.
            assert abs(metrics["ratio:mean"] - 1.0) < 0.05, metrics
        assert np.mean(rewards_per_step[-2:]) > rewards_per_step[0] + 0.4, rewards_per_step


def test_a_warm_shutdown_of_the_celery_worker_ends_its_model_worker_at_once(
    live_server: Any,
    tinker_base: Any,
    start_worker: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    tinker_data_dir: Path,
    owner_key: tuple[Any, str],
) -> None:
    """`docker stop` sends SIGTERM to the worker's main process only; a warm shutdown waits
    for running tasks, and a model worker would otherwise serve until idle (600 s here)."""
    import signal
    import subprocess

    from tinker_api import futures
    from workers import conf
    from workers.locktable import GpuLockTable

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("OPENTINKER_TINKER_WORKER_IDLE_SECONDS", "600")
    monkeypatch.setenv("OPENTINKER_TINKER_TORCH_THREADS", "1")
    worker = start_worker()
    from tinker_api.models import TrainingModel

    with service_client(live_server.url + "/", owner_key[1]) as service:
        training = service.create_lora_training_client(base_model=BASE_NAME, rank=4).result()
        datum = sft_datum(training.get_tokenizer(), "12+7=", "19")
        training.forward_backward([datum], "cross_entropy").result()
        assert futures.worker_active(BASE_NAME)
        table = GpuLockTable(conf.get_redis())
        assert [lease.job_id for lease in table.leases() if lease.job_id.startswith("tinker:")]

        worker.proc.send_signal(signal.SIGTERM)
        try:
            worker.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker still waits for its model worker:\n{worker.log()[-3000:]}")
        assert f"for {BASE_NAME} ended: shutdown" in worker.log()
        assert not futures.worker_active(BASE_NAME)
        assert not [lease for lease in table.leases() if lease.job_id.startswith("tinker:")]
        # The session is still open: its model, as the worker left it, waits on disk.
        left = TrainingModel.objects.get(pk=training.model_id).spill_path()
        assert left.is_file()
    # The session ended with the client.
    assert not left.exists()
