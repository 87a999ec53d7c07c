#!/usr/bin/env bash
# The test suite, from scratch: set up .venv, then pytest (CPU only; GPU kernel tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
