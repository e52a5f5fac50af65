"""A tiny byte-level tokenizer with a ChatML chat template, built in memory (no files, no hub)."""

from __future__ import annotations

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
