#!/usr/bin/env bash
# The one prepared check for a CUDA machine (docs/verl.md, "What is tested where").
#
#   OUT=/tmp/out scripts/gpu_check.sh
#
# Steps (ONLY picks some, comma-separated, run in the order given; each has its own time limit,
# cut to what is left of BUDGET):
#   tests    the engine's GPU tests (pytest -m gpu tests/training: the vLLM sampler among them);
#   mfu      bench/mfu.py --device cuda: bf16 MFU of LoRA and full training and prefill, decode
#            against the device's bandwidth (issue goal: training >= 40% on an H200);
#   serving  bench/serving.py --device cuda: 16 streaming OpenAI clients over 4 policies vs one
#            policy at a time (goal >= 3x) and vs the in-process sampler (goal >= 0.8x), on the
#            tiny model; serving_mfu: the same on bench/mfu.py's 76M-parameter one;
#   tinker   bench/tinker_api.py --device cuda (SDK RL step and four clients at once);
#   verl     a small GRPO job on the `math` env through the verl runner (workers.runners.verl:
#            the same translation, parquet files, reward function and process supervision as
#            a job, without the database), 3 steps of 8 prompts x 4 samples.
# Every step together can take longer than one device call may (10 minutes): BUDGET (570 s by
# default) ends the run in time, a step that would start with under 30 s left is skipped and
# said so, and ONLY's order puts the figures wanted most first (default: mfu, serving, tinker,
# serving_mfu, tests, verl). What a step wrote before its limit stays under $OUT.
#
# A GPU machine lent for a short check has PyTorch with CUDA and the Hugging Face stack but
# not the service's packages, and reaches no index. Build them here first,
#   make gpu-bundle        (scripts/gpu_bundle.py -> .gpu/site-cp312.tar.xz, ~23 MB)
# and carry `.gpu` in the call; this script unpacks the bundle for its Python when that
# Python cannot import Django. verl, vLLM and Ray are not in the image and are far larger than
# a call may carry (vLLM's wheel alone is several hundred MB), so the verl step and the vLLM
# sampler test skip there and say so; they run on a GPU machine of one's own.
#
# Settings (environment):
#   OUT          where the results go (at most 8 files): summary.txt first.
#   ONLY         the steps to run, in this order (default mfu,serving,tinker,serving_mfu,tests,
#                verl).
#   BUDGET       seconds for all of them (default 570: one device call's 600 s, less a margin).
#   PYTHON       interpreter of the project (default .venv/bin/python, else python3).
#   VERL_PYTHON  interpreter that has verl 0.9.1 + vllm (default: $PYTHON). The job runs
#                "$VERL_PYTHON -m verl.trainer.main_ppo" through OPENTINKER_VERL_COMMAND.
#   MODEL_PATH   local model directory (default: Qwen2.5-0.5B-Instruct under $HF_HOME or
#                ~/models if present, else the bundled models/tiny-chat). No network needed.
#   VERL_STEPS   GRPO steps (default 3).  VERL_TIMEOUT  seconds for the job (default 420).
#   DEVICE       cuda (default); cpu rehearses every step here at small sizes, to check that
#                a bare Python with the image's packages plus the bundle runs them.
#   GPU_BUNDLE_DIR  where scripts/gpu_bundle.py put the bundle (default .gpu).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(pwd)/var/gpu_check}
mkdir -p "$OUT"
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
VERL_PYTHON=${VERL_PYTHON:-$PYTHON}
VERL_STEPS=${VERL_STEPS:-3}
VERL_TIMEOUT=${VERL_TIMEOUT:-420}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DJANGO_SETTINGS_MODULE=opentinker_site.settings.test
ONLY=${ONLY:-mfu,serving,tinker,serving_mfu,tests,verl}
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-570}
T0=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
# Both serving steps append to one file: this run's only.
rm -f "$OUT/serving_$DEVICE.txt"
note() { echo "$*" | tee -a "$SUMMARY"; }
case $DEVICE in
  cuda)
    MFU_ARGS="--device cuda --dtype bfloat16 --batch 64 --seq 512"
    SERVING_ARGS="--device cuda --repeat 1"
    TINKER_ARGS="--device cuda --repeat 1 --rounds 3" ;;
  cpu)
    MFU_ARGS="--device cpu --threads 2 --batch 2 --seq 64 --repeats 1"
    SERVING_ARGS="--device cpu --repeat 1 --requests 1 --max-tokens 16"
    TINKER_ARGS="--device cpu --repeat 1 --rounds 1 --sft-rounds 1 --sft-steps 2 --four-steps 2" ;;
  *) note "DEVICE: expected cuda or cpu, got '$DEVICE'"; exit 2 ;;
esac
case $BUDGET in
  '' | *[!0-9]*) note "BUDGET: expected whole seconds, got '$BUDGET'"; exit 2 ;;
esac
for step in ${ONLY//,/ }; do
  case $step in
    tests | mfu | serving | serving_mfu | tinker | verl) ;;
    *) note "ONLY: unknown step '$step' (steps: tests, mfu, serving, serving_mfu, tinker, verl)"; exit 2 ;;
  esac
done

# The service's packages, when this Python lacks them (a lent machine's image): the bundle
# that scripts/gpu_bundle.py built for this Python's version.
if ! "$PYTHON" -c 'import django' >/dev/null 2>&1; then
  tag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  bundle=${GPU_BUNDLE_DIR:-.gpu}/site-$tag.tar.xz
  if [ -f "$bundle" ]; then
    site=${TMPDIR:-/tmp}/opentinker-site-$tag
    # Python's own tarfile: the image need not have xz.
    rm -rf "$site" && mkdir -p "$site" &&
      "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
        "$bundle" "$site" || exit 2
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    note "packages: unpacked $bundle into $site"
  else
    note "packages: $PYTHON cannot import django and there is no $bundle: run scripts/gpu_bundle.py here and carry .gpu"
  fi
fi

if [ -z "${MODEL_PATH:-}" ]; then
  for candidate in "${HF_HOME:-$HOME/.cache/huggingface}/Qwen2.5-0.5B-Instruct" \
    "$HOME/models/Qwen2.5-0.5B-Instruct" /models/Qwen2.5-0.5B-Instruct models/tiny-chat; do
    if [ -f "$candidate/config.json" ]; then MODEL_PATH=$candidate; break; fi
  done
fi
MODEL_PATH=$(cd "${MODEL_PATH:-models/tiny-chat}" && pwd)

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PYTHON" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1
  "$VERL_PYTHON" - <<'EOF' 2>&1
import importlib.metadata as md
for name in ("verl", "vllm", "torch", "transformers", "ray"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF
  echo "model: $MODEL_PATH"
  echo "steps: $ONLY"
} >>"$SUMMARY"
cat "$SUMMARY"

# Each step's time limit, cut to what is left of BUDGET seconds since the start.
limit() {
  local left=$((BUDGET - ($(date +%s) - T0)))
  echo $(($1 < left ? $1 : left))
}

# --- engine GPU tests (vLLM sampler included) ------------------------------------------------
step_tests() {
  timeout "$(limit 180)" "$PYTHON" -m pytest tests/training -m gpu -q -rs -p no:cacheprovider \
    >"$OUT/engine_gpu_tests.txt" 2>&1
  note "engine gpu tests: rc=$? in $(($(date +%s) - start))s: $(tail -n 1 "$OUT/engine_gpu_tests.txt")"
}

# --- MFU in bf16 on the GPU: 64 x 512 tokens a step, so that matmuls, not launches, decide ---
step_mfu() {
  timeout "$(limit 180)" "$PYTHON" bench/mfu.py $MFU_ARGS >"$OUT/mfu_$DEVICE.txt" 2>&1
  note "mfu $DEVICE: rc=$? in $(($(date +%s) - start))s"
  grep -E '^(model|lora|full|prefill|decode)' "$OUT/mfu_$DEVICE.txt" | tee -a "$SUMMARY"
}

# --- OpenAI serving on the GPU: the multi-LoRA batch's gain and the serving overhead ---------
# On the tiny model (`serving`: decode steps of launches) and on bench/mfu.py's 76M one
# (`serving_mfu`: steps of arithmetic), both into one file (at most 8 files come back).
serve_model() {
  echo "=== --model $1" >>"$OUT/serving_$DEVICE.txt"
  timeout "$(limit 240)" "$PYTHON" bench/serving.py $SERVING_ARGS --model "$1" \
    >>"$OUT/serving_$DEVICE.txt" 2>&1
  note "serving $DEVICE $1: rc=$? in $(($(date +%s) - start))s: $(grep -E '^\[1/1\]' "$OUT/serving_$DEVICE.txt" | tail -n 1 | cut -c1-600)"
}
step_serving() { serve_model tiny; }
step_serving_mfu() { serve_model mfu; }

# --- Tinker API benchmark on the GPU: the four-clients batching ratio (goal >= 2x) -----------
step_tinker() {
  timeout "$(limit 240)" "$PYTHON" bench/tinker_api.py $TINKER_ARGS >"$OUT/tinker_bench_$DEVICE.txt" 2>&1
  note "tinker bench $DEVICE: rc=$? in $(($(date +%s) - start))s: $(grep -E 'ratio|x ' "$OUT/tinker_bench_$DEVICE.txt" | tail -n 4 | tr '\n' ' ' | cut -c1-300)"
}

# --- GRPO through the verl runner --------------------------------------------------------------
step_verl() {
  if [ "$DEVICE" != cuda ]; then
    note "verl job: SKIPPED: DEVICE=$DEVICE (verl on the CPU is tests/e2e/test_verl_real.py's, in its own venv)"
    return
  fi
  if ! "$VERL_PYTHON" -c 'import verl, vllm' >/dev/null 2>&1; then
    note "verl job: SKIPPED: $VERL_PYTHON cannot import verl and vllm (pip install .[verl] vllm; a lent machine has neither, and they are too large to carry)"
    return
  fi
  export OPENTINKER_VERL_COMMAND="$VERL_PYTHON -m verl.trainer.main_ppo"
  timeout "$(limit $((VERL_TIMEOUT + 60)))" "$PYTHON" - "$OUT" "$MODEL_PATH" "$VERL_STEPS" "$VERL_TIMEOUT" \
    >"$OUT/verl_job.txt" 2>&1 <<'EOF'
import json, sys, threading, time
from pathlib import Path

from environments.datasets import load_rows, resolve
from jobs.spec import parse_spec
from transformers import AutoTokenizer
from workers.runners import verl
from workers.runners.base import JobContext

out, model, steps, limit = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
metrics_file = (out / "verl_metrics.jsonl").open("w")


class PrintingContext(JobContext):
    """Job-row writes go to stdout and a JSONL file: no database on this machine."""

    def heartbeat(self, step=None, *, force=False):
        pass

    def log_metrics(self, step, metrics):
        metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        metrics_file.flush()
        keys = ("reward/mean", "loss", "kl", "entropy", "step_time_s", "eval/reward")
        print(f"[metrics] step {step}: " + ", ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics), flush=True)

    def event(self, message, data=None):
        print(f"[event] {message}", flush=True)


spec = parse_spec({
    "method": "rl", "env": "math", "dataset": "builtin:arith_train", "runner": "verl",
    "steps": steps, "checkpoint_every": steps, "eval_every": steps, "eval_examples": 32,
    "rollout": {"group_size": 4, "prompts_per_step": 8, "max_tokens": 64, "temperature": 1.0},
    "lora": {"rank": 16, "alpha": 32.0}, "optimizer": {"lr": 1e-5},
})
deadline = time.monotonic() + limit
ctx = PrintingContext(job_id="gpu-check", attempt=1, spec=spec.model_dump(mode="json"),
                      devices=["cuda:0"], gpus=[0], workdir=out / "work",
                      cancel_check=lambda _job: time.monotonic() > deadline)
rows = load_rows(resolve("builtin:arith_train"), "math")
eval_rows = load_rows(resolve("builtin:arith_test"), "math")
argv = verl.prepare(ctx, spec, model_path=model, rows=rows, eval_rows=eval_rows,
                    tokenizer=AutoTokenizer.from_pretrained(str(model)))
# Sized for one GPU shared by trainer and vLLM; keys the runner leaves at verl's defaults.
argv += ["actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
         "actor_rollout_ref.rollout.enforce_eager=true"]
print("argv:", " ".join(argv), flush=True)
started = time.monotonic()
root = ctx.workdir / "verl"
result = verl.supervise(ctx, argv, env=verl.trainer_env(ctx), cwd=root,
                        checkpoint_dir=root / "checkpoints", log_path=root / "trainer.log",
                        env_name="math")
print(f"[result] rc={result.returncode} stopped={result.stopped} last_step={result.last_step} "
      f"checkpoints={result.checkpoints} seconds={time.monotonic() - started:.0f}", flush=True)
print("--- trainer tail ---\n" + "\n".join(result.tail), flush=True)
ok = result.returncode == 0 and result.last_step == steps and result.checkpoints
sys.exit(0 if ok else 1)
EOF
  note "verl job: rc=$? in $(($(date +%s) - start))s: $(grep '^\[result\]' "$OUT/verl_job.txt" | tail -n 1)"
  grep '^\[metrics\]' "$OUT/verl_job.txt" | tee -a "$SUMMARY"
  tail -c 200000 "$OUT/work/verl/trainer.log" >"$OUT/verl_trainer_tail.log" 2>/dev/null || true
  rm -rf "$OUT/work"
}

# In the order ONLY names them, so that the figures wanted most come first.
for step in ${ONLY//,/ }; do
  if [ $((BUDGET - ($(date +%s) - T0))) -lt 30 ]; then
    note "$step: SKIPPED: less than 30 s left of BUDGET=$BUDGET"
    continue
  fi
  start=$(date +%s)
  "step_$step"
done
