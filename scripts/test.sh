#!/usr/bin/env bash
# Install what is needed (scripts/setup_env.sh) and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
