"""The Tinker protocol's operations: the views call these, the model worker records through them.

Each mutating call checks ownership (another team's ids are unknown), validates what it can
at submission (bad input is a 400 the SDK shows at once), and queues the work for the model
worker of the model's base model through ``tinker_api.futures``. A resubmission of the same
protocol id (``model_id`` + ``seq_id``, ...) answers the future of the first one. Every write
of a Tinker row goes through a module of this package.
"""

from __future__ import annotations

from tinker_api.services.checkpoints import (
    delete_checkpoint,
    list_checkpoints,
    save_weights,
    save_weights_for_sampler,
    set_checkpoint_public,
    set_checkpoint_ttl,
    training_run,
)
from tinker_api.services.exports import download_file, external_weights_urls, save_weights_external
from tinker_api.services.lookups import (
    Caller,
    NotFound,
    Refused,
    get_checkpoint,
    get_model,
    get_sampling_session,
    written_checkpoint,
)
from tinker_api.services.polling import PollAnswer, retrieve
from tinker_api.services.queue import refuse_unparsed
from tinker_api.services.sampling import create_sampling_session, sample
from tinker_api.services.sessions import (
    create_session,
    finish_session,
    heartbeat,
    list_sessions,
    session_info,
)
from tinker_api.services.training import (
    create_model,
    forward_backward,
    get_info,
    load_weights,
    optim_step,
)

__all__ = [
    "Caller",
    "NotFound",
    "PollAnswer",
    "Refused",
    "create_model",
    "create_sampling_session",
    "create_session",
    "delete_checkpoint",
    "download_file",
    "external_weights_urls",
    "finish_session",
    "forward_backward",
    "get_checkpoint",
    "get_info",
    "get_model",
    "get_sampling_session",
    "heartbeat",
    "list_checkpoints",
    "list_sessions",
    "load_weights",
    "optim_step",
    "refuse_unparsed",
    "retrieve",
    "sample",
    "save_weights",
    "save_weights_external",
    "save_weights_for_sampler",
    "session_info",
    "set_checkpoint_public",
    "set_checkpoint_ttl",
    "training_run",
    "written_checkpoint",
]
