"""The model worker keeps the adapters its running requests decode with: sampler
checkpoints loaded past the cache's limit, and policy snapshots past the number kept per
policy, go once no request in the chat batch still routes rows to them, and a request whose
adapter went anyway (its policy closed) ends alone with an error, not the whole batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.tinker_api.test_openai_worker import chat_op, engine, events_of, make_handler
from tinker_api import futures
from tinker_api.worker import sampler_cache

__all__ = ["engine"]  # the module's engine fixture, shared


def adapter_file(engine: Any, into: Path, seed: int) -> str:
    import torch

    from training import peft_io

    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: (
            torch.randn(4, module.in_features, generator=generator) * 0.05,
            torch.randn(module.out_features, 4, generator=generator) * 0.05,
        )
        for name, module in engine.host.modules.items()
    }
    return str(peft_io.write_adapter_weights(into, weights))


def file_op(path: str, **fields: Any) -> Any:
    op = chat_op(max_tokens=12, ignore_eos=True, **fields)
    op.fields["target"] = {"file": path, "rank": 4}
    return op


def run_worker_loop(handler: Any, samplers: Any, arrivals: dict[int, Any]) -> None:
    """Step as the worker does: requests arriving at given steps, the cache trimmed to what
    the batch still uses before each step."""
    step = 0
    while handler.busy or arrivals:
        if step in arrivals:
            handler.admit([arrivals.pop(step)])
        samplers.trim(handler.adapters_in_use())
        handler.step()
        step += 1
        assert step < 200, "the batch never emptied"


@pytest.fixture
def handler(engine: Any, redis_client: Any, clean_tinker_keys: None, settings: Any) -> Any:
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 0
    return make_handler(engine)


def done_tokens(op: Any) -> int:
    (done,) = [e for e in events_of(op) if e["t"] == "done"]
    return int(done["usage"]["completion_tokens"])


def test_a_sampler_checkpoint_in_use_stays_loaded_past_the_cache_limit(
    handler: Any, engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler_cache, "LOADED_SAMPLERS", 1)
    files = [adapter_file(engine, tmp_path / f"a{i}", seed=i) for i in range(3)]
    ops = [file_op(path) for path in files]
    # The first request decodes while the second and third load theirs (past the limit of 1).
    run_worker_loop(handler, handler.samplers, {0: ops[0], 2: ops[1], 4: ops[2]})
    for op in ops:
        assert futures.get(op.rid)["status"] == futures.DONE, events_of(op)
        assert done_tokens(op) == 12
    # Idle again: the cache is back within its limit, the newest file kept.
    handler.samplers.trim(handler.adapters_in_use())
    assert list(handler.samplers.loaded) == [files[2]]
    assert [k for k in engine.host.keys if k.startswith("sampler:")] == [
        handler.samplers.loaded[files[2]]
    ]
    engine.host.unregister(handler.samplers.loaded.pop(files[2]))


def test_a_file_asked_for_again_is_the_last_to_be_dropped(
    engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler_cache, "LOADED_SAMPLERS", 2)
    samplers = sampler_cache.SamplerCache(engine)
    files = [adapter_file(engine, tmp_path / f"b{i}", seed=10 + i) for i in range(3)]
    first = samplers.key({"file": files[0], "rank": 4}, {})
    samplers.key({"file": files[1], "rank": 4}, {})
    assert samplers.key({"file": files[0], "rank": 4}, {}) == first  # loaded once
    samplers.key({"file": files[2], "rank": 4}, {})
    samplers.trim(set())
    assert list(samplers.loaded) == [files[0], files[2]]
    for key in samplers.loaded.values():
        engine.host.unregister(key)


def test_a_snapshot_in_use_outlives_the_snapshots_kept_per_policy(
    handler: Any, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler_cache, "LIVE_SNAPSHOTS", 1)
    policy = handler.policies.new("m-snap", {"rank": 4, "seed": 3})
    try:
        old = policy.snapshot()
        handler.samplers.keep_snapshot(1, policy, old)
        op = chat_op(max_tokens=12, ignore_eos=True)
        op.fields["target"] = {"model": "m-snap", "checkpoint": 1, "file": ""}
        handler.admit([op])
        handler.step()
        # Training saves two more snapshots for the sampler while the request decodes.
        for pk in (2, 3):
            handler.samplers.keep_snapshot(pk, policy, policy.snapshot())
        run_worker_loop(handler, handler.samplers, {})
        assert futures.get(op.rid)["status"] == futures.DONE, events_of(op)
        assert done_tokens(op) == 12
        # Once the request is over, only the newest snapshot is kept.
        handler.samplers.trim(handler.adapters_in_use())
        assert policy.versions == [old + 2]
    finally:
        handler.policies.remove("m-snap")


def test_a_request_whose_adapter_is_gone_ends_alone(handler: Any, engine: Any) -> None:
    policy = handler.policies.new("m-gone", {"rank": 4, "seed": 5})
    version = policy.snapshot()
    handler.samplers.keep_snapshot(7, policy, version)
    orphan = chat_op(max_tokens=12, ignore_eos=True)
    orphan.fields["target"] = {"model": "m-gone", "checkpoint": 7, "file": ""}
    other = chat_op(max_tokens=12, ignore_eos=True)
    handler.admit([orphan, other])
    handler.step()
    # Its session ends (the policy closes, its snapshots unregistered) mid-decode.
    handler.samplers.forget(policy)
    handler.policies.remove("m-gone")
    run_worker_loop(handler, handler.samplers, {})
    assert futures.get(other.rid)["status"] == futures.DONE
    assert done_tokens(other) == 12
    record = futures.get(orphan.rid)
    assert record["status"] == futures.FAILED
    assert "unloaded" in str(record.get("error", "")), record


def test_one_sampling_batch_over_more_checkpoints_than_the_cache_holds(
    handler: Any, engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tinker sample requests that name three checkpoint files, the cache holding one,
    joining the batch together: loading the third must not drop the first under them."""
    from tests.tinker_api.test_openai_worker import BASE
    from tinker_api.worker.chat import ChatHandler
    from tinker_api.worker.requests import Op
    from tinker_api.worker.sampling import SamplingHandler

    monkeypatch.setattr(sampler_cache, "LOADED_SAMPLERS", 1)
    files = [adapter_file(engine, tmp_path / f"c{i}", seed=20 + i) for i in range(3)]
    ops = []
    for path in files:
        rid = futures.new_request_id()
        fields = {
            "op": "sample",
            "rid": rid,
            "target": {"file": path, "rank": 4},
            "prompt": [5, 6, 7, 8],
            "n": 2,
            "params": {"max_tokens": 6, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 3},
        }
        futures.submit(rid, fields, team_id=1, base=BASE)
        ops.append(Op(fields=fields))
    shared = ChatHandler(
        BASE,
        engine,
        handler.policies,
        handler.samplers,
        sampling=SamplingHandler(BASE, engine, handler.policies, handler.samplers),
    )
    shared.admit(ops)
    run_worker_loop(shared, handler.samplers, {})
    for op in ops:
        assert futures.get(op.rid)["status"] == futures.DONE, futures.get(op.rid)
    handler.samplers.trim(set())
    assert list(handler.samplers.loaded) == [files[2]]
    engine.host.unregister(handler.samplers.loaded.pop(files[2]))
