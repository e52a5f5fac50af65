"""Logprobs as OpenAI's clients read them: ``echo`` scoring a prompt (lm-eval's loglikelihood
requests), entries that spell exactly the text they come with (no end-of-sequence token, no
piece of a cut stop string, the raw bytes of a partial UTF-8 character), and the legacy
completion form's offsets and alternatives. The model worker's ``ChatHandler`` runs on a real
engine and Redis; the answers are built by the view's own ``Answer``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.tinker_api.test_openai_worker import chat_op, drive, engine, events_of, handler
from tinker_api.serving.replies import Answer

__all__ = ["engine", "handler"]  # fixtures, imported for their use here


def sampled(op: Any, **params: Any) -> Any:
    """``op`` with more sampling parameters (``chat_op`` sets only its defaults' keys)."""
    op.fields["params"].update(params)
    return op


def answer(op: Any, kind: str = "completion", choices: int = 1) -> dict[str, Any]:
    built = Answer(kind, op.rid, "m", choices, logprobs=True)  # type: ignore[arg-type]
    for event in events_of(op):
        assert event["t"] != "error", event
        built.absorb(event)
    return built.body()


def reference_logprobs(engine: Any, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = engine.model(torch.tensor([tokens])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])
    return picked.squeeze(-1).tolist()


def test_echo_with_no_tokens_to_generate_scores_the_prompt(handler: Any, engine: Any) -> None:
    # lm-eval's local-completions loglikelihood request: context + continuation as token ids.
    tokens = engine.tokenizer.encode("12+30=42. the quick brown fox")
    scored = chat_op(
        mode="completion", prompts=[tokens, "1+1=2"], echo=True, max_tokens=0, logprobs=True
    )
    scored.fields["top_logprobs"] = 1
    drive(handler, [scored])
    body = answer(scored, choices=2)
    first, second = body["choices"]
    assert first["text"] == engine.tokenizer.decode(tokens) and second["text"] == "1+1=2"
    assert first["finish_reason"] == "length"
    lp = first["logprobs"]
    assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in tokens]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(reference_logprobs(engine, tokens), abs=1e-4)
    # The most likely token at each position, and the prompt's own token with it.
    for token, logprob, top in zip(
        lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]
    ):
        assert token in top and top[token] == logprob and max(top.values()) >= logprob
        assert 1 <= len(top) <= 2
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(tokens) + len(engine.tokenizer.encode("1+1=2"))


def test_echo_puts_the_prompt_before_what_it_generates(handler: Any, engine: Any) -> None:
    op = chat_op(
        mode="completion", prompts=["3+4="], echo=True, max_tokens=3, logprobs=True, ignore_eos=True
    )
    drive(handler, [op])
    (choice,) = answer(op)["choices"]
    prompt = engine.tokenizer.encode("3+4=")
    assert choice["text"].startswith("3+4=")
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3
    assert lp["token_logprobs"][0] is None and all(x is not None for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][len(prompt)] == len("3+4=")


SPECIAL: set[str] = set()


def spelled(entries: list[dict[str, Any]]) -> bytes:
    """The text the entries spell (special tokens, generated through ignore_eos, are none)."""
    return b"".join(bytes(e["bytes"]) for e in entries if e["token"] not in SPECIAL)


def test_chat_entries_spell_the_content_and_nothing_after_it(handler: Any, engine: Any) -> None:
    tok = engine.tokenizer
    SPECIAL.update(tok.all_special_tokens)
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    eos = eos if eos is not None else tok.eos_token_id
    # The first token is the end of the turn: no content, and no entry for it.
    ended = sampled(chat_op(logprobs=True, temperature=0.0), logit_bias={str(eos): 100.0})
    # Cut at a stop string: the entries of the tokens after the cut are not sent.
    free = chat_op(logprobs=True, temperature=0.0, max_tokens=12, ignore_eos=True)
    # The legacy form keeps the entry (lm-eval counts on one per generated token), with no
    # width in the text.
    legacy = sampled(
        chat_op(mode="completion", prompts=["1"], logprobs=True, temperature=0.0),
        logit_bias={str(eos): 100.0},
    )
    drive(handler, [ended, free, legacy])
    (choice,) = answer(ended, "chat")["choices"]
    assert choice["message"]["content"] == "" and choice["logprobs"]["content"] == []
    assert choice["finish_reason"] == "stop"
    (choice,) = answer(legacy)["choices"]
    assert choice["text"] == "" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == [tok.decode([eos])]
    assert choice["logprobs"]["text_offset"] == [0]
    (choice,) = answer(free, "chat")["choices"]
    text, tokens = choice["message"]["content"], [e["token"] for e in choice["logprobs"]["content"]]
    assert spelled(choice["logprobs"]["content"]).decode() == text
    # A stop string that starts at the third token's text, and one that starts inside it.
    at = len("".join(tokens[:2]))
    assert tokens[2] and text.find(tokens[2]) == at
    for stop, exact in ((tokens[2], True), (text[at + 1 : at + 3], len(tokens[2]) < 2)):
        cut = chat_op(logprobs=True, temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
        streamed = chat_op(
            logprobs=True, temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop], stream=True
        )
        drive(handler, [cut, streamed])
        for op in (cut, streamed):
            (choice,) = answer(op, "chat")["choices"]
            content, entries = choice["message"]["content"], choice["logprobs"]["content"]
            assert content == text[: text.index(stop)]
            # The fewest tokens that spell the content: all of it at a token's boundary; else
            # the last one reaches past the cut.
            assert spelled(entries).decode().startswith(content)
            assert len(spelled(entries[:-1]).decode()) < len(content) or not entries
            if exact:
                assert spelled(entries).decode() == content


def test_a_token_holding_part_of_a_character_carries_its_own_bytes(
    handler: Any, engine: Any
) -> None:
    tok = engine.tokenizer
    # "é" is two bytes, C3 A9: byte-level BPE spells them "Ã" and "©".
    first, second = tok.convert_tokens_to_ids(["Ã", "©"])
    op = sampled(
        chat_op(
            mode="completion",
            prompts=["1"],
            max_tokens=2,
            temperature=0.0,
            ignore_eos=True,
            logprobs=True,
        ),
        # The first step takes the larger bias, the second (after a penalty) the other.
        logit_bias={str(first): 100.0, str(second): 99.0},
        frequency_penalty=2.0,
    )
    drive(handler, [op])
    (choice,) = answer(op)["choices"]
    assert choice["text"] == "é"
    events = [e for e in events_of(op) if e["t"] == "end"]
    entries = events[0]["lp"]
    assert [e["bytes"] for e in entries] == [[0xC3], [0xA9]]
    assert spelled(entries).decode() == "é"


def test_the_legacy_form_counts_offsets_in_the_text_and_keeps_the_chosen_token() -> None:
    built = Answer("completion", "req-1", "m", 1, logprobs=True)
    entry = {"token": "a", "logprob": -3.0, "bytes": [97]}
    built.absorb({"t": "start", "prompt_tokens": 1})
    built.absorb(
        {
            "t": "end",
            "i": 0,
            "text": "ab",
            "finish_reason": "length",
            "lp": [
                {**entry, "top_logprobs": [{"token": "x", "logprob": -0.1, "bytes": [120]}]},
                # Generated through ignore_eos: not in the text, no width in it.
                {
                    "token": "<|im_end|>",
                    "logprob": -1.0,
                    "bytes": list(b"<|im_end|>"),
                    "top_logprobs": [],
                    "special": True,
                },
                {"token": "b", "logprob": -0.5, "bytes": [98], "top_logprobs": []},
            ],
        }
    )
    lp = built.body()["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, 1, 1]
    assert lp["top_logprobs"][0] == {"x": -0.1, "a": -3.0}
    chat = Answer("chat", "req-2", "m", 1, logprobs=True)
    chat.absorb(
        {
            "t": "end",
            "i": 0,
            "text": "",
            "finish_reason": "length",
            "lp": [
                {
                    "token": "<|im_end|>",
                    "logprob": -1.0,
                    "bytes": [60],
                    "top_logprobs": [],
                    "special": True,
                }
            ],
        }
    )
    assert chat.body()["choices"][0]["logprobs"]["content"][0].keys() == {
        "token",
        "logprob",
        "bytes",
        "top_logprobs",
    }
