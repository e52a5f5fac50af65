"""OpenAI request bodies: validated here, at the door, into the op a model worker runs.

Field names, ranges and defaults follow OpenAI's API reference; ``null`` means the default
wherever OpenAI allows it. What the engine cannot do (JSON mode, ``suffix``, audio, image
URLs on the network, predicted outputs, web search) is refused with a 400 naming the
parameter rather than silently ignored; images come as ``data:`` URIs. Fields that only
describe the caller or tune OpenAI's own service (``user``, ``metadata``, ``store``,
``prompt_cache_key`` ...) are accepted and ignored. An unknown field is a 400, as OpenAI
does. Types are strict, as OpenAI's are: ``"2"``, ``true`` or ``2.0`` is no integer, ``"yes"``
no boolean; NaN and Infinity are not JSON.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tinker_api.images import MAX_IMAGE_BYTES
from tinker_api.serving.errors import ApiError

MAX_CHOICES = 64
# OpenAI allows 4; lm-eval's local-completions sends a task's stop list and the EOS text
# untrimmed, as vLLM accepts it, so more are taken here.
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 64
# OpenAI's default for /v1/completions (chat's default is the worker's).
COMPLETION_MAX_TOKENS = 16
# OpenAI's bounds for seed: a signed 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# How deep a body may nest. Nothing OpenAI defines nests half this deep (a tool's JSON schema
# is the deepest), and the rendering and queueing further on recurse through the body.
MAX_DEPTH = 64
# Python's own limit on the digits of an int it parses (sys.get_int_max_str_digits()).
MAX_INT_DIGITS = 4300
# A token id is far below this many digits (leading zeros aside).
MAX_TOKEN_ID_DIGITS = 18
PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class Message(BaseModel):
    # Tool fields vary by template; the template reads what it knows.
    model_config = ConfigDict(extra="allow", strict=True)

    # OpenAI's deprecated "function" role is refused (docs/serving.md): chat templates know
    # a call's result as a "tool" message.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _Common(_Strict):
    model: str = Field(min_length=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    # 0 is greedy decoding (only the most likely token is left), as OpenAI reads it.
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: int | None = Field(None, ge=1)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM's extension: decode to max_tokens through end-of-sequence tokens (benchmarks).
    ignore_eos: bool | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # Known to OpenAI, refused by name in chat_op (UNSUPPORTED): not "unrecognized".
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None


# Chat parameters OpenAI knows that this server refuses, and why.
UNSUPPORTED = {
    "functions": "functions (deprecated by OpenAI) is not supported: give its schemas as tools",
    "function_call": "function_call (deprecated by OpenAI) is not supported: use tools",
    "audio": "audio output is not supported by this server (it is text-only)",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo scores the prompt without generating (lm-eval's loglikelihood requests).
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        # The union's own error names whichever member it tried first ("a valid string"),
        # which misleads for a list of the wrong items.
        if not _is_prompt(value):
            raise ValueError(f"must be {PROMPT_SHAPES}")
        return value


def _is_token_ids(value: Any) -> bool:
    # bool is an int to Python, not to OpenAI.
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if not isinstance(value, list):
        return False
    return (
        all(isinstance(p, str) for p in value)
        or _is_token_ids(value)
        or all(_is_token_ids(p) for p in value)
    )


# pydantic names the union member it tried ("str", "list[int]", "StreamOptions") in an
# error's location: not part of the parameter's name.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|\w+\[.*\])$")


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_MEMBER.match(str(part)):
            out += f".{part}" if out else str(part)
    return out


class _NumberTooLong(ValueError):
    pass


def _int(text: str) -> int:
    # Past Python's limit int() raises with advice about the interpreter, which is no use to
    # a client.
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _NumberTooLong(f"a number has more than {MAX_INT_DIGITS} digits")
    return int(text)


def _check_strings(data: Any) -> None:
    """Refuse a body nested deeper than MAX_DEPTH, and lone UTF-16 surrogates (JSON's
    ``"\\ud800"``) in any string or key: no tokenizer can encode them. Iterative, because the
    body may nest nearly as deep as the interpreter recurses."""
    todo: list[tuple[Any, str, int]] = [(data, "", 0)]
    while todo:
        value, where, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the body is nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found:
                point = f"U+{ord(found.group()):04X}"
                raise ApiError(
                    400, f"{where}: surrogate characters are not allowed: {point}", where or None
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                inner = f"{where}.{key}" if where else str(key)
                if _SURROGATE.search(key):
                    raise ApiError(
                        400,
                        f"{where or 'body'}: surrogate characters are not allowed in keys",
                        where or None,
                    )
                todo.append((item, inner, depth + 1))
        elif isinstance(value, list):
            todo.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


def _no_constant(name: str) -> Any:
    # Python's json reads NaN, Infinity and -Infinity, which JSON does not have.
    raise ValueError(f"{name} is not a JSON value")


def _parse(model: type[_Common], body: bytes) -> Any:
    try:
        data = json.loads(body or b"null", parse_int=_int, parse_constant=_no_constant)
    except _NumberTooLong as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ApiError(400, "the body is not valid JSON: it is nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    _check_strings(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(tuple(first["loc"]))
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {param}", param) from exc
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {message}", param or None) from exc


def _logit_bias(req: _Common) -> dict[str, float]:
    """OpenAI's logit_bias: token ids (as strings) to biases in [-100, 100]."""
    out: dict[str, float] = {}
    given: dict[str, str] = {}
    for key, value in (req.logit_bias or {}).items():
        where = f"logit_bias.{key}"
        # str.isdigit() also takes "²" and "٣", which int() refuses or reads as another id.
        if not (key.isascii() and key.isdigit()):
            raise ApiError(400, f"logit_bias: {key!r} is not a token id", where)
        digits = key.lstrip("0") or "0"
        if len(digits) > MAX_TOKEN_ID_DIGITS:
            raise ApiError(
                400,
                f"logit_bias: a token id of {len(digits)} digits is outside the vocabulary",
                "logit_bias",
            )
        if not -100.0 <= value <= 100.0:
            raise ApiError(400, f"logit_bias: {value} for {key} is outside [-100, 100]", where)
        token = str(int(digits))
        if token in given:
            raise ApiError(
                400, f"logit_bias: {given[token]!r} and {key!r} name the same token", where
            )
        given[token] = key
        out[token] = float(value)
    return out


def _stop(req: _Common) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} sequences", "stop")
    if any(s == "" for s in stop):
        raise ApiError(400, "stop: sequences must not be empty", "stop")
    return stop


def _params(req: _Common, max_tokens: int | None) -> dict[str, Any]:
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0.0:
        # Nothing but the most likely token is left: greedy, whatever the temperature.
        temperature, top_p = 0.0, 1.0
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": req.seed,
        "stop": _stop(req),
        "ignore_eos": bool(req.ignore_eos),
        "frequency_penalty": float(req.frequency_penalty or 0.0),
        "presence_penalty": float(req.presence_penalty or 0.0),
        "logit_bias": _logit_bias(req),
    }


def _image(part: dict[str, Any], where: str) -> str:
    """An ``image_url`` part's image: the base64 of a ``data:image/...;base64,`` URI."""
    given = part.get("image_url")
    if not isinstance(given, dict) or not isinstance(given.get("url"), str):
        param = f"{where}.image_url"
        raise ApiError(400, f"{param}: an image part needs image_url: {{url: ...}}", param)
    param = f"{where}.image_url.url"
    if given.get("detail") not in (None, "auto", "low", "high"):
        detail = f"{where}.image_url.detail"
        raise ApiError(400, f"{detail}: must be auto, low or high", detail)
    head, _, payload = given["url"].partition(",")
    if not head.startswith("data:"):
        raise ApiError(
            400,
            f"{param}: this server fetches no URLs; send the image as a data URI "
            "(data:image/png;base64,...)",
            param,
        )
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ApiError(400, f"{param}: a data URI must be data:image/...;base64,...", param)
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ApiError(400, f"{param}: the image is over {MAX_IMAGE_BYTES} bytes", param)
    try:
        base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(400, f"{param}: the data URI's base64 is invalid: {exc}", param) from None
    return payload


def _content(
    content: str | list[dict[str, Any]] | None, where: str, images: list[dict[str, str]]
) -> str | list[dict[str, Any]]:
    """A message's content as the chat template reads it: its text, or (where it carries
    images) its parts in order, each image a ``{"type": "image"}`` part whose data goes to
    ``images``."""
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type")
        at = f"{where}.content[{i}]"
        if kind == "image_url":
            images.append({"data": _image(part, at), "where": at})
            parts.append({"type": "image"})
            continue
        if kind not in ("text", "input_text"):
            raise ApiError(
                400,
                f"content parts of type {kind!r} are not supported (only text and image_url)",
                at,
            )
        if not isinstance(part.get("text"), str):
            param = f"{at}.text"
            raise ApiError(400, f"{param}: a text part's text must be a string", param)
        parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def content_text(content: str | list[dict[str, Any]]) -> str:
    """The text of a rendered message's content (its image parts spell none)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content)


def _check_message(m: Message, where: str) -> None:
    if m.content is None and m.role != "assistant":
        # Only an assistant message may leave content out (its tool_calls say what it did).
        param = f"{where}.content"
        raise ApiError(400, f"{param}: a {m.role} message needs content", param)
    if m.role == "tool" and m.tool_call_id is None:
        param = f"{where}.tool_call_id"
        raise ApiError(400, f"{param}: a tool message needs the id of the call it answers", param)


def _check_stream(req: _Common) -> None:
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")


def _tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI sends a call's arguments as a JSON string; chat templates (and transformers'
    docs) take them as an object, and a Hermes-style template writes ``arguments | tojson``,
    which would quote the string once more. Arguments that are not a JSON object stay text."""
    out = []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                parsed = json.loads(function["arguments"], parse_constant=_no_constant)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        out.append(call)
    return out


def chat_op(body: bytes) -> tuple[ChatRequest, dict[str, Any]]:
    req = _parse(ChatRequest, body)
    _check_stream(req)
    for name, why in UNSUPPORTED.items():
        if getattr(req, name) is not None:
            raise ApiError(400, why, name)
    fmt = (req.response_format or {}).get("type", "text")
    if fmt != "text":
        raise ApiError(
            400, f"response_format {fmt!r} is not supported (only text)", "response_format"
        )
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    both = req.max_tokens is not None and req.max_completion_tokens is not None
    if both and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
    messages = []
    images: list[dict[str, str]] = []
    for i, m in enumerate(req.messages):
        _check_message(m, f"messages[{i}]")
        rendered: dict[str, Any] = {k: v for k, v in m.model_dump().items() if v is not None}
        # Chat templates know system, not OpenAI's newer "developer".
        rendered["role"] = "system" if m.role == "developer" else m.role
        rendered["content"] = _content(m.content, f"messages[{i}]", images)
        if m.tool_calls:
            rendered["tool_calls"] = _tool_calls(m.tool_calls)
        messages.append(rendered)
    op = {
        "mode": "chat",
        "messages": messages,
        "tools": req.tools,
        "n": req.n or 1,
        "stream": bool(req.stream),
        "logprobs": bool(req.logprobs),
        "top_logprobs": int(req.top_logprobs or 0),
        "params": _params(req, req.max_completion_tokens or req.max_tokens),
    }
    if images:
        op["images"] = images
    return req, op


def completion_op(body: bytes) -> tuple[CompletionRequest, dict[str, Any]]:
    req = _parse(CompletionRequest, body)
    _check_stream(req)
    if req.suffix:
        raise ApiError(400, "suffix is not supported by this server", "suffix")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise ApiError(400, "best_of is not supported by this server (only best_of = n)", "best_of")
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise ApiError(400, "prompt must not be empty", "prompt")
    if len(prompts) * n > MAX_CHOICES or len(prompts) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_CHOICES} choices (prompts x n) per request", "prompt")
    op = {
        "mode": "completion",
        "prompts": prompts,
        "n": n,
        "stream": bool(req.stream),
        "echo": bool(req.echo),
        "logprobs": req.logprobs is not None,
        "top_logprobs": int(req.logprobs or 0),
        "params": _params(req, COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens),
    }
    return req, op
