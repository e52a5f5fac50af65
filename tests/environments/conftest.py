"""A tiny byte-level tokenizer with a ChatML chat template, built in memory (no files, no hub),
and a real env worker for the modules that step episodes through the `env` queue."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_chatml_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Every byte is one token (no merges): exact round trips for any text, a 259-token vocab.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return build_chatml_tokenizer()


@pytest.fixture(scope="session")
def renderer(chatml_tokenizer):
    from environments.renderer import Renderer

    return Renderer(chatml_tokenizer)


@pytest.fixture(scope="module")
def env_worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Celery worker on the `env` queue for one test module; yields its node name."""
    import redis

    from tests.fixtures.workers import env_worker_process

    redis.Redis.from_url(redis_url).delete("env")
    name = f"envtest-{uuid.uuid4().hex[:8]}"
    log_path = tmp_path_factory.mktemp("envworker") / "worker.log"
    with env_worker_process(redis_url, log_path, name):
        yield name
