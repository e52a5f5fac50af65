"""``/v1`` on a vision-language base model (models/tiny-vl, Qwen2.5-VL): its text side serves
chat and completions like any base model, and chat messages carry images (``image_url`` parts
with data URIs) that its vision tower reads. The official ``openai`` client talks to a live
server, a real Celery worker and the model worker holding tiny-vl, whose config keeps the
decoder's vocabulary and context in its text config (``config.get_text_config()``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.tinker_api.conftest import sdk_worker_env
from training.model import TINY_VL_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VL_NAME = "tiny-vl"
QUESTION = [{"role": "user", "content": "What is 12+7?"}]


@pytest.fixture
def server(
    live_server: Any,
    transactional_db: None,
    start_worker: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    tinker_data_dir: Path,
    clean_tinker_keys: None,
) -> Iterator[str]:
    from jobs.models import BaseModel

    if not (Path(TINY_VL_MODEL) / "config.json").is_file():
        pytest.skip("no models/tiny-vl: run scripts/build_tiny_vl_model.py")
    # A registry context above the model's own 1024 positions: the worker must find those
    # in the text config to refuse what does not fit.
    BaseModel.objects.update_or_create(
        name=VL_NAME,
        defaults={"path": TINY_VL_MODEL, "max_lora_rank": 16, "max_context": 4096},
    )
    sdk_worker_env(monkeypatch)
    start_worker()
    return live_server.url + "/v1"


def test_it_serves_chat_and_completions_on_a_vision_language_base_model(
    server: str, owner_key: tuple[Any, str]
) -> None:
    api = openai.OpenAI(base_url=server, api_key=owner_key[1], timeout=120, max_retries=0)
    assert VL_NAME in [m.id for m in api.models.list()]

    chat = api.chat.completions.create(model=VL_NAME, messages=QUESTION, max_tokens=4, seed=1)
    assert chat.model == VL_NAME
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 4

    streamed = ""
    for chunk in api.chat.completions.create(
        model=VL_NAME, messages=QUESTION, max_tokens=4, seed=1, stream=True
    ):
        for c in chunk.choices:
            streamed += c.delta.content or ""
    assert streamed == chat.choices[0].message.content

    text = api.completions.create(model=VL_NAME, prompt="12+7=", max_tokens=4, temperature=0)
    assert isinstance(text.choices[0].text, str)
    assert text.usage is not None and 1 <= text.usage.completion_tokens <= 4
    ids = api.completions.create(model=VL_NAME, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert ids.usage is not None and ids.usage.prompt_tokens == 3

    # The vocabulary (741 ids) and the context (1024 positions) are the text config's.
    with pytest.raises(openai.BadRequestError) as out_of_vocab:
        api.completions.create(model=VL_NAME, prompt=[740, 741], max_tokens=2)
    assert out_of_vocab.value.body["param"] == "prompt"
    assert "[0, 741)" in out_of_vocab.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        api.chat.completions.create(model=VL_NAME, messages=QUESTION, max_tokens=1500)
    assert too_long.value.body["code"] == "context_length_exceeded"
    assert "maximum context length is 1024 tokens" in too_long.value.body["message"]


def test_it_answers_a_chat_about_an_image_as_the_engine_does(
    server: str, owner_key: tuple[Any, str]
) -> None:
    from tests.tinker_api.test_openai_images import asking, picture, reference
    from training.engine import Engine

    engine = Engine(TINY_VL_MODEL, device="cpu")
    api = openai.OpenAI(base_url=server, api_key=owner_key[1], timeout=120, max_retries=0)
    question = "What colour is the shape?"
    for seed in (1, 2):
        png = picture(seed)
        tokens, prompt_tokens = reference(engine, png, question, 6)
        expected = engine.tokenizer.decode(tokens, skip_special_tokens=True)
        create = {
            "model": VL_NAME,
            "messages": asking(png, question),
            "max_tokens": 6,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        chat = api.chat.completions.create(**create)
        assert chat.choices[0].message.content == expected
        assert chat.usage is not None and chat.usage.prompt_tokens == prompt_tokens
        streamed = "".join(
            c.delta.content or ""
            for chunk in api.chat.completions.create(**create, stream=True)
            for c in chunk.choices
        )
        assert streamed == expected
    messages = asking(picture(1))
    messages[0]["content"][1]["image_url"]["url"] = "http://127.0.0.1/a.png"
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=VL_NAME, messages=messages, max_tokens=2)
    assert refused.value.body["param"] == "messages[0].content[1].image_url.url"
