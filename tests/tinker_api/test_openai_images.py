"""Images in ``/v1/chat/completions`` messages (OpenAI's ``image_url`` parts, as data URIs):
checked at the door, rendered by the model worker through the base model's chat template with
each image's placeholder as many tokens as the image fills, and decoded by the continuous
batch with the vision tower at prefill. The model worker's ``ChatHandler`` runs on a real
tiny-vl engine and Redis; its tokens are compared with the engine's own sampler on the same
prompt and image."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.tinker_api.test_openai_api import CHAT, bearer, error_of, post
from tests.tinker_api.test_openai_worker import chat_op, drive, events_of, make_handler
from tinker_api.serving import params
from tinker_api.serving.errors import ApiError
from training import geometry
from training.model import TINY_VL_MODEL


def picture(seed: int) -> bytes:
    png, _shape, _colour = geometry.shape_picture(random.Random(seed))
    return png


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def asking(png: bytes, question: str = "What colour is the shape?") -> list[dict[str, Any]]:
    parts = [
        {"type": "text", "text": question},
        {"type": "image_url", "image_url": {"url": data_uri(png), "detail": "auto"}},
    ]
    return [{"role": "user", "content": parts}]


def door(messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = json.dumps({"model": "m", "messages": messages}).encode()
    return params.chat_op(body)[1]


@pytest.fixture(scope="module")
def vl_engine() -> Any:
    import torch

    from training.engine import Engine

    if not (Path(TINY_VL_MODEL) / "config.json").is_file():
        pytest.skip("no models/tiny-vl: run scripts/build_tiny_vl_model.py")
    torch.set_num_threads(1)
    return Engine(TINY_VL_MODEL, device="cpu")


def reference(engine: Any, png: bytes, question: str, max_tokens: int) -> tuple[list[int], int]:
    """Greedy tokens of the engine's own sampler on the prompt the chat template renders, and
    the prompt's length with its image's placeholders."""
    from training import vision
    from training.sampler import generate
    from training.types import SamplingParams

    messages = [
        {"role": "user", "content": [{"type": "text", "text": question}, {"type": "image"}]}
    ]
    text = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    image = engine.encode_image(png)
    spec = vision.spec_of(engine.model)
    prompt = vision.expand_placeholders(
        engine.tokenizer.encode(text, add_special_tokens=False), [image], spec.image_token_id
    )
    (seq,) = generate(
        engine.model,
        engine.tokenizer,
        [prompt],
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        stop_on_eos=False,
        images=[[image]],
    )
    return list(seq.tokens), len(prompt)


def test_the_door_takes_data_uris_and_names_what_it_refuses() -> None:
    png = picture(1)
    op = door(asking(png))
    assert op["messages"][0]["content"] == [
        {"type": "text", "text": "What colour is the shape?"},
        {"type": "image"},
    ]
    assert op["images"] == [
        {"data": base64.b64encode(png).decode(), "where": "messages[0].content[1]"}
    ]
    # Text parts alone stay one string, as a text-only template reads them.
    plain = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert door(plain)["messages"][0]["content"] == "ab" and "images" not in door(plain)

    url = "messages[0].content[1].image_url.url"
    for image_url, param, words in (
        ({"url": "https://example.com/a.png"}, url, "fetches no URLs"),
        ({"url": "data:text/plain;base64,aGk="}, url, "data:image/...;base64"),
        ({"url": "data:image/png;base64,@@@"}, url, "base64 is invalid"),
        (
            {"url": data_uri(png), "detail": "max"},
            "messages[0].content[1].image_url.detail",
            "auto",
        ),
        ("data:image/png;base64,aGk=", "messages[0].content[1].image_url", "image_url: {url"),
    ):
        messages = asking(png)
        messages[0]["content"][1]["image_url"] = image_url
        with pytest.raises(ApiError) as refused:
            door(messages)
        assert refused.value.param == param and words in str(refused.value), image_url
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
    with pytest.raises(ApiError) as refused:
        door(audio)
    assert refused.value.param == "messages[0].content[0]"


def test_a_text_only_base_model_refuses_images_at_the_door(
    tinker_base: Any, tinker_data_dir: Path, clean_tinker_keys: None, owner_key: tuple[Any, str]
) -> None:
    body = {"model": tinker_base.name, "messages": asking(picture(1)), "max_tokens": 2}
    response = post(bearer(owner_key[1]), CHAT, body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "messages[0].content[1]" and "takes no images" in error["message"]


def test_the_worker_decodes_a_chat_with_an_image_as_the_engines_sampler(
    vl_engine: Any, redis_client: Any, clean_tinker_keys: None, settings: Any
) -> None:
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 0
    handler = make_handler(vl_engine)
    question = "What colour is the shape?"
    pictures = [picture(1), picture(2)]
    ops = [
        chat_op(
            messages=door(asking(png, question))["messages"],
            images=door(asking(png, question))["images"],
            n=2,
            max_tokens=6,
            temperature=0.0,
            ignore_eos=True,
            max_context=1024,
        )
        for png in pictures
    ]
    for op in ops:
        drive(handler, [op])
    for op, png in zip(ops, pictures, strict=True):
        got = events_of(op)
        assert got[0]["t"] == "start", got
        tokens, prompt_tokens = reference(vl_engine, png, question, 6)
        assert got[0]["prompt_tokens"] == prompt_tokens
        text = vl_engine.tokenizer.decode(tokens, skip_special_tokens=True)
        ends = [e for e in got if e["t"] == "end"]
        assert [e["text"] for e in ends] == [text, text]
        assert got[-1]["usage"]["completion_tokens"] == 12


def test_the_worker_refuses_an_image_it_cannot_read_naming_its_part(
    vl_engine: Any, redis_client: Any, clean_tinker_keys: None
) -> None:
    handler = make_handler(vl_engine)
    messages = door(asking(picture(1)))["messages"]
    broken = [
        {"data": base64.b64encode(b"not a picture").decode(), "where": "messages[0].content[1]"}
    ]
    bad = chat_op(messages=messages, images=broken, max_context=1024)
    fine = chat_op(max_tokens=2, max_context=1024)
    drive(handler, [bad, fine])
    (error,) = events_of(bad)
    assert error["status"] == 400 and error["param"] == "messages[0].content[1]"
    assert "cannot be read" in error["message"]
    assert events_of(fine)[-1]["t"] == "done"
