"""Fixtures for the live Tinker protocol tests: a base model on disk and SDK clients.

The base model is the project's tiny chat model when it has been built
(``scripts/build_tiny_model.py``); otherwise a small random Qwen2 model with a byte-level
tokenizer is saved to a temporary directory, so the protocol tests never depend on it.
Either way the directory is a real Hugging Face model the SDK's tokenizer helper loads
offline (``get_info`` names it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from training.model import DEFAULT_BASE_MODEL

BASE_NAME = "tiny-tinker"


@pytest.fixture(autouse=True)
def _close_sdk_clients() -> Iterator[None]:
    """Every SDK client a test opened is closed when the test ends. A client heartbeats its
    session from a thread of its own for as long as it lives; left open, it keeps calling the
    session-wide live server during later tests, which pytest-django refuses database access
    (a 500 on /api/v1/session_heartbeat in their logs)."""
    import weakref

    from tinker.lib.internal_client_holder import InternalClientHolder

    opened: weakref.WeakSet[Any] = weakref.WeakSet()
    init = InternalClientHolder.__init__

    def tracking_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        opened.add(self)

    InternalClientHolder.__init__ = tracking_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        InternalClientHolder.__init__ = init  # type: ignore[method-assign]
        for holder in list(opened):
            holder.close()


def _build_random_model(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    corpus = [f"{a}+{b}={a + b}. the quick brown fox {a * b}." for a in range(50) for b in range(9)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainer=trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def base_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = Path(DEFAULT_BASE_MODEL)
    if (built / "config.json").is_file() and (built / "tokenizer.json").is_file():
        return built
    return _build_random_model(tmp_path_factory.mktemp("tinker-base"))


@pytest.fixture
def tinker_base(transactional_db: None, base_model_dir: Path) -> Any:
    """The BaseModel registry row the SDK names (``base_model="tiny-tinker"``)."""
    from jobs.models import BaseModel

    row, _ = BaseModel.objects.update_or_create(
        name=BASE_NAME,
        defaults={"path": str(base_model_dir), "max_lora_rank": 64, "max_context": 512},
    )
    return row


@pytest.fixture
def tinker_data_dir(tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Checkpoints of this test go to a temporary directory, for the server and for the
    worker subprocesses started after it (they inherit the environment)."""
    path = tmp_path / "data"
    path.mkdir()
    settings.OPENTINKER_DATA_DIR = path
    monkeypatch.setenv("OPENTINKER_DATA_DIR", str(path))
    return path


def sdk_worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the SDK tests' worker subprocess inherits: no telemetry, one torch thread, short
    long polls, and a short idle time so that its model worker ends with the test."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("OPENTINKER_TINKER_WORKER_IDLE_SECONDS", "20")
    monkeypatch.setenv("OPENTINKER_TINKER_TORCH_THREADS", "1")
    monkeypatch.setenv("OPENTINKER_TINKER_LONG_POLL_SECONDS", "5")


@pytest.fixture
def worker_env() -> dict[str, str]:
    """Settings the worker of ``live_tinker`` starts with beyond ``sdk_worker_env``'s; a test
    module overrides this fixture to add its own."""
    return {}


@pytest.fixture
def live_tinker(
    live_server: Any,
    tinker_base: Any,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    tinker_data_dir: Path,
    worker_env: dict[str, str],
) -> str:
    """The live server's root URL (no trailing slash), with a real Celery worker serving the
    ``gpu`` queue, whose model worker serves the tiny base model (``BASE_NAME``)."""
    sdk_worker_env(monkeypatch)
    for name, value in worker_env.items():
        monkeypatch.setenv(name, value)
    start_worker()
    return str(live_server.url)


@pytest.fixture
def clean_tinker_keys(redis_client: Any) -> Iterator[None]:
    """No Tinker futures, streams or registrations left from another test, before or after."""
    from tinker_api import futures

    def clean() -> None:
        keys = list(redis_client.scan_iter(match=f"{futures.PREFIX}*", count=1000))
        if keys:
            redis_client.delete(*keys)

    clean()
    yield
    clean()
