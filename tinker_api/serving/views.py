"""``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``: OpenAI's API over the policies
a team has trained.

Plain Django views (not DRF) because OpenAI's clients expect its error shape everywhere, 401s
included, and a stream of server-sent events. Authentication is the API key store's, as
everywhere else: ``Authorization: Bearer otk_...``; a key sees its own team's policies.

A request is queued for the model worker of its policy's base model, then answered from the
events the worker publishes for it (``tinker_api.events``): a stream is relayed chunk by chunk
as the worker decodes; a client that disconnects marks the request cancelled and the worker
stops generating it. The response starts once the worker has rendered the prompt, so a
prompt too long for the context is still a plain 400, streaming or not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from functools import wraps
from typing import Any

import redis
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.exceptions import AuthenticationFailed

from accounts.authentication import ApiKeyAuthentication
from jobs.models import Job
from jobs.quotas import BudgetSpent
from tinker_api import events, images
from tinker_api.services import serving
from tinker_api.services.lookups import Caller
from tinker_api.serving import params
from tinker_api.serving.errors import ApiError, model_not_found
from tinker_api.serving.replies import Answer, Kind, sse

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)

MAX_BODY_BYTES = 16 * 1024 * 1024
# How long one read of the event stream blocks: also how often a stream sends a keep-alive
# comment (through which a client that went away is noticed) while nothing is generated.
POLL_MS = 1000
# A request still queued this long asks again for a model worker (none may have had a block).
NUDGE_SECONDS = 5.0
# The longest a request waits with no event from its worker before it is given up.
SILENCE_SECONDS = 600.0
# How long a request counts against its team's concurrency limit at most, should its web
# process die before releasing it.
HOLD_SECONDS = 1800.0


# What a browser may read of an answer besides the simple headers.
CORS_EXPOSED = "x-request-id, Retry-After, x-ratelimit-limit-requests, " + (
    "x-ratelimit-remaining-requests, x-ratelimit-reset-requests, x-ratelimit-limit-tokens, "
    "x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens"
)


def _cors_origin(request: HttpRequest) -> str | None:
    """The Access-Control-Allow-Origin for this request's Origin, if that origin is allowed
    (``OPENTINKER_OPENAI_CORS_ORIGINS``)."""
    origin = request.headers.get("Origin")
    allowed = settings.OPENTINKER_OPENAI_CORS_ORIGINS
    if not origin or not allowed:
        return None
    if "*" in allowed:
        return "*"
    return origin if origin in allowed else None


def _preflight(request: HttpRequest, methods: tuple[str, ...]) -> HttpResponse | None:
    origin = _cors_origin(request)
    if request.method != "OPTIONS" or origin is None:
        return None
    response = HttpResponse(status=204)
    response["Access-Control-Allow-Methods"] = ", ".join((*methods, "OPTIONS"))
    response["Access-Control-Allow-Headers"] = request.headers.get(
        "Access-Control-Request-Headers", "Authorization, Content-Type"
    )
    response["Access-Control-Max-Age"] = "600"
    return response


def _with_cors(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    origin = _cors_origin(request)
    if origin is not None:
        response["Access-Control-Allow-Origin"] = origin
        response["Access-Control-Expose-Headers"] = CORS_EXPOSED
        if origin != "*":
            response["Vary"] = "Origin"
    return response


def endpoint(*methods: str) -> Callable[..., Any]:
    def decorate(fn: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @csrf_exempt
        @wraps(fn)
        def view(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            return _with_cors(request, answer(request, *args, **kwargs))

        def answer(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            preflight = _preflight(request, methods)
            if preflight is not None:
                return preflight
            try:
                if request.method not in methods:
                    raise ApiError(
                        405,
                        f"method {request.method} not allowed",
                        headers={"Allow": ", ".join(methods)},
                    )
                try:
                    found = ApiKeyAuthentication().authenticate(request)  # type: ignore[arg-type]
                except AuthenticationFailed as exc:
                    raise ApiError(401, str(exc.detail), code="invalid_api_key") from exc
                if found is None:
                    raise ApiError(
                        401,
                        "You didn't provide an API key: send 'Authorization: Bearer otk_...'.",
                    )
                user, key = found
                caller = Caller(team_id=key.team_id, user=user, key=key)
                return fn(request, caller, *args, **kwargs)
            except ApiError as exc:
                return exc.response()

        return view

    return decorate


# Exempt, or Django's CSRF check answers a POST to an unknown path with its HTML 403 page
# before this view runs.
@csrf_exempt
def not_found(request: HttpRequest, rest: str = "") -> HttpResponse:
    return ApiError(404, f"unknown endpoint {request.method} {request.path}").response()


def _model_object(served: serving.Served) -> dict[str, Any]:
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": served.owned_by,
        "root": served.base.name,
    }


def _resolve(caller: Caller, name: str) -> serving.Served:
    if "\x00" in name:
        # Names are looked up in PostgreSQL, whose text holds no NUL: none has one.
        raise model_not_found(name)
    try:
        return serving.resolve(caller, name)
    except serving.UnknownModel as exc:
        raise model_not_found(name) from exc
    except serving.NotServable as exc:
        raise ApiError(400, str(exc), "model", "model_not_servable") from exc


def _listed(caller: Caller) -> list[serving.Served]:
    """``serving.list_models``, each job's ``job:<id>`` followed by the job's name where the
    name resolves to that same adapter: the newest job of that name with one (the listing is
    newest first), and not a base model's name."""
    listed = serving.list_models(caller)
    ids = [s.name.removeprefix(serving.JOB_PREFIX) for s in listed if _is_job_id(s.name)]
    names = {
        f"{serving.JOB_PREFIX}{pk}": name
        for pk, name in Job.objects.filter(team_id=caller.team_id, pk__in=ids).values_list(
            "pk", "name"
        )
    }
    out: list[serving.Served] = []
    seen: set[str] = set()
    for served in listed:
        out.append(served)
        name = names.get(served.name)
        if not name or name in seen:
            continue
        seen.add(name)
        try:
            found = serving.resolve(caller, name)
        except (serving.UnknownModel, serving.NotServable):
            continue
        if found.target == served.target:
            out.append(found)
    return out


def _is_job_id(name: str) -> bool:
    """``job:<id>``, not one of its checkpoints (``job:<id>:<checkpoint>``)."""
    return name.startswith(serving.JOB_PREFIX) and name.count(":") == 1


@endpoint("GET")
def models(request: HttpRequest, caller: Caller) -> HttpResponse:
    data = [_model_object(s) for s in _listed(caller)]
    return JsonResponse({"object": "list", "data": data})


@endpoint("GET")
def model(request: HttpRequest, caller: Caller, name: str) -> HttpResponse:
    return JsonResponse(_model_object(_resolve(caller, name)))


def _body(request: HttpRequest) -> bytes:
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes")
    return request.read(MAX_BODY_BYTES + 1)


def _error_of(event: dict[str, Any]) -> ApiError:
    status = int(event.get("status") or 500)
    code = event.get("code")
    message = str(event.get("message", "the request failed"))
    return ApiError(status, message, event.get("param"), code)


def _follow(request_id: str, served: serving.Served) -> Iterator[dict[str, Any] | None]:
    """The request's events as they come (``serving.follow``); None for each poll that
    brought nothing (a stream sends a keep-alive then)."""
    return serving.follow(
        request_id,
        served,
        poll_ms=POLL_MS,
        nudge_seconds=NUDGE_SECONDS,
        silence_seconds=SILENCE_SECONDS,
    )


def _relay(
    answer: Answer,
    first: dict[str, Any],
    rest: Iterator[dict[str, Any] | None],
    rid: str,
    release: Callable[[int], None],
) -> Iterator[bytes]:
    finished = False
    tokens = 0
    try:
        for chunk in answer.chunks(first):
            yield sse(chunk)
        for event in rest:
            if event is None:
                yield b": keep-alive\n\n"
                continue
            if event["t"] == "error":
                finished = True
                yield sse(_error_of(event).body())
                return
            # One write per event: its chunks (a choice's last text and its finish) together.
            out = b"".join(sse(chunk) for chunk in answer.chunks(event))
            if out:
                yield out
            if event["t"] == "done":
                finished = True
                tokens = _total_tokens(event.get("usage"))
                yield sse("[DONE]")
                return
    except REDIS_DOWN as exc:
        # The events come through Redis: without this the answer would stop mid-sentence
        # with no word, which a client cannot tell from a network fault.
        log.warning("answer %s cut short: Redis unreachable: %s", rid, exc)
        yield sse(
            ApiError(
                503,
                f"the service's Redis became unreachable mid-answer ({type(exc).__name__}); "
                "the answer is cut short: retry the request",
            ).body()
        )
    finally:
        try:
            # Closed before the end: the client went away (the server closes the iterator
            # when a write fails), so the worker must stop generating for it.
            if not finished:
                events.cancel(rid)
            events.discard(rid)
            release(tokens)
        except REDIS_DOWN as exc:
            # Nothing lingers: the events and the team's slot expire on their own, and the
            # worker ends an answer nobody reads at its max_tokens.
            log.warning("answer %s: could not release it, Redis unreachable: %s", rid, exc)


def _total_tokens(usage: Any) -> int:
    return int((usage or {}).get("total_tokens") or 0)


def _serve(request: HttpRequest, caller: Caller, kind: Kind) -> HttpResponse:
    body = _body(request)
    req: params.ChatRequest | params.CompletionRequest
    if kind == "chat":
        req, op = params.chat_op(body)
    else:
        req, op = params.completion_op(body)
    served = _resolve(caller, req.model)
    _check_prompt_size(served.base, op)
    _check_images(served.base, op)
    try:
        rid = serving.submit(caller, served, op, hold_seconds=HOLD_SECONDS)
    except serving.Busy as exc:
        raise ApiError(
            429,
            str(exc),
            code="rate_limit_exceeded",
            retry_after=exc.retry_after,
            headers=exc.headers,
        ) from exc
    except BudgetSpent as exc:
        # OpenAI's answer to a spent quota; retrying cannot help before the month turns.
        raise ApiError(
            429,
            str(exc),
            code="insufficient_quota",
            error_type="insufficient_quota",
            retry_after=exc.seconds_left,
            headers={"x-should-retry": "false"},
        ) from exc
    released = False

    def release(tokens: int = 0) -> None:
        # Once: the answer's end (with its usage) or its abandonment, whichever comes first.
        nonlocal released
        if not released:
            released = True
            serving.finish(caller, rid, tokens)

    handed_over = False
    try:
        response = _answer(req, op, kind, served, rid, release)
        handed_over = isinstance(response, StreamingHttpResponse)
        return response
    finally:
        if not handed_over:
            release()


def _check_images(base: Any, op: dict[str, Any]) -> None:
    """Images for a text-only base model are refused here, without a trip to its worker."""
    given = op.get("images")
    if given and images.geometry(base.resolved_path()) is None:
        where = given[0]["where"]
        raise ApiError(400, f"{where}: base model {base.name} takes no images", where)


def _check_prompt_size(base: Any, op: dict[str, Any]) -> None:
    """Refuse a prompt that cannot fit the base model's context before the model worker
    tokenizes it: a text longer than the context times the longest token's bytes is more
    tokens than the context holds, and tokenizing megabytes would stall every stream the
    worker serves. Finer cases are the worker's (it counts the tokens)."""
    context = int(base.max_context or 0)
    if not context:
        return
    longest = base.longest_token_bytes()

    def check_text(param: str, size: int) -> None:
        if longest and size > longest * context:
            raise ApiError(
                400,
                f"the {param} ({size} bytes of text) cannot fit {base.name}'s context of "
                f"{context} tokens (a token spells at most {longest} bytes)",
                param,
                "context_length_exceeded",
            )

    if op["mode"] == "chat":
        texts = (params.content_text(m.get("content") or "") for m in op["messages"])
        check_text("messages", sum(len(t.encode("utf-8", "surrogatepass")) for t in texts))
        return
    for p in op["prompts"]:
        if isinstance(p, str):
            check_text("prompt", len(p.encode("utf-8", "surrogatepass")))
        elif len(p) >= context:
            raise ApiError(
                400,
                f"the prompt ({len(p)} tokens) fills {base.name}'s context of {context}",
                "prompt",
                "context_length_exceeded",
            )


def _answer(
    req: params.ChatRequest | params.CompletionRequest,
    op: dict[str, Any],
    kind: Kind,
    served: serving.Served,
    rid: str,
    release: Callable[[int], None],
) -> HttpResponse:
    answer = Answer(
        kind,
        rid,
        req.model,
        op["n"] * len(op.get("prompts") or [None]),
        logprobs=bool(op["logprobs"]),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )
    stream = _follow(rid, served)
    first = next(e for e in stream if e is not None)
    if first["t"] == "error":
        events.discard(rid)
        raise _error_of(first)
    if req.stream:
        response = StreamingHttpResponse(
            _relay(answer, first, stream, rid, release), content_type="text/event-stream"
        )
        response["Cache-Control"] = "no-cache"
        # Proxies (nginx) would otherwise buffer the stream into one late answer.
        response["X-Accel-Buffering"] = "no"
        response["x-request-id"] = rid
        return response
    for event in stream:
        if event is None:
            continue
        if event["t"] == "error":
            events.discard(rid)
            raise _error_of(event)
        answer.absorb(event)
        if event["t"] == "done":
            break
    events.discard(rid)
    release(_total_tokens(answer.usage))
    response = JsonResponse(answer.body())
    # The openai client exposes it as `_request_id`: the id this server's logs know.
    response["x-request-id"] = rid
    return response


@endpoint("POST")
def chat_completions(request: HttpRequest, caller: Caller) -> HttpResponse:
    return _serve(request, caller, "chat")


@endpoint("POST")
def completions(request: HttpRequest, caller: Caller) -> HttpResponse:
    return _serve(request, caller, "completion")
