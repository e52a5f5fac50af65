"""Continuous batching: rows that join a running batch, or leave it, change nobody's tokens.

Every test runs on both decoders: the fused one (Qwen2 and Llama) and the model's own forward
with a Hugging Face cache (any other model), whose tokens the engine's sampler matches.
"""

from __future__ import annotations

import pytest
import torch

from training.continuous import ContinuousBatch, Row
from training.decoder import HFDecoder
from training.engine import Engine
from training.kv_cache import TRIM_MIN_COLUMNS
from training.sampler import generate
from training.types import SamplingParams

PROMPTS = [[5, 17, 40, 41, 99], [8, 120], [33, 34, 35, 36, 37, 38, 39, 60, 61], [250]]


@pytest.fixture(autouse=True, params=["fused", "hf"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "hf":
        monkeypatch.setattr(
            "training.continuous.decoder_for", lambda model, host=None: HFDecoder(model, host)
        )
    return str(request.param)


def _run(batch: ContinuousBatch, joins: dict[int, list[Row]]) -> dict[int, list[int]]:
    """Step until the batch is empty, adding ``joins[k]`` before step k; tokens per row id."""
    got: dict[int, list[int]] = {}
    step = 0
    while len(batch) or any(k >= step for k in joins):
        for row in batch.add(joins.get(step, [])):
            got[row] = []
        for token in batch.step():
            got[token.row].append(token.token)
        step += 1
    return got


def _alone(model, tokenizer, row: Row) -> list[int]:
    (seq,) = generate(
        model,
        tokenizer,
        [row.prompt],
        row.params,
        sample_indices=[row.sample_index],
        stop_on_eos=row.stop_on_eos,
    )
    return seq.tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_it_gives_rows_joining_mid_decode_the_tokens_they_get_alone(
    tiny_model, tiny_tokenizer, temperature
):
    rows = [
        Row(p, SamplingParams(max_tokens=m, temperature=temperature, seed=s), stop_on_eos=False)
        for p, m, s in zip(PROMPTS, [12, 5, 9, 14], [1, 2, 3, 4], strict=True)
    ]
    batch = ContinuousBatch(tiny_model, tiny_tokenizer)
    assert batch.can_join
    # Joined at the start, after 3 steps (a longer prompt than any cached row), and after
    # 7 steps (a one-token prompt, shorter than the cache).
    got = _run(batch, {0: rows[:2], 3: [rows[2]], 7: [rows[3]]})
    for ident, row in enumerate(rows):
        assert got[ident] == _alone(tiny_model, tiny_tokenizer, row), ident


def test_it_matches_generate_for_n_samples_of_one_prompt(tiny_model, tiny_tokenizer):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9)
    rows = [Row(PROMPTS[0], params, sample_index=j, stop_on_eos=False) for j in range(3)]
    seqs = generate(
        tiny_model,
        tiny_tokenizer,
        [PROMPTS[0]] * 3,
        params,
        sample_indices=[0, 1, 2],
        stop_on_eos=False,
    )
    got = _run(ContinuousBatch(tiny_model, tiny_tokenizer), {0: rows})
    assert [got[i] for i in range(3)] == [s.tokens for s in seqs]
    assert len({tuple(t) for t in got.values()}) == 3


def test_it_drops_rows_without_changing_the_others(tiny_model, tiny_tokenizer):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5)
    rows = [Row(p, params, stop_on_eos=False) for p in PROMPTS[:3]]
    batch = ContinuousBatch(tiny_model, tiny_tokenizer)
    ids = batch.add(rows)
    got: dict[int, list[int]] = {i: [] for i in ids}
    for step in range(10):
        if step == 4:
            batch.drop({ids[1]})
        for token in batch.step():
            got[token.row].append(token.token)
    assert len(batch) == 0
    assert len(got[ids[1]]) == 4
    for i in (0, 2):
        assert got[ids[i]] == _alone(tiny_model, tiny_tokenizer, rows[i])


def test_it_stops_rows_and_routes_each_to_its_adapter(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tokenizer=tiny_tokenizer)
    policy = engine.create_policy(rank=4, alpha=8, seed=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, b in policy.lora_weights.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    key = policy.adapter_key
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    base_alone = _alone(tiny_model, tiny_tokenizer, Row(PROMPTS[0], greedy, stop_on_eos=False))
    (tuned,) = generate(
        engine.model,
        tiny_tokenizer,
        [PROMPTS[0]],
        greedy,
        adapters=[key],
        host=engine.host,
        stop_on_eos=False,
    )
    assert tuned.tokens != base_alone
    stop_at = tuned.tokens[3]
    batch = ContinuousBatch(engine.model, tiny_tokenizer, engine.host)
    got = _run(
        batch,
        {
            0: [Row(PROMPTS[0], greedy, stop_on_eos=False)],
            2: [
                Row(PROMPTS[0], greedy, adapter=key, stop_on_eos=False),
                Row(
                    PROMPTS[0],
                    SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_at,)),
                    adapter=key,
                    stop_on_eos=False,
                    topk=2,
                ),
            ],
        },
    )
    assert got[0] == base_alone
    assert got[1] == tuned.tokens
    assert got[2] == tuned.tokens[: tuned.tokens.index(stop_at) + 1]


def test_a_rows_last_token_says_whether_a_stop_ended_it_as_generate_does(
    tiny_model, tiny_tokenizer
):
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    alone = _alone(tiny_model, tiny_tokenizer, Row(PROMPTS[0], greedy, stop_on_eos=False))
    stop_id = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(alone[2],))
    # A stop id drawn at the last position max_tokens allows is a stop all the same.
    stop_at_limit = SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=(alone[2],))
    rows = [Row(PROMPTS[0], p, stop_on_eos=False) for p in (greedy, stop_id, stop_at_limit)]
    batch = ContinuousBatch(tiny_model, tiny_tokenizer)
    batch.add(rows)
    stopped: dict[int, bool] = {}
    while len(batch):
        stopped.update((t.row, t.stopped) for t in batch.step() if t.finished)
    assert stopped == {0: False, 1: True, 2: True}
    for i, row in enumerate(rows):
        (seq,) = generate(tiny_model, tiny_tokenizer, [row.prompt], row.params, stop_on_eos=False)
        assert stopped[i] == (seq.stop_reason == "stop")


def test_it_refuses_rows_that_cannot_run(tiny_model, tiny_tokenizer):
    batch = ContinuousBatch(tiny_model, tiny_tokenizer)
    with pytest.raises(ValueError, match="vocabulary"):
        batch.check(Row([10**6], SamplingParams()))
    with pytest.raises(ValueError, match="empty"):
        batch.check(Row([], SamplingParams()))


def test_penalised_rows_joining_mid_decode_get_what_they_get_alone(tiny_model, tiny_tokenizer):
    rows = [
        Row(PROMPTS[0], SamplingParams(max_tokens=10, temperature=1.0, seed=1), stop_on_eos=False),
        Row(
            PROMPTS[1],
            SamplingParams(
                max_tokens=8, temperature=0.0, frequency_penalty=1.0, logit_bias={"11": 2.0}
            ),
            stop_on_eos=False,
        ),
        Row(
            PROMPTS[2],
            SamplingParams(max_tokens=6, temperature=1.0, seed=3, presence_penalty=2.0),
            stop_on_eos=False,
        ),
    ]
    batch = ContinuousBatch(tiny_model, tiny_tokenizer)
    got = _run(batch, {0: rows[:1], 2: [rows[1]], 4: [rows[2]]})
    for ident, row in enumerate(rows):
        assert got[ident] == _alone(tiny_model, tiny_tokenizer, row), ident
    with pytest.raises(ValueError, match="logit_bias"):
        batch.check(Row([1, 2], SamplingParams(logit_bias={10**7: 1.0})))


def test_a_batch_that_rows_keep_joining_and_leaving_keeps_a_cache_as_long_as_its_rows(
    tiny_model, tiny_tokenizer
):
    # A server's batch never empties: each row leaves after 6 tokens and a new one joins
    # every 2 steps. The cache must span what the live rows attend to (give or take the
    # columns the decoder trims in one go), not the batch's history (120 steps), and every
    # row must still get its tokens alone.
    rows = [
        Row(
            PROMPTS[i % len(PROMPTS)],
            SamplingParams(max_tokens=6, temperature=1.0, seed=i),
            stop_on_eos=False,
        )
        for i in range(60)
    ]
    batch = ContinuousBatch(tiny_model, tiny_tokenizer)
    got: dict[int, list[int]] = {}
    widths = []
    for step in range(130):
        if step % 2 == 0 and step // 2 < len(rows):
            for ident in batch.add([rows[step // 2]]):
                got[ident] = []
        for token in batch.step():
            got[token.row].append(token.token)
        if len(batch):
            widths.append(batch.state.length)
    assert len(batch) == 0
    longest_prompt = max(len(p) for p in PROMPTS)
    # A live row spans at most its prompt and 6 tokens, and rows join 2 steps apart.
    assert max(widths) <= longest_prompt + 6 + 2 + TRIM_MIN_COLUMNS
    for ident, row in enumerate(rows):
        assert got[ident] == _alone(tiny_model, tiny_tokenizer, row), ident


def test_rows_of_several_adapters_joining_and_leaving_at_random_get_what_they_get_alone(
    tiny_model, tiny_tokenizer
):
    # Joins of one to three rows with prompts shorter and longer than the running cache,
    # rows leaving by length and by being dropped: the cache's free slots are reused, rows
    # move into the places of those that left, its columns are trimmed and regrown, and no
    # row's tokens change.
    engine = Engine(tiny_model, tokenizer=tiny_tokenizer)
    keys: list[str | None] = [None]
    for seed in (1, 2):
        policy = engine.create_policy(rank=4, alpha=8, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, b in policy.lora_weights.values():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
        keys.append(policy.adapter_key)
    rng = torch.Generator().manual_seed(0)

    def draw(n: int) -> int:
        return int(torch.randint(n, (1,), generator=rng))

    rows: dict[int, Row] = {}
    got: dict[int, list[int]] = {}
    dropped: set[int] = set()
    batch = ContinuousBatch(engine.model, tiny_tokenizer, engine.host)
    for step in range(160):
        if step < 120 and draw(3) == 0:
            new = []
            for _ in range(1 + draw(3)):
                prompt = [5 + draw(280) for _ in range(1 + draw(30))]
                params = SamplingParams(max_tokens=3 + draw(25), temperature=1.0, seed=draw(99))
                new.append(Row(prompt, params, adapter=keys[draw(3)], stop_on_eos=False))
            for ident, row in zip(batch.add(new), new, strict=True):
                rows[ident], got[ident] = row, []
        if len(batch) > 2 and draw(15) == 0:
            victim = batch.rows[draw(len(batch))].ident
            batch.drop({victim})
            dropped.add(victim)
        for token in batch.step():
            got[token.row].append(token.token)
    assert len(batch) == 0 and len(rows) > 40 and dropped
    for ident, row in rows.items():
        (alone,) = generate(
            engine.model,
            tiny_tokenizer,
            [row.prompt],
            row.params,
            adapters=[row.adapter],
            host=engine.host,
            stop_on_eos=False,
        )
        if ident in dropped:
            assert got[ident] == alone.tokens[: len(got[ident])], ident
        else:
            assert got[ident] == alone.tokens, ident


def test_rows_that_decode_past_the_caches_first_room_get_what_they_get_alone(
    tiny_model, tiny_tokenizer, monkeypatch
):
    # The cache starts with room for 6 tokens and grows (twice, for 30) as rows decode.
    monkeypatch.setattr("training.continuous.INITIAL_ROOM", 6)
    rows = [
        Row(p, SamplingParams(max_tokens=m, temperature=1.0, seed=s), stop_on_eos=False)
        for p, m, s in zip(PROMPTS, [30, 4, 25, 9], [1, 2, 3, 4], strict=True)
    ]
    batch = ContinuousBatch(tiny_model, tiny_tokenizer)
    got = _run(batch, {0: rows[:2], 5: [rows[2]], 12: [rows[3]]})
    for ident, row in enumerate(rows):
        assert got[ident] == _alone(tiny_model, tiny_tokenizer, row), ident


def test_a_cache_that_keeps_a_window_takes_no_rows_mid_decode(tiny_tokenizer):
    from transformers import Qwen2Config

    from tests.training.conftest import build_tiny_model

    model = build_tiny_model(len(tiny_tokenizer))
    config = {**model.config.to_dict(), "use_sliding_window": True, "sliding_window": 4}
    config.pop("layer_types")  # derived again from the window settings
    model.config = Qwen2Config(**{**config, "max_window_layers": 0})
    batch = ContinuousBatch(model, tiny_tokenizer)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    batch.add([Row(PROMPTS[0], params, stop_on_eos=False)])
    # Its layers drop what falls out of the window: no padding could line a new row up.
    assert not batch.can_join
    with pytest.raises(RuntimeError, match="cannot join"):
        batch.add([Row(PROMPTS[1], params)])
    while len(batch):
        batch.step()
    assert batch.can_join  # an empty batch takes rows again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_joining_mid_decode_on_cuda_get_what_they_get_alone(tiny_model, tiny_tokenizer):
    model = tiny_model.to("cuda")
    rows = [
        Row(p, SamplingParams(max_tokens=m, temperature=1.0, seed=s), stop_on_eos=False)
        for p, m, s in zip(PROMPTS, [12, 5, 9, 14], [1, 2, 3, 4], strict=True)
    ]
    got = _run(ContinuousBatch(model, tiny_tokenizer), {0: rows[:2], 3: [rows[2]], 7: [rows[3]]})
    for ident, row in enumerate(rows):
        assert got[ident] == _alone(model, tiny_tokenizer, row), ident
