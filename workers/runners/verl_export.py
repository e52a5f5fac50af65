"""The final weights of a verl job, in the layout the native runner leaves.

verl's checkpoints hold FSDP shards (``actor/model_world_size_<W>_rank_<R>.pt``), not a model
another program loads. After the last step the runner merges the last ``global_step_N`` with
``workers/runners/verl_merge.py`` in the verl venv (full precision: verl's own merger rounds
to bfloat16) into the workdir names ``jobs.artifacts`` serves: ``adapter/`` (PEFT:
``adapter_config.json``, ``adapter_model.safetensors``) for a LoRA job, ``model/`` (an HF
model directory with its tokenizer) for full fine-tuning, and ``summary.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from jobs.spec import JobSpec
from workers.runners.base import JobContext
from workers.runners.verl_process import saved_steps

ADAPTER_DIR = "adapter"
MODEL_DIR = "model"
SUMMARY_FILE = "summary.json"
MERGE_SCRIPT = Path(__file__).resolve().with_name("verl_merge.py")
MERGE_TIMEOUT_S = 900


def _shards(actor: Path) -> list[Path]:
    return sorted(actor.glob("model_world_size_*_rank_*.pt"))


def export_final(
    ctx: JobContext,
    spec: JobSpec,
    checkpoint_dir: Path,
    *,
    python: str | None,
    env: Mapping[str, str],
) -> Path | None:
    """Export the last checkpoint's weights; None (and an event) when there is nothing to
    merge (no checkpoint with model shards, or no verl interpreter)."""
    steps = saved_steps(checkpoint_dir)
    actor = None
    if steps:
        # PPO saves the actor in a subdirectory; the SFT trainer saves its one model in place.
        actor = checkpoint_dir / f"global_step_{steps[-1]}"
        if (actor / "actor").is_dir():
            actor = actor / "actor"
    if actor is None or not _shards(actor) or python is None:
        ctx.event("verl left no model shards to export", {"checkpoint_dir": str(checkpoint_dir)})
        return None
    step = steps[-1]
    final = ctx.workdir / (MODEL_DIR if spec.full_finetune else ADAPTER_DIR)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    kind = "full" if spec.full_finetune else "lora"
    # -P: the script's directory holds verl.py, which must not shadow the verl package.
    argv = [python, "-P", str(MERGE_SCRIPT), "--actor", str(actor), "--out", str(tmp)]
    argv += ["--kind", kind]
    done = subprocess.run(
        argv,
        env=dict(env),
        cwd=ctx.workdir / "verl",
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=MERGE_TIMEOUT_S,
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"exporting global_step_{step} failed ({done.returncode}):\n{tail}")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    summary = {
        "step": step,
        "method": spec.method,
        "env": str(spec.env),
        "runner": "verl",
        "eval": None,
        "export": final.name,
    }
    (ctx.workdir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
    ctx.event(f"exported the final weights to {final.name}/", summary)
    return final
