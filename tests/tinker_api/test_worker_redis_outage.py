"""Redis outages while clients are served. One shorter than a lease while a Tinker client
trains: the model worker rides through it and keeps the model's live state (trained weights
and optimizer, never saved), and the client's next requests run on it as if nothing had
happened; the same when Redis comes back empty (as the embedded Valkey does, which keeps
nothing on disk). One during an OpenAI-style stream: the stream ends with an error event that
says why, not with a connection cut mid-answer.

The service is ``manage.py serve`` on a Valkey of the test's own, stopped and started again
on its port; never the shared server of the other tests. It keeps its data (an append-only
file, as a production Redis with persistence does) unless a test asks for an empty one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from tests.fixtures.served import ROOT, embedded_env, free_port, start_manage
from tests.fixtures.valkeys import StoppableValkey
from tests.fixtures.workers import wait_for

tinker = pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.live, pytest.mark.once, pytest.mark.timeout(420)]

KEY_ARGS = ("--user", "blink", "--team", "blink", "--create")


@pytest.fixture
def valkey(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoppableValkey]:
    server = StoppableValkey(tmp_path / "valkey", keep=getattr(request, "param", "kept") == "kept")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def served(tmp_path: Path, valkey: StoppableValkey) -> Iterator[tuple[str, str, Path]]:
    """(url, API key, log path) of ``manage.py serve`` on ``valkey``."""
    data_dir = tmp_path / "served"
    data_dir.mkdir()
    env = embedded_env(
        data_dir,
        "blink",
        REDIS_URL=f"redis://127.0.0.1:{valkey.port}/0",
        OPENTINKER_CPU_SLOTS="1",
        OPENTINKER_TINKER_TORCH_THREADS="1",
        OPENTINKER_TINKER_LONG_POLL_SECONDS="5",
        TINKER_TELEMETRY="0",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    port = free_port()
    log_path = data_dir / "serve.log"
    proc = start_manage(["serve", "--port", str(port)], env, log_path)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 180, f"the web server; log:\n{log_path.read_text(errors='replace')}")
        key = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "issue_api_key", *KEY_ARGS],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        yield url + "/", key, log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()


def _datum(tokenizer: Any) -> types.Datum:
    tokens = tokenizer.encode("12+7=19", add_special_tokens=False)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


@pytest.mark.parametrize("valkey", ["kept", "empty"], indirect=True)
def test_the_model_worker_keeps_a_models_live_state_through_a_redis_outage(
    served: tuple[str, str, Path], valkey: StoppableValkey
) -> None:
    url, key, log_path = served
    with tinker.ServiceClient(base_url=url, api_key="tml-" + key) as service:
        training = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        datum = _datum(training.get_tokenizer())
        for _ in range(2):
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()

        def logprobs() -> np.ndarray:
            out = training.forward([datum], "cross_entropy").result()
            return np.asarray(out.loss_fn_outputs[0]["logprobs"].to_numpy())

        trained = logprobs()
        valkey.stop()
        if valkey.keep:
            # Shorter than a lease (30 s): the worker's block is still its own when Redis is
            # back.
            time.sleep(5)
            valkey.start()
        else:
            valkey.start()
            next_key = "ot:tinker:next:" + training.model_id
            assert redis.Redis(port=valkey.port).get(next_key) is None
            # Past a heartbeat (a third of the 30 s lease): the worker has found its lease and
            # registration gone by now, and must have taken them back rather than ended.
            time.sleep(12)

        after = logprobs()
        log = log_path.read_text(errors="replace")
        if valkey.keep:
            assert "ended: failed" not in log, log[-4000:]
        else:
            assert "ended: " not in log and "was lost" not in log, log[-4000:]
        # Not the initial adapter a new worker would have rebuilt: the trained one.
        np.testing.assert_allclose(after, trained, rtol=0, atol=1e-6)
        # And training goes on from it.
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert logprobs().sum() > trained.sum()


def test_a_stream_cut_short_by_a_redis_outage_ends_with_an_error_event(
    served: tuple[str, str, Path], valkey: StoppableValkey
) -> None:
    url, key, _log_path = served
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    events: list[Any] = []
    chat = url + "v1/chat/completions"
    with httpx.stream("POST", chat, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 3:
                valkey.stop()
    valkey.start()
    last = events[-1]
    assert isinstance(last, dict) and "error" in last, events[-3:]
    assert last["error"]["type"] == "server_error"
    assert "Redis became unreachable" in last["error"]["message"]
