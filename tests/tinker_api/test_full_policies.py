"""Fully fine-tuned policies on the OpenAI-style endpoints: a job that trained every weight is
served like a LoRA job (``job:<id>``, its checkpoints, its name), its model loaded by the base
model's worker into an engine of its own (``tinker_api.worker.full_models``).

The weights are a real full fine-tuning policy's, moved away from the base so that it samples
differently, written as a run leaves them: ``Policy.export_full`` with the tokenizer
(``model/``) and ``Policy.save_state`` (a native checkpoint's ``state.pt``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.tinker_api.conftest import BASE_NAME
from tests.tinker_api.test_openai_worker import chat_op, drive, events_of, make_handler
from tinker_api import futures
from tinker_api.services.lookups import Caller
from tinker_api.worker.requests import Op

BASE = "tiny-tinker"
CHECKPOINT = "step-000003"


@pytest.fixture(scope="module")
def engine(base_model_dir: Path) -> Any:
    import torch

    from training.engine import Engine

    torch.set_num_threads(1)
    return Engine(str(base_model_dir), device="cpu")


def write_full_job(engine: Any, root: Path) -> Any:
    """A full fine-tuning policy's final model and checkpoint under the job workdir ``root``;
    the policy (its version 0 holds the written weights)."""
    import torch

    from training.checkpoint import CheckpointDir

    policy = engine.create_policy(full_finetune=True)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in policy.model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    version = policy.snapshot()
    policy.export_full(version, root / "model")
    engine.tokenizer.save_pretrained(str(root / "model"))
    CheckpointDir(root / "checkpoints").save(policy, CHECKPOINT, extra={"step": 3})
    return policy


@pytest.fixture(scope="module")
def full_files(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("full-job")
    policy = write_full_job(engine, root)
    return policy, root / "model", root / "checkpoints" / CHECKPOINT / "state.pt"


@pytest.fixture
def worker_side(redis_client: Any, clean_tinker_keys: None, settings: Any) -> None:
    settings.OPENTINKER_OPENAI_STREAM_INTERVAL_MS = 0


def full_models(engine: Any) -> Any:
    from tinker_api.worker.full_models import FullModels

    base = make_handler(engine)
    return FullModels(BASE, engine, base, base.charge)


def full_op(file: Path | str, **fields: Any) -> Op:
    return chat_op(target={"full": str(file)}, **fields)


def step_all(models: Any) -> None:
    while models.busy:
        models.step()


def test_a_loaded_model_holds_the_policys_weights_exactly(engine: Any, full_files: Any) -> None:
    from tinker_api.worker.full_models import load_full

    policy, model_dir, state = full_files
    want = policy.version_model(0).state_dict()
    for file in (model_dir, state):
        loaded = load_full(engine, str(file))
        assert loaded.tokenizer is engine.tokenizer
        got = loaded.model.state_dict()
        plain = {k.replace(".base_layer", ""): v for k, v in got.items()}
        assert set(plain) == set(want)
        assert all(plain[k].equal(want[k]) for k in want), file


def test_it_samples_the_full_policy_not_the_base(
    engine: Any, full_files: Any, worker_side: None
) -> None:
    from tinker_api.worker.chat import ChatHandler
    from tinker_api.worker.sampler_cache import SamplerCache
    from training.engine import Engine

    policy, model_dir, state = full_files
    fields = {"max_tokens": 16, "ignore_eos": True, "seed": 4, "n": 2}
    served, from_state = full_op(model_dir, **fields), full_op(state, **fields)
    models = full_models(engine)
    models.admit([served, from_state])
    step_all(models)
    base = chat_op(**fields)
    drive(make_handler(engine), [base])
    # The policy's own frozen model, in memory: what the files hold must sample as it does.
    import copy

    own = Engine(copy.deepcopy(policy.version_model(0)), tokenizer=engine.tokenizer)
    reference = chat_op(**fields)
    drive(ChatHandler(BASE, own, {}, SamplerCache(own)), [reference])

    def texts(op: Op) -> list[str]:
        ends = sorted((e for e in events_of(op) if e["t"] == "end"), key=lambda e: e["i"])
        return [e["text"] for e in ends]

    assert texts(served) == texts(reference) == texts(from_state)
    assert texts(served) != texts(base)
    assert all(futures.get(op.rid)["status"] == futures.DONE for op in (served, from_state))
    assert futures.queued_samples(BASE) == 0
    # Both files are held: two models, within the default of two.
    assert sorted(models.handlers) == sorted([str(model_dir), str(state)])


def test_it_holds_at_most_its_limit_and_drops_what_stays_idle(
    engine: Any, full_files: Any, worker_side: None, settings: Any
) -> None:
    _policy, model_dir, state = full_files
    settings.OPENTINKER_OPENAI_FULL_MODELS = 1
    settings.OPENTINKER_OPENAI_FULL_IDLE_SECONDS = 60
    models = full_models(engine)
    first = full_op(model_dir, max_tokens=6, ignore_eos=True)
    second = full_op(state, max_tokens=6, ignore_eos=True)
    models.admit([first, second])
    # One model at a time: the second waits until the first has nothing to run.
    assert list(models.handlers) == [str(model_dir)] and models.waiting == [second]
    step_all(models)
    assert list(models.handlers) == [str(state)] and not models.waiting
    for op in (first, second):
        assert [e["t"] for e in events_of(op)][-1] == "done"
    models.step()
    assert list(models.idle_since) == [str(state)]
    models.idle_since[str(state)] -= 61
    models.step()
    assert models.handlers == {} and not models.busy


def test_it_refuses_a_model_whose_files_are_gone_or_not_a_full_model(
    engine: Any, tmp_path: Path, worker_side: None
) -> None:
    lora = engine.create_policy(rank=2, policy_id="lora-state")
    lora_state = lora.save_state(tmp_path / "lora" / "state.pt")
    engine.remove_policy("lora-state")
    gone, missing, not_full = (
        full_op(tmp_path / "deleted" / "model"),
        full_op(tmp_path / "deleted" / "state.pt"),
        full_op(lora_state),
    )
    models = full_models(engine)
    models.admit([gone, missing, not_full])
    assert models.handlers == {} and not models.busy
    for op, says in ((gone, "gone"), (missing, "gone"), (not_full, "no full model")):
        (error,) = [e for e in events_of(op) if e["t"] == "error"]
        assert error["status"] == 400 and error["param"] == "model" and says in error["message"]
        assert futures.get(op.rid)["status"] == futures.FAILED
    assert futures.queued_samples(BASE) == 0


# ---------------------------------------------------------------------- the door and the server


@pytest.fixture
def full_job(team: Any, owner: Any, tinker_data_dir: Path, engine: Any) -> Any:
    from jobs.models import Job, JobState

    job = Job.objects.create(
        team=team,
        created_by=owner,
        name="full-adder",
        spec={"method": "rl", "env": "bandit", "base_model": BASE_NAME, "full_finetune": True},
        spec_version=1,
        state=JobState.SUCCEEDED,
    )
    write_full_job(engine, tinker_data_dir / "jobs" / str(job.pk))
    return job


def test_the_door_names_a_full_jobs_model_and_checkpoints(
    tinker_base: Any, full_job: Any, team: Any, owner: Any, tinker_data_dir: Path
) -> None:
    from jobs.models import Job, JobState
    from tinker_api.services import serving

    caller = Caller(team_id=team.pk, user=owner, key=None)
    root = tinker_data_dir / "jobs" / str(full_job.pk)
    final = serving.resolve(caller, f"job:{full_job.pk}")
    assert final.base.name == BASE_NAME and final.target == {"full": str(root / "model")}
    assert serving.resolve(caller, "full-adder").target == final.target
    ckpt = serving.resolve(caller, f"job:{full_job.pk}:{CHECKPOINT}")
    assert ckpt.target == {"full": str(root / "checkpoints" / CHECKPOINT / "state.pt")}
    listed = [m.name for m in serving.list_models(caller)]
    assert f"job:{full_job.pk}" in listed and f"job:{full_job.pk}:{CHECKPOINT}" in listed

    # A run that has not exported its model yet is no model.
    running = Job.objects.create(
        team=team,
        created_by=owner,
        name="still-running",
        spec=full_job.spec,
        spec_version=1,
        state=JobState.RUNNING,
    )
    with pytest.raises(serving.NotServable, match="no final model yet"):
        serving.resolve(caller, f"job:{running.pk}")
    (root / "model" / "config.json").unlink()
    with pytest.raises(serving.NotServable, match="no final model yet"):
        serving.resolve(caller, f"job:{full_job.pk}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_openai_client_gets_the_full_policy_from_a_live_server(
    live_tinker: str,
    clean_tinker_keys: None,
    full_job: Any,
    owner_key: tuple[Any, str],
    outsider_key: tuple[Any, str],
) -> None:
    api = openai.OpenAI(base_url=live_tinker + "/v1", api_key=owner_key[1], timeout=120)
    ask: dict[str, Any] = {
        "messages": [{"role": "user", "content": "What is 12+7?"}],
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    name, ckpt = f"job:{full_job.pk}", f"job:{full_job.pk}:{CHECKPOINT}"
    assert {name, ckpt} <= {m.id for m in api.models.list()}
    final = api.chat.completions.create(model=name, **ask).choices[0].message.content
    base = api.chat.completions.create(model=BASE_NAME, **ask).choices[0].message.content
    assert final and final != base
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in api.chat.completions.create(model=ckpt, stream=True, **ask)
        if chunk.choices
    )
    assert streamed == final
    # The job page's sample endpoint runs on the same model.
    import requests

    sampled = requests.post(
        f"{live_tinker}/api/v1/jobs/{full_job.pk}/sample",
        headers={"Authorization": f"Bearer {owner_key[1]}"},
        json={"prompt": "12+7=", "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert sampled.status_code == 200, sampled.text
    assert len(json.loads(sampled.content)["samples"]) == 1
    outsider = openai.OpenAI(base_url=live_tinker + "/v1", api_key=outsider_key[1], timeout=60)
    with pytest.raises(openai.NotFoundError):
        outsider.chat.completions.create(model=name, **ask)
