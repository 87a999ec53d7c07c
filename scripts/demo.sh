#!/usr/bin/env bash
# The main job on the embedded default: convert SmolLM2-135M (4 full layers, window 64, 64 slots), then held-out
# perplexity of the original / converted / converted with all windows full, and a short completion.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/nha-retrofit convert smollm2-135m --full-layers 4 --output outputs/smollm2-135m-nha --overwrite
.venv/bin/nha-retrofit eval outputs/smollm2-135m-nha
