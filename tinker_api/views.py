"""HTTP endpoints of the Tinker protocol under ``/api/v1/`` (paths fixed by the SDK).

Plain Django views rather than DRF: bodies are protobuf as often as JSON, answers are validated
strictly by the SDK against its own types, and polls arrive many times a second (no
throttles, no content negotiation). Authentication is the API key store's
(``X-API-Key: tml-otk_...``), the same check DRF's ``ApiKeyAuthentication`` makes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from django.http import FileResponse, HttpRequest, HttpResponse
from django.urls import reverse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.exceptions import AuthenticationFailed

from accounts.authentication import ApiKeyAuthentication
from jobs.models import BaseModel
from tinker_api import schemas as s
from tinker_api import services, wire
from tinker_api.models import TrainingModel
from tinker_api.services import Caller, NotFound

# Largest body accepted before decompression (forward_backward chunks are ~5 MB).
MAX_BODY_BYTES = 64 * 1024 * 1024


def _json(status: int, body: dict[str, Any] | bytes) -> HttpResponse:
    content = body if isinstance(body, bytes) else wire.Reply(status, body).json()
    return HttpResponse(content, status=status, content_type=wire.JSON)


def _ok(model: s.ResponseModel) -> HttpResponse:
    return HttpResponse(model.model_dump_json().encode(), content_type=wire.JSON)


def _reply(reply: wire.Reply) -> HttpResponse:
    return _json(reply.status, reply.json())


def _body(request: HttpRequest) -> bytes:
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > MAX_BODY_BYTES:
        raise wire.WireError(f"body over {MAX_BODY_BYTES} bytes", status=413)
    # read(), not .body: DATA_UPLOAD_MAX_MEMORY_SIZE is for forms, not training batches.
    return request.read(MAX_BODY_BYTES + 1)


ModelT = TypeVar("ModelT", bound=s.RequestModel)


def _ordered_body(request: HttpRequest, caller: Caller, model: type[ModelT]) -> ModelT:
    """The body of a request that carries a model's seq_id. One that fails validation has
    spent its seq_id on the client all the same: recorded as refused, so the model's next
    request does not wait for it."""
    body = _body(request)
    try:
        return wire.parse_json(model, body)
    except wire.WireError as exc:
        services.refuse_unparsed(caller, wire.json_position(body), exc)
        raise


def endpoint(*methods: str, auth: bool = True) -> Callable[..., Any]:
    def decorate(fn: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @csrf_exempt
        @wraps(fn)
        def view(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method not in methods:
                refused = _json(405, {"detail": f"method {request.method} not allowed"})
                refused["Allow"] = ", ".join(methods)
                return refused
            caller = None
            if auth:
                try:
                    found = ApiKeyAuthentication().authenticate(request)  # type: ignore[arg-type]
                except AuthenticationFailed as exc:
                    return _json(401, {"detail": str(exc.detail)})
                if found is None:
                    return _json(401, {"detail": "send your API key in the X-API-Key header"})
                user, key = found
                caller = Caller(team_id=key.team_id, user=user, key=key)
            for name, value in kwargs.items():
                # Ids and names live in PostgreSQL, whose text holds no NUL: none has one,
                # and a query for one would fail.
                if "\x00" in value:
                    return _json(404, {"detail": f"unknown {name}: it holds a NUL character"})
            try:
                return fn(request, caller, *args, **kwargs)
            except wire.WireError as exc:
                return _json(exc.status, exc.body())
            except NotFound as exc:
                return _json(404, {"detail": str(exc)})

        return view

    return decorate


# --------------------------------------------------------------------------- setup


@endpoint("GET", auth=False)
def healthz(request: HttpRequest, caller: None) -> HttpResponse:
    return _ok(s.HealthResponse())


@endpoint("POST")
def client_config(request: HttpRequest, caller: Caller) -> HttpResponse:
    wire.parse_json(s.ClientConfigRequest, _body(request))
    return _ok(s.ClientConfigResponse())


@endpoint("POST")
def client_dynamic_config(request: HttpRequest, caller: Caller) -> HttpResponse:
    return _ok(s.ClientDynamicConfigResponse())


@endpoint("POST")
def telemetry(request: HttpRequest, caller: Caller) -> HttpResponse:
    return _ok(s.TelemetryResponse())


@endpoint("GET")
def server_capabilities(request: HttpRequest, caller: Caller) -> HttpResponse:
    models = [
        s.SupportedModel(
            model_name=m.name, max_context_length=m.max_context, trainable=True, sampleable=True
        )
        for m in BaseModel.objects.enabled().order_by("name")
    ]
    return _ok(s.GetServerCapabilitiesResponse(supported_models=models))


@endpoint("POST")
def create_session(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = wire.parse_json(s.CreateSessionRequest, _body(request))
    session = services.create_session(caller, req)
    return _ok(s.CreateSessionResponse(session_id=session.id))


@endpoint("POST")
def session_heartbeat(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = wire.parse_json(s.SessionHeartbeatRequest, _body(request))
    if not services.heartbeat(caller, req.session_id):
        return _json(410, {"detail": f"session {req.session_id} has finished"})
    return _ok(s.SessionHeartbeatResponse())


@endpoint("POST")
def session_finish(request: HttpRequest, caller: Caller, session_id: str) -> HttpResponse:
    req = wire.parse_json(s.SessionFinishRequest, _body(request))
    services.finish_session(caller, session_id, req)
    return _json(200, {"session_id": session_id})


# --------------------------------------------------------------------------- training


def _future(request_id: str, **extra: Any) -> HttpResponse:
    return _reply(wire.future_created(request_id, **extra))


@endpoint("POST")
def create_model(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = wire.parse_json(s.CreateModelRequest, _body(request))
    request_id, model_id = services.create_model(caller, req)
    return _future(request_id, model_id=model_id)


@endpoint("POST")
def get_info(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = wire.parse_json(s.GetInfoRequest, _body(request))
    return _ok(services.get_info(caller, req.model_id))


def _fwdbwd(request: HttpRequest, caller: Caller, forward_only: bool) -> HttpResponse:
    request_id = services.forward_backward(
        caller,
        _body(request),
        content_type=request.META.get("CONTENT_TYPE"),
        content_encoding=request.META.get("HTTP_CONTENT_ENCODING"),
        forward_only=forward_only,
    )
    return _future(request_id)


@endpoint("POST")
def forward_backward(request: HttpRequest, caller: Caller) -> HttpResponse:
    return _fwdbwd(request, caller, forward_only=False)


@endpoint("POST")
def forward(request: HttpRequest, caller: Caller) -> HttpResponse:
    return _fwdbwd(request, caller, forward_only=True)


@endpoint("POST")
def optim_step(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = _ordered_body(request, caller, s.OptimStepRequest)
    return _future(services.optim_step(caller, req))


@endpoint("POST")
def save_weights(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = _ordered_body(request, caller, s.SaveWeightsRequest)
    return _future(services.save_weights(caller, req))


@endpoint("POST")
def save_weights_for_sampler(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = _ordered_body(request, caller, s.SaveWeightsForSamplerRequest)
    return _future(services.save_weights_for_sampler(caller, req))


@endpoint("POST")
def save_weights_external(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = _ordered_body(request, caller, s.SaveWeightsExternalRequest)
    return _future(services.save_weights_external(caller, req))


@endpoint("POST")
def load_weights(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = _ordered_body(request, caller, s.LoadWeightsRequest)
    request_id, model_id = services.load_weights(caller, req)
    return _future(request_id, model_id=model_id)


# --------------------------------------------------------------------------- sampling


@endpoint("POST")
def create_sampling_session(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = wire.parse_json(s.CreateSamplingSessionRequest, _body(request))
    return _ok(
        s.CreateSamplingSessionResponse(
            sampling_session_id=services.create_sampling_session(caller, req)
        )
    )


@endpoint("GET")
def get_sampler(request: HttpRequest, caller: Caller, sampler_id: str) -> HttpResponse:
    row = services.get_sampling_session(caller, sampler_id)
    return _ok(
        s.GetSamplerResponse(
            sampler_id=row.id, base_model=row.base_model, model_path=row.model_path or None
        )
    )


@endpoint("POST")
def asample(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = wire.parse_json(s.SampleRequest, _body(request))
    backpressure = request.META.get("HTTP_X_TINKER_SAMPLING_BACKPRESSURE") == "1"
    request_id, sequence_ids = services.sample(caller, req, backpressure=backpressure)
    if request_id is None:
        return _reply(wire.sampling_backpressure())
    return _future(request_id, sample_sequence_ids=sequence_ids)


# --------------------------------------------------------------------------- futures


@endpoint("POST")
def retrieve_future(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = wire.parse_json(s.FutureRetrieveRequest, _body(request))
    answer = services.retrieve(
        caller, req.request_id, protobuf=wire.wants_protobuf(request.META.get("HTTP_ACCEPT"))
    )
    return HttpResponse(answer.body, status=answer.status, content_type=answer.content_type)


@endpoint("POST")
def cancel_future(request: HttpRequest, caller: Caller) -> HttpResponse:
    wire.parse_json(s.CancelFutureRequest, _body(request))
    return _json(200, {})


# --------------------------------------------------------------------------- runs and checkpoints


# Far past any list, and offset + limit still fits the databases' signed 64-bit OFFSET.
MAX_OFFSET = 2**62
# A larger limit is served as this one (PROTOCOL.md): the answer's cursor says so.
MAX_LIMIT = 1000


def _page(request: HttpRequest) -> tuple[int, int]:
    values = {}
    for name, default in (("limit", 20), ("offset", 0)):
        try:
            values[name] = int(request.GET.get(name, default))
        except ValueError:
            raise wire.WireError(f"{name} must be an integer") from None
    if values["limit"] < 1:
        raise wire.WireError(f"limit must be an integer of 1 or more (at most {MAX_LIMIT} served)")
    if not 0 <= values["offset"] <= MAX_OFFSET:
        raise wire.WireError(f"offset must be an integer between 0 and {MAX_OFFSET}")
    return min(values["limit"], MAX_LIMIT), values["offset"]


@endpoint("GET")
def training_runs(request: HttpRequest, caller: Caller) -> HttpResponse:
    limit, offset = _page(request)
    qs = TrainingModel.objects.for_team(caller.team_id).order_by("-created")
    rows = list(qs[offset : offset + limit])
    return _ok(
        s.TrainingRunsResponse(
            training_runs=[services.training_run(caller, m) for m in rows],
            cursor=s.Cursor(offset=offset, limit=limit, total_count=qs.count()),
        )
    )


@endpoint("GET")
def training_run(request: HttpRequest, caller: Caller, run_id: str) -> HttpResponse:
    return _ok(services.training_run(caller, services.get_model(caller, run_id)))


@endpoint("GET")
def run_checkpoints(request: HttpRequest, caller: Caller, run_id: str) -> HttpResponse:
    return _ok(s.CheckpointsListResponse(checkpoints=services.list_checkpoints(caller, run_id)))


@endpoint("GET")
def all_checkpoints(request: HttpRequest, caller: Caller) -> HttpResponse:
    limit, offset = _page(request)
    items = services.list_checkpoints(caller, None)
    return _ok(
        s.CheckpointsListResponse(
            checkpoints=items[offset : offset + limit],
            cursor=s.Cursor(offset=offset, limit=limit, total_count=len(items)),
        )
    )


@endpoint("DELETE")
def checkpoint(
    request: HttpRequest, caller: Caller, run_id: str, segment: str, name: str
) -> HttpResponse:
    services.delete_checkpoint(caller, run_id, segment, name)
    return HttpResponse(status=204)


@endpoint("PUT", "POST")
def checkpoint_ttl(
    request: HttpRequest, caller: Caller, run_id: str, segment: str, name: str
) -> HttpResponse:
    req = wire.parse_json(s.CheckpointTtlRequest, _body(request) or b"{}")
    services.set_checkpoint_ttl(caller, run_id, segment, name, req.ttl_seconds)
    return _json(200, {})


@endpoint("POST")
def weights_info(request: HttpRequest, caller: Caller) -> HttpResponse:
    req = wire.parse_json(s.WeightsInfoRequest, _body(request))
    ckpt = services.written_checkpoint(caller, req.tinker_path)
    m = ckpt.model
    return _ok(
        s.WeightsInfoResponse(
            base_model=m.base_model,
            optimizer_config=s.OptimizerConfig.model_validate(m.optimizer_config or {}),
            is_lora=True,
            lora_rank=m.lora_rank,
            train_unembed=m.train_unembed,
            train_mlp=m.train_mlp,
            train_attn=m.train_attn,
        )
    )


@endpoint("GET")
def external_weights_urls(
    request: HttpRequest, caller: Caller, run_id: str, segment: str, name: str
) -> HttpResponse:
    def url_for(token: str, file: str) -> str:
        return request.build_absolute_uri(
            reverse("tinker:external-file", kwargs={"token": token, "file": file})
        )

    return _ok(services.external_weights_urls(caller, run_id, segment, name, url_for=url_for))


@endpoint("GET", auth=False)
def external_file(request: HttpRequest, caller: None, token: str, file: str) -> HttpResponse:
    """A file of an export, for whoever holds its signed link (the cookbook fetches these
    with ``urllib``, without the API key)."""
    path = services.download_file(token, file)
    return FileResponse(path.open("rb"), as_attachment=True, filename=file)


@endpoint("POST", "DELETE")
def checkpoint_publish(
    request: HttpRequest, caller: Caller, run_id: str, segment: str, name: str
) -> HttpResponse:
    services.set_checkpoint_public(caller, run_id, segment, name, request.method == "POST")
    return HttpResponse(status=204)


# --------------------------------------------------------------------------- sessions


@endpoint("GET")
def sessions(request: HttpRequest, caller: Caller) -> HttpResponse:
    limit, offset = _page(request)
    return _ok(s.ListSessionsResponse(sessions=services.list_sessions(caller, limit, offset)))


@endpoint("GET")
def session(request: HttpRequest, caller: Caller, session_id: str) -> HttpResponse:
    return _ok(services.session_info(caller, session_id))


# --------------------------------------------------------------------------- the rest


def not_supported(feature: str) -> Callable[..., HttpResponse]:
    """An SDK endpoint this server does not offer: a JSON 404 that says so, never a page
    (the SDK raises ``NotFoundError`` with the detail)."""

    @csrf_exempt
    def view(request: HttpRequest, **_ids: str) -> HttpResponse:
        where = f"{request.method} {request.path}"
        return _json(404, {"detail": f"{where}: {feature} is not supported by this server"})

    return view


@csrf_exempt
def unknown(request: HttpRequest, rest: str) -> HttpResponse:
    """Any other path under the Tinker prefix (the REST API's routes, included first and
    without trailing slashes, never get here)."""
    return _json(404, {"detail": f"no endpoint {request.method} {request.path}"})
