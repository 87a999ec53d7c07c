#!/usr/bin/env bash
# The test suite, from scratch: set up .venv, then pytest (CPU only; GPU kernel tests skip without CUDA). The default
# tier leaves out tests marked `slow`; arguments go to pytest and a later -m wins (`-m slow`: the slow tier alone).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -m "not slow" "$@"
