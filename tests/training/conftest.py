"""Shared training fixtures: a tiny random Qwen2 model and a byte-level tokenizer, built in memory.

They need no files and no network, so unit tests of the engine run in seconds. The model is
rebuilt from a fixed seed for every test (hosts and policies mutate it); the tokenizer is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(2)

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
_CORPUS = [
    f"{a}+{b}={a + b}. The quick brown fox jumps over the lazy dog {a * b}."
    for a in range(0, 100, 7)
    for b in range(0, 100, 11)
]


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
    )


def build_tiny_model(
    vocab_size: int,
    seed: int = 0,
    *,
    architecture: tuple[type, type] = (Qwen2Config, Qwen2ForCausalLM),
    **overrides: Any,
) -> Any:
    """A small random model; `architecture` is (config class, model class), e.g. Llama's."""
    config_class, model_class = architecture
    settings = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config = config_class(**{**settings, **overrides})
    torch.manual_seed(seed)
    model = model_class(config)
    # Random init is too close to uniform for adapters to matter; widen it a little.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    return build_tiny_model(len(tiny_tokenizer))


@pytest.fixture
def tiny_model_factory(
    tiny_tokenizer: PreTrainedTokenizerFast,
) -> Callable[[int], Qwen2ForCausalLM]:
    """Build more identical (same seed) or different (other seed) tiny models."""
    return lambda seed=0: build_tiny_model(len(tiny_tokenizer), seed)


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: PreTrainedTokenizerFast
) -> Path:
    """The tiny model and tokenizer saved in Hugging Face format (for path-based loading)."""
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(len(tiny_tokenizer)).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path
