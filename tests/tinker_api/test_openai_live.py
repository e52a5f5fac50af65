"""The official ``openai`` client against a live OpenTinker: real HTTP server, real API keys, a
real Celery worker and the model worker of the tiny base model, which renders, decodes and
streams every request (``/v1/chat/completions``, ``/v1/completions``).

The LoRA job is a real one as far as serving can tell: a job row of the team and the adapter
and checkpoint files a run leaves (``Policy.export_peft`` and ``Policy.save_state`` of a
policy whose weights were moved away from zero, so that it samples differently).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fixtures.workers import wait_for
from tests.tinker_api.conftest import BASE_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "What is 12+7?"}]


@pytest.fixture
def server(live_tinker: str, clean_tinker_keys: None) -> str:
    """The OpenAI base URL of the live server, with a Celery worker serving the gpu queue."""
    return live_tinker + "/v1"


def client(url: str, key: str, **kwargs: Any) -> Any:
    return openai.OpenAI(base_url=url, api_key=key, timeout=120, **kwargs)


@pytest.fixture
def lora_job(team: Any, owner: Any, tinker_data_dir: Path, base_model_dir: Path) -> Any:
    """A finished job of ``team`` on the tiny base model, with its final adapter and one
    checkpoint holding the same weights."""
    import torch

    from jobs.models import Job, JobState
    from training.engine import Engine

    job = Job.objects.create(
        team=team,
        created_by=owner,
        name="adder",
        spec={
            "method": "rl",
            "env": "bandit",
            "base_model": BASE_NAME,
            "lora": {"rank": 4, "alpha": 8.0},
        },
        spec_version=1,
        state=JobState.SUCCEEDED,
    )
    engine = Engine(str(base_model_dir), device="cpu")
    policy = engine.create_policy(rank=4, alpha=8.0, policy_id="trained")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _name, (a, b) in policy.lora_weights.items():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.5)
            a.copy_(torch.randn(a.shape, generator=gen) * 0.5)
    root = tinker_data_dir / "jobs" / str(job.pk)
    policy.export_peft(policy.snapshot(), root / "adapter")
    from training.checkpoint import CheckpointDir

    CheckpointDir(root / "checkpoints").save(policy, "step-000003", extra={"step": 3})
    return job


def test_it_answers_chat_and_completions_streaming_and_not(
    server: str, owner_key: tuple[Any, str], base_model_dir: Path
) -> None:
    api = client(server, owner_key[1])
    chat = api.chat.completions.create(
        model=BASE_NAME, messages=QUESTION, n=3, max_tokens=12, seed=5, temperature=1.0
    )
    assert chat.object == "chat.completion" and chat.model == BASE_NAME
    assert [c.index for c in chat.choices] == [0, 1, 2]
    for c in chat.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert c.finish_reason in ("stop", "length")
    assert chat.usage.prompt_tokens > 5
    assert 3 <= chat.usage.completion_tokens <= 36
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    # The answer's tokens count against its team's tokens per minute.
    from workers import conf

    counted = conf.get_redis().scan_iter(match=f"*rate:{owner_key[0].team_id}:*:tokens")
    assert sum(int(conf.get_redis().get(k) or 0) for k in counted) >= chat.usage.total_tokens
    # n samples of one seed differ from one another, and the same seed repeats them.
    again = api.chat.completions.create(
        model=BASE_NAME, messages=QUESTION, n=3, max_tokens=12, seed=5, temperature=1.0
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in chat.choices]

    stream = api.chat.completions.create(
        model=BASE_NAME,
        messages=QUESTION,
        max_tokens=12,
        seed=5,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", "", ""]
    reasons: dict[int, str] = {}
    usage = None
    content_chunks = 0
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                texts[c.index] += c.delta.content
                content_chunks += 1
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    # The stream says what the same request said in one body, piece by piece.
    assert texts == [c.message.content for c in chat.choices]
    assert reasons == {c.index: c.finish_reason for c in chat.choices}
    assert content_chunks > 3
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

    greedy = api.completions.create(
        model=BASE_NAME, prompt="12+7=", max_tokens=8, temperature=0, logprobs=3
    )
    choice = greedy.choices[0]
    assert greedy.object == "text_completion"
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == greedy.usage.completion_tokens
    # The entries spell the text, and a special token ending it adds no offset.
    assert "".join(t for t in lp.tokens if t != "<|im_end|>") == choice.text
    assert lp.text_offset[-1] <= len(choice.text)
    assert all(x <= 0.0 for x in lp.token_logprobs)
    # Up to 3 alternatives and the chosen token (here always among them: greedy).
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one at every position.
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert abs(max(top.values()) - logprob) < 1e-4, (token, top)
    assert lp.text_offset[0] == 0
    streamed = "".join(
        c.choices[0].text
        for c in api.completions.create(
            model=BASE_NAME, prompt="12+7=", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == choice.text

    # A stop sequence ends the text before it, and the choice says "stop".
    long = api.completions.create(
        model=BASE_NAME,
        prompt="12+7=",
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = long.choices[0].text
    assert len(full) > 4
    cut = full[2:4]
    stopped = api.completions.create(
        model=BASE_NAME,
        prompt="12+7=",
        max_tokens=40,
        temperature=0,
        stop=[cut],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.index(cut)]
    streamed_stop = "".join(
        c.choices[0].text
        for c in api.completions.create(
            model=BASE_NAME,
            prompt="12+7=",
            max_tokens=40,
            temperature=0,
            stop=[cut],
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if c.choices
    )
    assert streamed_stop == stopped.choices[0].text

    chat_lp = api.chat.completions.create(
        model=BASE_NAME, messages=QUESTION, max_tokens=6, logprobs=True, top_logprobs=2, seed=1
    )
    entries = chat_lp.choices[0].logprobs.content
    assert len(entries) == chat_lp.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0.0 for e in entries)

    # logit_bias and the penalties reach the decoder: +100 on one token makes it the only one;
    # a strong presence penalty keeps a greedy answer from repeating any token.
    forced_id = 40
    forced = api.completions.create(
        model=BASE_NAME,
        prompt="12+7=",
        max_tokens=5,
        temperature=1.0,
        seed=2,
        logit_bias={str(forced_id): 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.usage.completion_tokens == 5
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    assert forced.choices[0].text == tokenizer.decode([forced_id] * 5)
    greedy = {"prompt": "12+7=", "max_tokens": 16, "temperature": 0, "logprobs": 0}
    greedy["extra_body"] = {"ignore_eos": True}
    plain = api.completions.create(model=BASE_NAME, **greedy)
    fresh = api.completions.create(model=BASE_NAME, presence_penalty=2.0, **greedy)
    plain_tokens = plain.choices[0].logprobs.tokens
    fresh_tokens = fresh.choices[0].logprobs.tokens
    assert len(fresh_tokens) == len(plain_tokens) == 16
    assert fresh_tokens != plain_tokens
    assert len(set(fresh_tokens)) > len(set(plain_tokens))
    with pytest.raises(openai.BadRequestError) as bias_exc:
        api.completions.create(
            model=BASE_NAME, prompt="1+1=", max_tokens=2, logit_bias={"999999999": 5}
        )
    assert bias_exc.value.body["param"] == "logit_bias"

    # What only the worker can judge (the rendered prompt's length) is still a 400, stream or not.
    for stream_flag in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            api.chat.completions.create(
                model=BASE_NAME, messages=QUESTION, max_tokens=100_000, stream=stream_flag
            )
        assert exc.value.body["param"] == "max_tokens"


def test_it_serves_a_lora_jobs_policy_unlike_its_base_and_only_to_its_team(
    server: str, owner_key: tuple[Any, str], outsider_key: tuple[Any, str], lora_job: Any
) -> None:
    api = client(server, owner_key[1])
    names = {m.id for m in api.models.list()}
    job_name, ckpt_name = f"job:{lora_job.pk}", f"job:{lora_job.pk}:step-000003"
    assert {BASE_NAME, job_name, ckpt_name} <= names

    def tokens(model: str, out: dict[str, Any]) -> None:
        out[model] = api.completions.create(
            model=model,
            prompt="12+7=",
            max_tokens=16,
            seed=11,
            temperature=1.0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )

    # Sent together, so that they meet in the worker's batch: rows of different adapters.
    results: dict[str, Any] = {}
    threads = [
        threading.Thread(target=tokens, args=(m, results))
        for m in (BASE_NAME, job_name, ckpt_name, "adder")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seq = {m: r.choices[0].logprobs.tokens for m, r in results.items()}
    assert seq[job_name] != seq[BASE_NAME]
    # The job's name, its id and its checkpoint (the same weights) are one policy.
    assert seq["adder"] == seq[job_name] == seq[ckpt_name]
    chat = api.chat.completions.create(model="adder", messages=QUESTION, max_tokens=4)
    assert chat.model == "adder"

    outsider = client(server, outsider_key[1])
    assert job_name not in {m.id for m in outsider.models.list()}
    for name in (job_name, "adder", ckpt_name):
        with pytest.raises(openai.NotFoundError) as exc:
            outsider.completions.create(model=name, prompt="1+1=", max_tokens=2)
        assert exc.value.body["code"] == "model_not_found"
        assert exc.value.body["param"] == "model"


def _rid(chunk_id: str) -> str:
    return "req-" + chunk_id.split("-", 1)[1]


def test_it_streams_while_generating_and_a_client_that_hangs_up_frees_its_slot(
    server: str, owner_key: tuple[Any, str], settings: Any
) -> None:
    from tinker_api import futures

    settings.OPENTINKER_TINKER_SAMPLE_QUEUE_LIMIT = 1
    api = client(server, owner_key[1], max_retries=0)
    api.completions.create(model=BASE_NAME, prompt="1+1=", max_tokens=1)  # the worker is up
    # The worker frees a request's place just after its answer goes out: under load the next
    # request can come first, and with a limit of one it would be told to come back.
    deadline = time.monotonic() + 10
    while futures.queued_samples(BASE_NAME) and time.monotonic() < deadline:
        time.sleep(0.05)

    stream = api.chat.completions.create(
        model=BASE_NAME,
        messages=QUESTION,
        max_tokens=480,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    rid = ""
    for chunk in stream:
        rid = _rid(chunk.id)
        if chunk.choices and chunk.choices[0].delta.content:
            seen += 1
        if seen == 3:
            break
    # Tokens arrived while the request was still being generated.
    assert futures.get(rid)["status"] == futures.CLAIMED
    # Its place is taken: with a queue limit of one, another request is told to come back.
    with pytest.raises(openai.RateLimitError) as exc:
        api.chat.completions.create(model=BASE_NAME, messages=QUESTION, max_tokens=2)
    assert exc.value.response.headers["retry-after"] == "1"
    assert exc.value.body["type"] == "requests"
    assert exc.value.body["code"] == "rate_limit_exceeded"
    stream.close()

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and futures.get(rid)["status"] != futures.DONE:
        time.sleep(0.05)
    import json

    outcome = json.loads(futures.get(rid)["json"])
    assert outcome["cancelled"] is True
    # Generation stopped soon after the client left, well before max_tokens.
    assert outcome["usage"]["completion_tokens"] < 480
    assert futures.queued_samples(BASE_NAME) == 0
    after = api.chat.completions.create(model=BASE_NAME, messages=QUESTION, max_tokens=2)
    assert after.choices[0].finish_reason in ("stop", "length")


def test_it_refuses_in_openai_error_shape(server: str, owner_key: tuple[Any, str]) -> None:
    with pytest.raises(openai.AuthenticationError) as exc:
        client(server, "otk_not_a_key").models.list()
    assert exc.value.status_code == 401 and exc.value.body["code"] == "invalid_api_key"
    api = client(server, owner_key[1])
    with pytest.raises(openai.NotFoundError) as exc:
        api.chat.completions.create(model="gpt-17", messages=QUESTION)
    assert set(exc.value.body) == {"message", "type", "param", "code"}
    assert exc.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=BASE_NAME, messages=QUESTION, temperature=3.5)
    assert bad.value.body["param"] == "temperature"


def test_it_serves_a_tinker_sampler_path_trained_through_the_sdk(
    server: str, owner_key: tuple[Any, str], outsider_key: tuple[Any, str]
) -> None:
    import numpy as np
    import tinker
    from tinker import types

    base_url = server.removesuffix("v1")
    with tinker.ServiceClient(base_url=base_url, api_key="tml-" + owner_key[1]) as service:
        training = service.create_lora_training_client(base_model=BASE_NAME, rank=8, seed=2)
        training = training.result()
        tokenizer = training.get_tokenizer()
        tokens = tokenizer.encode("12+7=19", add_special_tokens=False)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": np.array(tokens[1:], dtype=np.int64),
                "weights": np.ones(len(tokens) - 1, dtype=np.float32),
            },
        )
        for _ in range(3):
            fwd = training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            fwd.result()
        path = training.save_weights_for_sampler("served").result().path

    api = client(server, owner_key[1])
    assert path in {m.id for m in api.models.list()}
    # The client escapes the slashes of the name in the path; the server reads it back whole.
    assert api.models.retrieve(path).id == path

    def greedy(model: str) -> list[str]:
        out = api.completions.create(
            model=model,
            prompt="12+7=",
            max_tokens=12,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        return list(out.choices[0].logprobs.tokens)

    assert greedy(path) != greedy(BASE_NAME)
    with pytest.raises(openai.NotFoundError):
        client(server, outsider_key[1]).completions.create(model=path, prompt="1", max_tokens=1)


def test_it_starts_a_request_while_another_one_streams(
    server: str, owner_key: tuple[Any, str]
) -> None:
    from tinker_api import futures

    api = client(server, owner_key[1])
    stream = api.completions.create(
        model=BASE_NAME,
        prompt="12+7=",
        max_tokens=480,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    rid = _rid(first.id)
    # A short request sent now joins the running batch and is answered before the long
    # one ends, instead of waiting behind it.
    short = api.chat.completions.create(model=BASE_NAME, messages=QUESTION, max_tokens=3)
    assert short.usage.completion_tokens <= 3
    assert futures.get(rid)["status"] == futures.CLAIMED
    text = first.choices[0].text + "".join(c.choices[0].text for c in chunks if c.choices)
    # The worker publishes the last event before it marks the request done: a moment later.
    wait_for(lambda: futures.get(rid)["status"] == futures.DONE, 10, "the request to be done")
    assert len(text) > 100
