"""Request bodies as OpenAI's clients send them, read into the op a model worker runs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tinker_api.serving import params
from tinker_api.serving.errors import ApiError

QUESTION = [{"role": "user", "content": "1+1="}]


def chat(**body: Any) -> dict[str, Any]:
    return params.chat_op(json.dumps({"model": "m", "messages": QUESTION, **body}).encode())[1]


def completion(**body: Any) -> dict[str, Any]:
    return params.completion_op(json.dumps({"model": "m", "prompt": "1+1=", **body}).encode())[1]


def test_null_means_the_default_wherever_openai_allows_it() -> None:
    # Clients that send every field, the unset ones as null.
    nulls = {"n": None, "stream": None, "ignore_eos": None, "top_p": None, "temperature": None}
    op = chat(**nulls, stream_options=None)
    assert op["n"] == 1 and op["stream"] is False
    assert op["params"]["ignore_eos"] is False and op["params"]["top_p"] == 1.0
    op = completion(**nulls, max_tokens=None, logprobs=None, echo=None)
    assert op["n"] == 1 and op["echo"] is False and op["params"]["max_tokens"] == 16
    streamed = params.chat_op(
        json.dumps(
            {
                "model": "m",
                "messages": QUESTION,
                "stream": True,
                "stream_options": {"include_usage": None},
            }
        ).encode()
    )[0]
    assert not (streamed.stream_options and streamed.stream_options.include_usage)


def test_top_p_zero_is_greedy() -> None:
    sampled = chat(top_p=0, temperature=0.9)["params"]
    assert (sampled["temperature"], sampled["top_p"]) == (0.0, 1.0)


def test_nan_and_infinity_are_not_json() -> None:
    for text in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"model": "m", "messages": [], "temperature": {text}}}'.encode()
        with pytest.raises(ApiError) as exc:
            params.chat_op(body)
        assert exc.value.status == 400 and f"{text} is not a JSON value" in exc.value.message


def test_parameters_that_only_tune_openais_own_service_are_accepted() -> None:
    op = chat(
        prompt_cache_key="k",
        prompt_cache_retention="24h",
        safety_identifier="u-1",
        verbosity="low",
        store=False,
        metadata={"a": "b"},
        user="u",
    )
    assert op["mode"] == "chat"


def test_tool_call_arguments_reach_the_template_as_an_object() -> None:
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "x"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ]
    op = params.chat_op(json.dumps({"model": "m", "messages": history}).encode())[1]
    calls = op["messages"][1]["tool_calls"]
    # What a Hermes template writes with `arguments | tojson`: an object, not a quoted string.
    assert calls[0]["function"]["arguments"] == {"a": 1, "b": 1}
    # Arguments that are no JSON object are passed on as the client wrote them.
    assert calls[1]["function"]["arguments"] == "x"
    assert calls[0]["id"] == "call_1"


def test_echo_and_a_zero_max_tokens_are_a_completion_that_scores_its_prompt() -> None:
    op = completion(echo=True, max_tokens=0, logprobs=1)
    assert op["echo"] is True and op["params"]["max_tokens"] == 0 and op["top_logprobs"] == 1


def test_browsers_of_the_allowed_origins_may_call_it(
    tinker_base: Any, owner_key: tuple[Any, str], settings: Any
) -> None:
    from django.test import Client

    key = owner_key[1]
    client = Client()
    preflight = {
        "HTTP_ORIGIN": "https://chat.example.org",
        "HTTP_ACCESS_CONTROL_REQUEST_METHOD": "POST",
        "HTTP_ACCESS_CONTROL_REQUEST_HEADERS": "authorization, content-type, x-stainless-os",
    }
    # Not configured (the default): no CORS, and OPTIONS is a wrong method.
    refused = client.options("/v1/chat/completions", **preflight)
    assert refused.status_code == 405 and "Access-Control-Allow-Origin" not in refused
    assert refused["Allow"] == "POST"

    settings.OPENTINKER_OPENAI_CORS_ORIGINS = ["https://chat.example.org"]
    allowed = client.options("/v1/chat/completions", **preflight)
    assert allowed.status_code == 204
    assert allowed["Access-Control-Allow-Origin"] == "https://chat.example.org"
    assert allowed["Access-Control-Allow-Methods"] == "POST, OPTIONS"
    assert "x-stainless-os" in allowed["Access-Control-Allow-Headers"]
    listed = client.get(
        "/v1/models", HTTP_ORIGIN="https://chat.example.org", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    assert listed.status_code == 200
    assert listed["Access-Control-Allow-Origin"] == "https://chat.example.org"
    assert "x-request-id" in listed["Access-Control-Expose-Headers"]
    # Errors too, or the browser hides them from the page.
    unauthorized = client.get("/v1/models", HTTP_ORIGIN="https://chat.example.org")
    assert unauthorized.status_code == 401 and unauthorized["Access-Control-Allow-Origin"]
    # Another origin gets nothing.
    other = client.options("/v1/chat/completions", **{**preflight, "HTTP_ORIGIN": "https://x.io"})
    assert other.status_code == 405 and "Access-Control-Allow-Origin" not in other

    settings.OPENTINKER_OPENAI_CORS_ORIGINS = ["*"]
    anyone = client.options("/v1/completions", **{**preflight, "HTTP_ORIGIN": "https://x.io"})
    assert anyone.status_code == 204 and anyone["Access-Control-Allow-Origin"] == "*"
