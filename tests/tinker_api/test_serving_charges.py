"""The model workers' GPU time counts against a team's monthly GPU-hours, live: the official
``tinker`` SDK and ``openai`` client against a real server, a real Celery worker and the
model worker of the tiny base model. What the worker spends on a team's forward/backward,
optimizer steps, sampling and chat is charged to that team alone; once the month is spent,
what would run on the model workers is refused (403 for the Tinker protocol, OpenAI's 429
``insufficient_quota`` that its client does not retry), while saving weights still works;
raising the quota lets the team on at once."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest

from jobs.models import ServingCharge
from jobs.quotas import USAGE_REUSE_SECONDS, gpu_seconds_this_month
from tests.fixtures.workers import wait_for
from tests.tinker_api.conftest import BASE_NAME

tinker = pytest.importorskip(
    "tinker",
    reason="the tinker SDK (a test dependency) is not importable; `pip install tinker==0.38.0`",
    exc_type=ImportError,
)
from tinker import types  # noqa: E402

from tests.tinker_api.test_sdk_live import EXAMPLES, service_client, sft_datum  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("clean_tinker_keys"),
]

QUESTION = [{"role": "user", "content": "What is 12+7?"}]


@pytest.fixture
def worker_env() -> dict[str, str]:
    # Every step's charge reaches the database at once.
    return {"OPENTINKER_TINKER_CHARGE_FLUSH_SECONDS": "0"}


@pytest.fixture
def server(live_tinker: str) -> str:
    return live_tinker


def charged(team: Any) -> tuple[float, int]:
    row = ServingCharge.objects.filter(team=team, base_model=BASE_NAME).first()
    return (row.gpu_seconds, row.requests) if row else (0.0, 0)


def settled(team: Any) -> bool:
    before = charged(team)
    time.sleep(0.5)
    return charged(team) == before


def test_the_model_workers_time_is_charged_and_a_spent_month_refused(
    server: str, team: Any, other_team: Any, owner_key: tuple[Any, str]
) -> None:
    began = time.monotonic()
    chat = openai.OpenAI(base_url=server + "/v1", api_key=owner_key[1], timeout=120, max_retries=0)
    with service_client(server + "/", owner_key[1]) as service:
        training = service.create_lora_training_client(base_model=BASE_NAME, rank=4).result()
        tokenizer = training.get_tokenizer()
        data = [sft_datum(tokenizer, p, a) for p, a in EXAMPLES]
        for _ in range(2):
            training.forward_backward(data, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(tokenizer.encode("12+7=", add_special_tokens=False))
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1)
        sampler.sample(prompt, num_samples=4, sampling_params=params).result()
        answer = chat.chat.completions.create(model=BASE_NAME, messages=QUESTION, max_tokens=8)
        assert answer.choices[0].message.content is not None

        # Create, 2 x (forward/backward, optimizer step), the sampler's save, 1 sample, 1 chat.
        wait_for(lambda: charged(team)[1] >= 8, timeout=30, what="the worker's charges")
        # A request's last steps are charged after it is counted: read once they stop.
        wait_for(lambda: settled(team), timeout=30, what="the worker's last charges")
        seconds, requests = charged(team)
        # The worker's one block, busy for part of the time since the test began.
        assert 0 < seconds < time.monotonic() - began and requests >= 8
        assert charged(other_team) == (0.0, 0)
        assert gpu_seconds_this_month(team.pk) == pytest.approx(seconds)

        # The month is spent: work on the model workers is refused, saving is not.
        team.quota.gpu_hours_per_month = seconds / 3600 / 2
        team.quota.save()
        # The check reuses a team's usage this long (the limit it reads each time).
        time.sleep(USAGE_REUSE_SECONDS)
        with pytest.raises(tinker.PermissionDeniedError) as refused:
            training.forward_backward(data, "cross_entropy").result()
        assert "gpu_hours_per_month" in str(refused.value)
        assert "saving and loading weights still work" in str(refused.value)
        with pytest.raises(tinker.PermissionDeniedError):
            sampler.sample(prompt, num_samples=1, sampling_params=params).result()
        saved = training.save_state("kept").result()
        assert saved.path.startswith("tinker://")
        with pytest.raises(openai.RateLimitError) as spent:
            chat.chat.completions.create(model=BASE_NAME, messages=QUESTION, max_tokens=4)
        error = spent.value.body
        assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"
        assert "gpu_hours_per_month" in error["message"]
        assert spent.value.response.headers["x-should-retry"] == "false"
        assert int(spent.value.response.headers["retry-after"]) > 0

        # Raised: the same training client goes on (its refused seq_ids were stepped past).
        team.quota.gpu_hours_per_month = 100.0
        team.quota.save()
        training.forward_backward(data, "cross_entropy").result()
        chat.chat.completions.create(model=BASE_NAME, messages=QUESTION, max_tokens=4)
