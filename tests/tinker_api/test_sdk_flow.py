"""The SDK's public clients (ServiceClient, TrainingClient, SamplingClient) run a whole
train-and-sample flow against a stdlib HTTP server that speaks through ``tinker_api``.

The server's "engine" is arithmetic on the decoded tokens so results are checkable; what is
under test is the wire layer and the client behaviours the endpoints must honour: the setup
sequence, futures polled through 408 ``try_again``, protobuf results, chunked batches with
consecutive seq_ids, sequence ids from the ``/asample`` reply, the ``load_weights`` model id
convention and the session finish.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)

from tinker import types

from tinker_api import schemas as s
from tinker_api import wire

BASE_MODEL = "Qwen/Qwen3-0.6B"
# Each future answers "try again" this many times before its result.
PENDING_POLLS = 2


def fake_logprob(token: int) -> float:
    return -((token % 7) + 1) / 8


Answer = tuple[int, bytes, str]


def ok(model: s.ResponseModel) -> Answer:
    return 200, model.model_dump_json().encode(), wire.JSON


def created(reply: wire.Reply) -> Answer:
    return reply.status, reply.json(), wire.JSON


class ProtocolServer:
    """Just enough of the protocol for the flow below, built on tinker_api."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.futures: dict[str, tuple[int, Callable[[bool], tuple[int, bytes, str]]]] = {}
        self.calls: list[str] = []
        self.fwdbwd_seq_ids: list[int] = []
        self.seq_ids: dict[str, list[int | None]] = {}
        self.finished: dict[str, Any] | None = None
        self.counter = 0

    def new_future(self, result: Callable[[bool], tuple[int, bytes, str]]) -> str:
        with self.lock:
            self.counter += 1
            request_id = f"req-{self.counter}"
            self.futures[request_id] = (PENDING_POLLS, result)
        return request_id

    def json_result(self, model: s.ResponseModel) -> Callable[[bool], tuple[int, bytes, str]]:
        return lambda _proto: (200, model.model_dump_json().encode(), wire.JSON)

    def handle(self, path: str, headers: Any, body: bytes) -> tuple[int, bytes, str]:
        self.calls.append(path)
        if path == "/api/v1/client/config":
            s.ClientConfigRequest.model_validate_json(body)
            # Two datums per chunk, so a batch of five arrives as three requests.
            return ok(s.ClientConfigResponse(fwdbwd_max_chunk_len=2))
        if path == "/api/v1/create_session":
            s.CreateSessionRequest.model_validate_json(body)
            return ok(s.CreateSessionResponse(session_id="sess-1"))
        if path == "/api/v1/session_heartbeat":
            return ok(s.SessionHeartbeatResponse())
        if path == "/api/v1/telemetry":
            return ok(s.TelemetryResponse())
        if path == "/api/v1/create_model":
            req = s.CreateModelRequest.model_validate_json(body)
            model_id = wire.model_id_for(req.session_id, req.model_seq_id)
            rid = self.new_future(self.json_result(s.CreateModelResponse(model_id=model_id)))
            return created(wire.future_created(rid, model_id=model_id))
        if path == "/api/v1/get_info":
            req_info = s.GetInfoRequest.model_validate_json(body)
            return ok(
                s.GetInfoResponse(
                    model_id=req_info.model_id,
                    model_data=s.ModelData(model_name=BASE_MODEL),
                    is_lora=True,
                    lora_rank=8,
                )
            )
        if path == "/api/v1/forward_backward":
            batch = wire.decode_forward_backward(
                body,
                content_type=headers.get("Content-Type"),
                content_encoding=headers.get("Content-Encoding"),
            )
            with self.lock:
                self.fwdbwd_seq_ids.append(batch.seq_id)
            outputs = [
                {"logprobs": np.array([fake_logprob(t) for t in d.tokens], dtype=np.float32)}
                for d in batch.data
            ]
            loss = -sum(
                float((o["logprobs"] * d.loss_fn_inputs["weights"]).sum())
                for o, d in zip(outputs, batch.data, strict=True)
            )

            def fwdbwd_result(protobuf: bool) -> tuple[int, bytes, str]:
                enc = wire.encode_forward_backward_output(
                    outputs, {"loss:sum": loss}, protobuf=protobuf
                )
                return 200, enc.content, enc.content_type

            return created(wire.future_created(self.new_future(fwdbwd_result)))
        if path == "/api/v1/optim_step":
            req_optim = s.OptimStepRequest.model_validate_json(body)
            self.seq_ids.setdefault("optim_step", []).append(req_optim.seq_id)
            rid = self.new_future(self.json_result(s.OptimStepResponse(metrics={"lr:mean": 1.0})))
            return created(wire.future_created(rid))
        if path == "/api/v1/save_weights_for_sampler":
            req_save = s.SaveWeightsForSamplerRequest.model_validate_json(body)
            self.seq_ids.setdefault("save_weights_for_sampler", []).append(req_save.seq_id)
            result = s.SaveWeightsForSamplerResponse(
                sampling_session_id=f"samp-{req_save.sampling_session_seq_id}"
            )
            return created(wire.future_created(self.new_future(self.json_result(result))))
        if path == "/api/v1/load_weights":
            req_load = s.LoadWeightsRequest.model_validate_json(body)
            assert req_load.session_id is not None and req_load.model_seq_id is not None
            model_id = wire.model_id_for(req_load.session_id, req_load.model_seq_id)
            rid = self.new_future(self.json_result(s.LoadWeightsResponse(model_id=model_id)))
            return created(wire.future_created(rid, model_id=model_id))
        if path.startswith("/api/v1/samplers/"):
            sampler_id = path.rsplit("/", 1)[-1]
            return ok(s.GetSamplerResponse(sampler_id=sampler_id, base_model=BASE_MODEL))
        if path == "/api/v1/asample":
            assert headers.get("X-Tinker-Sampling-Backpressure") == "1"
            req_sample = s.SampleRequest.model_validate_json(body)
            prompt, _images = wire.sample_prompt(req_sample)
            n_new = req_sample.sampling_params.max_tokens or 1
            sequences = [
                wire.SampledSequenceOut(
                    tokens=[(prompt[-1] + i + j) % 50 for j in range(n_new)],
                    stop_reason="length",
                    logprobs=[-0.5] * n_new,
                )
                for i in range(req_sample.num_samples)
            ]
            prompt_lp = (
                [None] + [fake_logprob(t) for t in prompt[1:]]
                if req_sample.prompt_logprobs
                else None
            )

            def sample_result(protobuf: bool) -> tuple[int, bytes, str]:
                enc = wire.encode_sample_response(
                    sequences, protobuf=protobuf, prompt_logprobs=prompt_lp
                )
                return 200, enc.content, enc.content_type

            rid = self.new_future(sample_result)
            ids = [f"{rid}:{i}" for i in range(req_sample.num_samples)]
            return created(wire.future_created(rid, sample_sequence_ids=ids))
        if path == "/api/v1/retrieve_future":
            poll = s.FutureRetrieveRequest.model_validate_json(body)
            with self.lock:
                if poll.request_id not in self.futures:
                    reply = wire.expired(poll.request_id)
                    return reply.status, reply.json(), wire.JSON
                left, result = self.futures[poll.request_id]
                if left:
                    self.futures[poll.request_id] = (left - 1, result)
                    reply = wire.try_again(poll.request_id)
                    return reply.status, reply.json(), wire.JSON
            return result(wire.wants_protobuf(headers.get("Accept")))
        if path.startswith("/api/v1/sessions/") and path.endswith("/finish"):
            self.finished = s.SessionFinishRequest.model_validate_json(body).model_dump()
            return 200, b"{}", wire.JSON
        return 404, b'{"detail": "not found"}', wire.JSON


@pytest.fixture
def server() -> Iterator[tuple[ProtocolServer, str]]:
    protocol = ProtocolServer()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            try:
                status, content, ctype = protocol.handle(self.path, self.headers, body)
            except wire.WireError as exc:
                status, content, ctype = exc.status, json.dumps(exc.body()).encode(), wire.JSON
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, *args: object) -> None:
            return

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield protocol, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.timeout(120)
def test_it_serves_a_train_and_sample_flow_to_the_real_sdk(
    server: tuple[ProtocolServer, str],
) -> None:
    protocol, url = server
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([i, i + 1, i + 2]),
            loss_fn_inputs={"target_tokens": [i + 1, i + 2, i + 3], "weights": [1.0, -0.5, 2.0]},
        )
        for i in range(5)
    ]
    expected_logprobs = [[fake_logprob(t) for t in (i, i + 1, i + 2)] for i in range(5)]
    expected_loss = -sum(
        np.dot(lp, [1.0, -0.5, 2.0]) for lp in np.array(expected_logprobs, dtype=np.float32)
    )

    with tinker.ServiceClient(base_url=url, api_key="tml-test-key") as service:
        trainer = service.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
        assert trainer.model_id == "sess-1:train:0"
        fwdbwd = trainer.forward_backward(data, "cross_entropy")
        optim = trainer.optim_step(types.AdamParams(learning_rate=1e-4))
        result = fwdbwd.result(timeout=60)
        assert optim.result(timeout=60).metrics == {"lr:mean": 1.0}

        np.testing.assert_allclose(
            [o["logprobs"].tolist() for o in result.loss_fn_outputs], expected_logprobs
        )
        assert result.metrics["loss:sum"] == pytest.approx(float(expected_loss), rel=1e-6)
        # Five datums in chunks of two: three requests with consecutive seq_ids, the first
        # chunk sent last.
        assert sorted(protocol.fwdbwd_seq_ids) == [1, 2, 3]
        assert protocol.fwdbwd_seq_ids[-1] == 1
        assert protocol.seq_ids["optim_step"] == [4]

        sampler = trainer.save_weights_and_get_sampling_client().result(timeout=60)
        response = sampler.sample(
            types.ModelInput.from_ints([3, 4, 5]),
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=4),
            include_prompt_logprobs=True,
        ).result(timeout=60)
        assert protocol.seq_ids["save_weights_for_sampler"] == [5]
        first, second = response.sequences
        assert first.sequence_id.endswith(":0") and second.sequence_id.endswith(":1")
        assert first.tokens == [5, 6, 7, 8] and second.tokens == [6, 7, 8, 9]
        assert first.logprobs == [-0.5] * 4
        assert response.prompt_logprobs == [None, fake_logprob(4), fake_logprob(5)]

        restored = service.create_training_client_from_state(
            "tinker://sess-1:train:0/weights/step-1"
        ).result(timeout=60)
        assert restored.model_id == "sess-1:train:1"

    assert protocol.finished == {"reason": {"type": "success"}, "detail": None}
    assert protocol.calls[:3] == [
        "/api/v1/client/config",
        "/api/v1/client/dynamic_config",
        "/api/v1/create_session",
    ]
    assert protocol.calls.count("/api/v1/retrieve_future") >= PENDING_POLLS * 5
