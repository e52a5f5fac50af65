"""verl's own Hydra composition accepts the runner's overrides (verl 0.9.1, in its own venv).

verl cannot live in the project's venv (it pins transformers < 5.11), so the test composes
``ppo_trainer`` in the verl venv that ``make verl-env`` builds, when there is one, and
otherwise builds ``var/verl-compose-venv`` once with ``pip install --no-deps`` of verl and
Hydra, kept between runs. It skips when that cannot be built (no package index). The config
is read from verl's installed ``trainer/config`` directory with ``initialize_config_dir``:
``initialize_config_module("verl.trainer.config")`` imports the ``verl`` package, which needs
torch, Ray and the rest of verl's dependencies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jobs.spec import parse_spec
from workers.runners import verl, verl_config

REPO = Path(__file__).resolve().parents[2]
# `make verl-env` (scripts/build_verl_env.sh) stamps its venv once every pin is installed.
FULL_VENV = REPO / "var" / "verl-venv"
FULL_READY = FULL_VENV / ".opentinker-verl-pins"
VENV = REPO / "var" / "verl-compose-venv"
PACKAGES = [
    "verl==0.9.1",
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime==4.9.3",
    "pyyaml",
    "packaging",
]
READY = VENV / ".opentinker-ready"

COMPOSE = r"""
import importlib.util, json, os, sys, warnings
warnings.simplefilter("ignore")
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

overrides = json.load(sys.stdin)
root = importlib.util.find_spec("verl").submodule_search_locations[0]
config_dir = os.path.join(root, "trainer", "config")
out = {"mismatches": [], "values": {}, "error": None}
try:
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(os.environ["VERL_CONFIG"], overrides=overrides)
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    sys.exit(0)
parser = OverridesParser.create()
for ov in parser.parse_overrides(overrides):
    want = ov.value()
    got = OmegaConf.select(cfg, ov.key_or_group, throw_on_missing=True)
    if OmegaConf.is_config(got):
        got = OmegaConf.to_container(got, resolve=True)
    if got != want and not (isinstance(got, float) and isinstance(want, int) and got == want):
        out["mismatches"].append([ov.key_or_group, repr(want), repr(got)])
for key in sys.argv[1:]:
    value = OmegaConf.select(cfg, key)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    out["values"][key] = value
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def verl_python() -> Path:
    if FULL_READY.is_file() and (FULL_VENV / "bin" / "python").is_file():
        return FULL_VENV / "bin" / "python"
    python = VENV / "bin" / "python"
    if READY.is_file() and python.is_file():
        return python
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(VENV)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        pip = subprocess.run(
            [
                str(python),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--timeout",
                "20",
                "--retries",
                "1",
                *PACKAGES,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"cannot build {VENV} for verl's config composition: {exc}")
    if pip.returncode != 0:
        pytest.skip(
            f"cannot install {' '.join(PACKAGES)} into {VENV} (package index unreachable?): "
            f"{pip.stderr.strip()[-300:]}"
        )
    READY.write_text(" ".join(PACKAGES) + "\n")
    return python


def _compose(
    python: Path, overrides: list[str], *keys: str, config: str = "ppo_trainer"
) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), "-c", COMPOSE, *keys],
        input=json.dumps(overrides),
        env={**os.environ, "VERL_CONFIG": config},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _argv(spec_data: dict[str, Any], tmp_path: Path, *, cpu: bool = False) -> list[str]:
    from environments.datasets import load_rows, resolve

    spec = parse_spec(spec_data)
    rows = load_rows(resolve(spec.dataset), str(spec.env))[:64] if spec.dataset else None
    data = verl_config.write_datasets(spec, tmp_path / "data", rows=rows, eval_rows=None)
    multi = verl_config.is_multi_turn(str(spec.env))
    cfg = verl.write_agent_loop_config(tmp_path / "loops.yaml") if multi else None
    return verl_config.build_overrides(
        spec,
        model_path=tmp_path / "model dir",
        data=data,
        checkpoint_dir=tmp_path / "ckpt",
        n_gpus=4,
        experiment="job-1",
        agent_loop_config=cfg,
        max_prompt_length=256,
        cpu=cpu,
    )


A = "actor_rollout_ref"


@pytest.mark.parametrize(
    "spec_data",
    [
        {
            "method": "rl",
            "env": "math",
            "dataset": "builtin:arith_train",
            "runner": "verl",
            "steps": 20,
            "eval_every": 5,
            "algorithm": {"advantage": "rloo", "loss": "ppo", "clip_low": 0.7, "kl_coef": 0.01},
            "rollout": {"group_size": 6, "max_tokens": 96, "temperature": 0.8},
            "lora": {"rank": 32, "alpha": 64.0, "target_modules": ["q_proj", "v_proj"]},
        },
        {
            "method": "rl",
            "env": "gomoku",
            "runner": "verl",
            "steps": 4,
            "full_finetune": True,
            "algorithm": {"advantage": "grpo_per_step", "loss": "dro", "dro_beta": 0.1},
            "rollout": {"max_turns": 5, "max_tokens": 16},
        },
        {
            "method": "rl",
            "env": "math",
            "dataset": "builtin:arith_train",
            "runner": "verl",
            "algorithm": {"loss": "cispo", "clip_high": 3.0, "loss_aggregation": "sequence_mean"},
        },
        {
            "method": "rl",
            "base_model": "tiny-vl",
            "env": "geometry",
            "dataset": "builtin:geometry_train",
            "runner": "verl",
            "rollout": {"max_tokens": 32},
        },
    ],
    ids=["rloo-ppo-lora", "multi-turn-dro-full", "cispo", "vision-lora"],
)
def test_it_composes_with_verls_config(
    verl_python: Path, tmp_path: Path, spec_data: dict[str, Any]
) -> None:
    overrides = _argv(spec_data, tmp_path)
    keys = (
        f"{A}.rollout.response_length",
        f"{A}.rollout.prompt_length",
        f"{A}.rollout.n_gpus_per_node",
        f"{A}.actor.rollout_n",
        "algorithm.adv_estimator",
        f"{A}.actor.policy_loss.loss_mode",
        f"{A}.actor.loss_agg_mode",
    )
    out = _compose(verl_python, overrides, *keys)
    assert out["error"] is None, out["error"]
    # Every override landed on its key with the value we meant.
    assert out["mismatches"] == []
    spec = parse_spec(spec_data)
    values = out["values"]
    # verl's own interpolations pick our values up where the trainer reads them.
    assert values[f"{A}.rollout.response_length"] == verl_config.response_length(spec)
    assert values[f"{A}.rollout.prompt_length"] == 256
    assert values[f"{A}.rollout.n_gpus_per_node"] == 4
    assert values[f"{A}.actor.rollout_n"] == spec.rollout.group_size
    aggregation = spec.algorithm.loss_aggregation
    assert values[f"{A}.actor.loss_agg_mode"] == verl_config.LOSS_AGGREGATION[aggregation]


def test_it_composes_a_vision_jobs_overrides_on_cpu(verl_python: Path, tmp_path: Path) -> None:
    spec = {
        "method": "rl",
        "base_model": "tiny-vl",
        "env": "geometry",
        "dataset": "builtin:geometry_train",
        "runner": "verl",
    }
    keys = (
        "data.image_key",
        f"{A}.rollout.engine_kwargs.vllm",
        f"{A}.model.exclude_modules",
        f"{A}.model.lora_rank",
    )
    out = _compose(verl_python, _argv(spec, tmp_path, cpu=True), *keys)
    assert out["error"] is None, out["error"]
    assert out["mismatches"] == []
    values = out["values"]
    assert values["data.image_key"] == "images"
    # vLLM reads the limits as JSON (verl dumps the dict it composes): no videos.
    assert values[f"{A}.rollout.engine_kwargs.vllm"]["limit_mm_per_prompt"] == {
        "image": 8,
        "video": 0,
    }
    assert values[f"{A}.model.exclude_modules"] == verl_config.VISION_TOWER_MODULES


def test_it_is_refused_by_verl_for_an_unknown_key(verl_python: Path, tmp_path: Path) -> None:
    spec = {"method": "rl", "env": "math", "dataset": "builtin:arith_train", "runner": "verl"}
    overrides = [*_argv(spec, tmp_path), f"{A}.actor.no_such_option=1"]
    out = _compose(verl_python, overrides)
    assert out["error"] is not None and "no_such_option" in out["error"]


def test_it_composes_the_cpu_overrides(verl_python: Path, tmp_path: Path) -> None:
    spec = {"method": "rl", "env": "math", "dataset": "builtin:arith_train", "runner": "verl"}
    out = _compose(verl_python, _argv(spec, tmp_path, cpu=True), f"{A}.actor.strategy")
    assert out["error"] is None, out["error"]
    assert out["mismatches"] == []
    assert out["values"][f"{A}.actor.strategy"] == "fsdp2"


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu-lora", "gpu-full"])
def test_it_composes_the_sft_overrides(verl_python: Path, tmp_path: Path, cpu: bool) -> None:
    from environments.datasets import load_rows, resolve

    data_spec: dict[str, Any] = {
        "method": "sft",
        "env": "math",
        "dataset": "builtin:arith_train",
        "runner": "verl",
        "batch_size": 8,
    }
    if not cpu:
        data_spec["full_finetune"] = True
    spec = parse_spec(data_spec)
    rows = load_rows(resolve("builtin:arith_train"), "math")[:64]
    data = verl_config.write_sft_datasets(spec, tmp_path / "data", rows=rows, eval_rows=None)
    overrides = verl_config.build_sft_overrides(
        spec,
        model_path=tmp_path / "model dir",
        data=data,
        checkpoint_dir=tmp_path / "ckpt",
        n_gpus=2,
        experiment="job-1",
        max_length=256,
        cpu=cpu,
    )
    out = _compose(
        verl_python, overrides, "engine.strategy", "model.lora_rank", config="sft_trainer_engine"
    )
    assert out["error"] is None, out["error"]
    assert out["mismatches"] == []
    assert out["values"]["engine.strategy"] == ("fsdp2" if cpu else "fsdp")
    assert out["values"]["model.lora_rank"] == (spec.lora.rank if cpu else 0)
