"""Pydantic models of the JSON bodies of the Tinker endpoints (tinker SDK 0.38).

Requests are parsed with ``extra="ignore"``: a patch release of the SDK may add a field and
must not break every call; fields whose absence changes meaning are declared here. Responses
carry every field the SDK requires (it validates them strictly) and ignore nothing it reads.
Field names and defaults follow ``tinker/types/*.py``; PROTOCOL.md says which endpoint uses
which model.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tinker_api.schema_limits import Name, Tags, TtlSeconds, UserMetadata


class RequestModel(BaseModel):
    # protected_namespaces=(): the protocol has fields named model_id / model_seq_id.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# --------------------------------------------------------------------------- shared pieces

# Integer ids of the protocol (seq_id, model_seq_id, sampling_session_seq_id) end up in Redis
# keys, stream fields and database columns that hold a signed 64-bit integer; the SDK's
# largest (a cloned sampler's seq_ids, below 10**18) fit.
MAX_ID = 2**63 - 1
Id = Annotated[int, Field(ge=0, le=MAX_ID)]
# Seeds reach torch's generators and a BigIntegerField: signed 64-bit as well.
Seed = Annotated[int, Field(ge=-(2**63), le=MAX_ID)]

# What one request may ask a model worker to hold. Every sample of every queued request runs
# in one decode batch of the shared worker, so one request must not be able to exhaust
# it: the caps sit well above what the SDK and the cookbook send (RL groups of at most 32,
# top-k of 20, the SDK's forward/backward chunks of at most 1024 datums and 5 MB) and far
# below what takes a worker down. PROTOCOL.md lists them.
MAX_NUM_SAMPLES = 128
# Above every real vocabulary (the largest are 256k); the base model's own vocabulary
# bounds top-k again at submission.
MAX_TOPK_LOGPROBS = 1 << 18
MAX_PROMPT_ALT_TOKENS_K = 1024
MAX_CHUNKS = 4096
MAX_DATUMS = 4096

TensorDtype = Literal["float32", "int64"]
QueueState = Literal["active", "paused_capacity", "paused_rate_limit"]
ErrorCategory = Literal["unknown", "server", "user"]
StopReason = Literal["stop", "length"]


class TensorDataJson(BaseModel):
    """``TensorData`` as JSON: flat ``data``, optional ``shape``, optional sparse CSR."""

    model_config = ConfigDict(extra="forbid")

    data: list[float | int | None]
    dtype: TensorDtype
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class EncodedTextChunkJson(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int]


class ImageChunkJson(BaseModel):
    """``ImageChunk``: the image's bytes (base64 in JSON) and its advisory token count."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image"] = "image"
    data: str
    format: str
    expected_tokens: int | None = None


class ImageAssetPointerChunkJson(BaseModel):
    """``ImageAssetPointerChunk``: where the image is (a data URI, or a file under the
    server's ``OPENTINKER_IMAGE_ASSET_ROOTS``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image_asset_pointer"] = "image_asset_pointer"
    format: str
    location: str
    expected_tokens: int | None = None


class DmelChunkJson(BaseModel):
    """Audio chunks: parsed only to be refused with a clear error."""

    model_config = ConfigDict(extra="allow")

    type: Literal["dmel"]


ChunkJson = Annotated[
    EncodedTextChunkJson | ImageChunkJson | ImageAssetPointerChunkJson | DmelChunkJson,
    Field(discriminator="type"),
]


class ModelInputJson(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunks: list[ChunkJson] = Field(max_length=MAX_CHUNKS)


class DatumJson(RequestModel):
    model_input: ModelInputJson
    loss_fn_inputs: dict[str, TensorDataJson] = Field(default_factory=dict)


class ForwardBackwardInputJson(RequestModel):
    data: list[DatumJson] = Field(max_length=MAX_DATUMS)
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None


class ForwardBackwardRequestJson(RequestModel):
    """The JSON body of ``/forward_backward`` and ``/forward`` sent by SDKs before the
    protobuf path (0.38 always sends protobuf; curl and older clients send this)."""

    forward_backward_input: ForwardBackwardInputJson
    model_id: str
    seq_id: Id | None = None
    forward_only: bool = False


# --------------------------------------------------------------------------- requests


class ClientConfigRequest(RequestModel):
    sdk_version: str


class CreateSessionRequest(RequestModel):
    tags: Tags = Field(default_factory=list)
    user_metadata: UserMetadata | None = None
    sdk_version: str
    project_id: Name | None = None
    display_name: Name | None = None


class SessionHeartbeatRequest(RequestModel):
    session_id: str


class FinishReason(RequestModel):
    type: Literal["success", "errored", "interrupted"]


class SessionFinishRequest(RequestModel):
    """``POST /sessions/{id}/finish``; the first reason wins."""

    reason: FinishReason
    detail: str | None = None


class LoraConfig(RequestModel):
    rank: int = Field(ge=1)
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(BaseModel):
    """Optimizer family fixed at model creation; ``adamw`` unless the client picks another."""

    model_config = ConfigDict(extra="allow")

    type: str = "adamw"


class CreateModelRequest(RequestModel):
    session_id: str
    model_seq_id: Id
    base_model: str
    user_metadata: UserMetadata | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)


class GetInfoRequest(RequestModel):
    model_id: str


class AdamParams(RequestModel):
    # A NaN or infinite hyperparameter would turn every weight into NaN at the step. The
    # bounds are the engine's (training.types.AdamParams): a 400 now, not a failed future.
    model_config = ConfigDict(allow_inf_nan=False)

    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = 0.0


class OptimStepRequest(RequestModel):
    """The SDK sends ``adam_params`` for Adam and ``optimizer_params`` (with a ``type``) for
    any other family; exactly one is present."""

    model_id: str
    seq_id: Id | None = None
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_params(self) -> OptimStepRequest:
        if (self.adam_params is None) == (self.optimizer_params is None):
            raise ValueError("send exactly one of adam_params or optimizer_params")
        return self


class SaveWeightsRequest(RequestModel):
    model_id: str
    path: str | None = None
    seq_id: Id | None = None
    ttl_seconds: TtlSeconds | None = None
    overwrite: bool = False
    user_metadata: UserMetadata | None = None


class SaveWeightsExternalRequest(RequestModel):
    model_id: str
    path: str
    seq_id: Id | None = None
    ttl_seconds: TtlSeconds | None = None
    # age (X25519) public keys: every exported file is encrypted to all of them.
    age_encryption_recipients: list[str] | None = None


class SaveWeightsForSamplerRequest(RequestModel):
    """Named (``path`` set) -> a ``tinker://.../sampler_weights/<name>`` path; unnamed
    (``sampling_session_seq_id`` set) -> a new sampling session id."""

    model_id: str
    path: str | None = None
    sampling_session_seq_id: Id | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: Id | None = None
    ttl_seconds: TtlSeconds | None = None
    user_metadata: UserMetadata | None = None

    @model_validator(mode="after")
    def _named_or_session(self) -> SaveWeightsForSamplerRequest:
        if (self.path is None) == (self.sampling_session_seq_id is None):
            raise ValueError("send exactly one of path or sampling_session_seq_id")
        return self


class LoadWeightsRequest(RequestModel):
    """Two addressings: ``model_id`` + ``seq_id`` (load into an existing model, deprecated
    ``TrainingClient.load_state``) or ``session_id`` + ``model_seq_id`` (create the model
    from the checkpoint; its id is ``"{session_id}:train:{model_seq_id}"``)."""

    model_id: str | None = None
    seq_id: Id | None = None
    session_id: str | None = None
    model_seq_id: Id | None = None
    base_model: str | None = None
    user_metadata: UserMetadata | None = None
    path: str
    optimizer: bool
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None

    @model_validator(mode="after")
    def _one_addressing(self) -> LoadWeightsRequest:
        legacy = self.model_id is not None
        create = self.session_id is not None
        if legacy == create:
            raise ValueError("send either model_id (with seq_id) or session_id (with model_seq_id)")
        if create and self.model_seq_id is None:
            raise ValueError("model_seq_id is required with session_id")
        return self

    @property
    def creates_model(self) -> bool:
        return self.session_id is not None


class CreateSamplingSessionRequest(RequestModel):
    session_id: str
    sampling_session_seq_id: Id
    base_model: str | None = None
    model_path: str | None = None

    @model_validator(mode="after")
    def _model_named(self) -> CreateSamplingSessionRequest:
        if self.base_model is None and self.model_path is None:
            raise ValueError("send base_model or model_path")
        return self


class SamplingParams(RequestModel):
    max_tokens: int | None = Field(None, ge=0)
    seed: Seed | None = None
    # None keeps EOS stopping; [] disables every stop, EOS included.
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    # -1 (or 0) keeps every token; a k past the vocabulary keeps every token too.
    top_k: int = Field(-1, ge=-1, le=2**31 - 1)
    top_p: float = Field(1.0, gt=0, le=1)


class SampleRequest(RequestModel):
    """``POST /asample``. ``prompt_logprobs`` asks for one logprob per prompt token (None at
    position 0); ``topk_*`` ask for top-k lists; ``target_prompt_logprobs`` names token ids
    to score per prompt position; ``prompt_alt_tokens_k`` asks for draws per prompt position.
    The SDK checks that what it asked for came back, so nothing here may be dropped."""

    num_samples: int = Field(1, ge=1, le=MAX_NUM_SAMPLES)
    prompt: ModelInputJson
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: Id | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(0, ge=0, le=MAX_TOPK_LOGPROBS)
    topk_sample_logprobs: int = Field(0, ge=0, le=MAX_TOPK_LOGPROBS)
    target_prompt_logprobs: TensorDataJson | None = None
    prompt_alt_tokens_k: int = Field(0, ge=0, le=MAX_PROMPT_ALT_TOKENS_K)
    prompt_logprobs_last_n: int | None = Field(None, ge=1)
    record_stability_info: bool | None = None


class FutureRetrieveRequest(RequestModel):
    request_id: str
    # The server may answer {"status": "complete_metadata", ...} when this is set; it is
    # never required to.
    allow_metadata_only: bool = False


class CancelFutureRequest(RequestModel):
    request_id: str


class WeightsInfoRequest(RequestModel):
    tinker_path: str


class CheckpointTtlRequest(RequestModel):
    ttl_seconds: TtlSeconds | None = None


# --------------------------------------------------------------------------- responses


class ClientConfigResponse(ResponseModel):
    """Feature flags for ``POST /client/config``. The defaults keep the 0.38 client on the
    paths this server implements: plain httpx, one ``retrieve_future`` poll per request,
    custom losses run client-side, no JWT exchange, no sampling-session join."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    use_pyqwest_transport: bool = False
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False
    proto_compress_fwdbwd: bool = True
    parallel_fwdbwd_chunks: bool = True
    fwdbwd_max_chunk_len: int = 1024
    fwdbwd_max_chunk_bytes_count: int = 5_000_000
    sample_max_concurrent_requests: int = 2000


class ClientDynamicConfigResponse(ResponseModel):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False
    sample_cancel_max_batch_size: int = 64


class CreateSessionResponse(ResponseModel):
    type: Literal["create_session"] = "create_session"
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatResponse(ResponseModel):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class UntypedAPIFuture(ResponseModel):
    """What every future-returning call answers at once. ``sample_sequence_ids`` is required
    on ``/asample`` (one per requested sample): the SDK stamps them on the sequences."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class CreateModelResponse(ResponseModel):
    type: Literal["create_model"] = "create_model"
    model_id: str


class ModelData(ResponseModel):
    arch: str | None = None
    # The cookbook loads a tokenizer from model_name (AutoTokenizer, text before ":"), unless
    # tokenizer_id is given.
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(ResponseModel):
    type: Literal["get_info"] = "get_info"
    model_id: str
    model_data: ModelData
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None


class OptimStepResponse(ResponseModel):
    metrics: dict[str, float] | None = None


class SaveWeightsResponse(ResponseModel):
    type: Literal["save_weights"] = "save_weights"
    path: str


class SaveWeightsForSamplerResponse(ResponseModel):
    """Named saves fill ``path``; unnamed saves fill ``sampling_session_id``."""

    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"
    path: str | None = None
    sampling_session_id: str | None = None


class LoadWeightsResponse(ResponseModel):
    type: Literal["load_weights"] = "load_weights"
    path: str | None = None
    model_id: str | None = None


class CreateSamplingSessionResponse(ResponseModel):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class GetSamplerResponse(ResponseModel):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class SupportedModel(ResponseModel):
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None


class GetServerCapabilitiesResponse(ResponseModel):
    supported_models: list[SupportedModel]


class HealthResponse(ResponseModel):
    status: Literal["ok"] = "ok"


class TelemetryResponse(ResponseModel):
    status: Literal["accepted"] = "accepted"


class TryAgainResponse(ResponseModel):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: QueueState = "active"
    queue_state_reason: str | None = None


class RequestFailedResponse(ResponseModel):
    error: str
    category: ErrorCategory


class Checkpoint(ResponseModel):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class Cursor(ResponseModel):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(ResponseModel):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(ResponseModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(ResponseModel):
    training_runs: list[TrainingRun]
    cursor: Cursor


class ExternalWeightsUrlsResponse(ResponseModel):
    urls: dict[str, str]
    expires: datetime


class ListSessionsResponse(ResponseModel):
    sessions: list[str]


class GetSessionResponse(ResponseModel):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class WeightsInfoResponse(ResponseModel):
    base_model: str
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


# JSON forms of the two protobuf results, for clients that do not send
# ``Accept: application/x-protobuf`` (the 0.38 SDK always does and refuses JSON for these).


class ForwardBackwardOutputJson(ResponseModel):
    loss_fn_output_type: str = "ArrayRecord"
    loss_fn_outputs: list[dict[str, TensorDataJson]]
    metrics: dict[str, float | None] = Field(default_factory=dict)


class SampledSequenceJson(ResponseModel):
    stop_reason: StopReason
    tokens: list[int]
    logprobs: list[float] | None = None
    sequence_id: str | None = None
    topk_logprobs: list[list[tuple[int, float]] | None] | None = None


class PromptAltTokensJson(ResponseModel):
    tokens: TensorDataJson
    logprobs: TensorDataJson


class SampleResponseJson(ResponseModel):
    type: Literal["sample"] = "sample"
    sequences: list[SampledSequenceJson]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    target_prompt_logprobs: TensorDataJson | None = None
    prompt_alt_tokens: PromptAltTokensJson | None = None


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN: undefined values travel as null."""
    return value if math.isfinite(value) else None
