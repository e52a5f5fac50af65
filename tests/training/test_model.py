"""Loading base models from local paths, and what the committed tiny chat model can do."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from training import data
from training.model import DEFAULT_BASE_MODEL, ModelNotFound, load_base, resolve_base_path
from training.sampler import generate
from training.types import SamplingParams

pytestmark = pytest.mark.skipif(
    not (Path(DEFAULT_BASE_MODEL) / "config.json").is_file(),
    reason="models/tiny-chat is not built (python scripts/build_tiny_model.py)",
)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(2)
    return load_base("tiny", device="cpu")


def _chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def test_it_loads_the_tiny_model_by_alias_and_relative_path(tiny, tmp_path, monkeypatch):
    model, _tokenizer = tiny
    assert model.config.model_type == "qwen2"
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    n_params = sum(p.numel() for p in model.parameters())
    assert 2_000_000 < n_params < 8_000_000
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
    monkeypatch.chdir(tmp_path)
    assert resolve_base_path("models/tiny-chat") == Path(DEFAULT_BASE_MODEL)
    assert resolve_base_path(None) == Path(DEFAULT_BASE_MODEL)


def test_it_loads_in_another_dtype(tiny):
    model, _ = load_base(DEFAULT_BASE_MODEL, device="cpu", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_it_refuses_missing_models_and_bad_dtypes(tmp_path):
    with pytest.raises(ModelNotFound, match="no directory"):
        load_base(tmp_path / "nothing-here")
    with pytest.raises(ModelNotFound, match=r"config\.json"):
        load_base(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_base("tiny", device="cpu", dtype="float8")


def test_it_ships_a_chatml_tokenizer_with_one_token_per_digit(tiny):
    _, tokenizer = tiny
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 37+48?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nWhat is 37+48?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert [t for t in tokenizer.tokenize("12345") if t] == ["1", "2", "3", "4", "5"]
    code = "```python\nprint(x * 3)\n```"
    assert tokenizer.decode(tokenizer.encode(code, add_special_tokens=False)) == code
    assert tokenizer.padding_side == "left"


def test_it_answers_some_but_not_all_heldout_additions(tiny):
    model, tokenizer = tiny
    problems = data.heldout_addition_problems(100)
    prompts = [_chat_prompt(tokenizer, p.question()) for p in problems]
    seqs = generate(model, tokenizer, prompts, SamplingParams(max_tokens=16, temperature=0.0))
    answers = [
        data.final_answer(tokenizer.decode(s.tokens, skip_special_tokens=True)) for s in seqs
    ]
    accuracy = sum(a == str(p.answer) for a, p in zip(answers, problems)) / len(problems)
    # Room for RL to improve, but enough right answers for a reward signal.
    assert 0.1 <= accuracy <= 0.6, accuracy
    formatted = sum(a is not None for a in answers) / len(answers)
    assert formatted >= 0.9
    assert sum(s.stop_reason == "stop" for s in seqs) >= 90


def test_it_knows_the_bandit_and_gomoku_answer_formats(tiny):
    model, tokenizer = tiny
    bandit = [_chat_prompt(tokenizer, data.bandit_prompt(5))] * 20
    seeded = SamplingParams(max_tokens=10, seed=0)
    seqs = generate(model, tokenizer, bandit, seeded, sample_indices=range(20))
    arms = [data.final_answer(tokenizer.decode(s.tokens, skip_special_tokens=True)) for s in seqs]
    assert sum(a in {"0", "1", "2", "3", "4"} for a in arms) >= 16
    board = [["." for _ in range(5)] for _ in range(5)]
    board[2][2] = "X"
    gomoku = [_chat_prompt(tokenizer, data.gomoku_prompt(board, "O"))] * 20
    seqs = generate(model, tokenizer, gomoku, seeded, sample_indices=range(20))
    moves = [data.final_answer(tokenizer.decode(s.tokens, skip_special_tokens=True)) for s in seqs]
    legal = 0
    for move in moves:
        try:
            r, c = (int(x) for x in (move or "").split(","))
        except ValueError:
            continue
        legal += 0 <= r < 5 and 0 <= c < 5 and board[r][c] == "."
    # Sampled at temperature 1 from a model that never learned to play: most moves are legal.
    assert legal >= 10


def test_it_parses_final_answers():
    assert data.final_answer("so \\boxed{12} or \\boxed{85}") == "85"
    assert data.final_answer("the sum is 85.") == "85"
    assert data.final_answer("no number") is None
    train, val, test = data.addition_split()
    assert not set(test) & set(train) and not set(val) & set(train)
    assert len(test) == data.TEST_SIZE
