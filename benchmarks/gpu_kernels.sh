#!/usr/bin/env bash
# The kernels on one GPU: the kernel tests against float64 (tests/ops), the operator table with each stage at 32K
# (benchmarks/ops.py) and the model-level check (benchmarks/e2e_model.py: a Llama-3-8B-shaped model at 8K tokens,
# the kernels against the PyTorch path; prints AGREE). Run from the repository root with $OUT an empty folder:
#     OUT=/some/dir bash benchmarks/gpu_kernels.sh
# Each step runs under `timeout` against one overall deadline (BUDGET seconds, CAP_* per step), so a hang costs one
# step. fla's columns of the operator table need fla-core and einops: carry their wheels in .whl (no network there).
set -u
OUT=${OUT:?set OUT to an empty output folder}
mkdir -p "$OUT"
PY=${PY:-python3}
START=$(date +%s)
BUDGET=${BUDGET:-540}

left() { echo $((BUDGET - ($(date +%s) - START))); }
step() {  # step NAME CAP_SECONDS CMD...: run CMD with min(CAP, time left) seconds, log to $OUT/NAME.log
  local name=$1 cap=$2; shift 2
  local t; t=$(left); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 15 ]; then echo "== $name: skipped (no time left)" | tee -a "$OUT/summary.txt"; return; fi
  local s; s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$?, $(( $(date +%s) - s ))s (limit ${t}s)" | tee -a "$OUT/summary.txt"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/device.txt" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/fla_core-*.whl .whl/einops-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/fla-site .whl/fla_core-*.whl .whl/einops-*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/fla-site
fi
PT=(-m pytest -p no:cacheprovider -q -rfE --durations=15)
# mostly Triton compilation (CPU) and small launches: several workers share the one GPU
if $PY -c "import xdist" 2>/dev/null; then PT+=(-n "${TEST_WORKERS:-6}"); fi
LENGTHS=${OPS_LENGTHS:-2048,4096,8192,16384,32768,65536}

step tests "${CAP_TESTS:-300}" $PY "${PT[@]}" tests/ops
step ops "${CAP_OPS:-200}" $PY benchmarks/ops.py --parts --skip "${OPS_SKIP:-fla_gsa}" --out-dir "$OUT" \
  --lengths "$LENGTHS"
step e2e "${CAP_E2E:-90}" $PY benchmarks/e2e_model.py

{
  echo; echo "# summary"
  cat "$OUT/device.txt"
  echo "## tests"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40
  echo "## operator benchmark"; cat "$OUT"/ops_*.md 2>/dev/null || tail -20 "$OUT/ops.log"
  echo "## model check"; tail -25 "$OUT/e2e.log" 2>/dev/null
  echo "total wall $(( $(date +%s) - START ))s"
} >> "$OUT/summary.txt"
sed -n '/^# summary/,$p' "$OUT/summary.txt"
