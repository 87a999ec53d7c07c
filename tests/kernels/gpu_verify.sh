#!/usr/bin/env bash
# GPU verification of the real-weights investigation and the keys_da slot blocks (benchmarks/NOTES.md, "Real
# weights"). Usage, on the GPU machine from the repository root: bash tests/kernels/gpu_verify.sh [CONVERTED_MODEL]
# Logs under $OUT (or ./gpu_verify_logs). Each step is its own process: a CUDA fault poisons only that one.
# At most 8 minutes (step time limits 120 + 150 + 150 + 60 s; kernel compiles included).
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
LOG=${OUT:-gpu_verify_logs}
mkdir -p "$LOG"
MODEL=${1:-}

step() {  # name, timeout, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name" | tee -a "$LOG/summary.txt"
    NHA_KERNEL_SYNC=1 timeout "$limit" "$@" > "$LOG/$name.log" 2>&1
    local rc=$?
    grep -hE "ERRORS|passed|failed|error|Error|KERNELS|logits_|ratio" "$LOG/$name.log" | tail -25 >> "$LOG/summary.txt"
    echo "rc=$rc" | tee -a "$LOG/summary.txt"
}

# 1. the v4 illegal access combination with the keys_da kernel in 64-slot blocks (the new default)
step m128_blocks 120 python3 -m pytest -x -q -s tests/kernels/test_kernel_chunk.py -k "T1000_g4-4"
# 2. real-like inputs (aligned large q/k, long-memory gates, slot_bias -4) against float64
step real_like 150 python3 -m pytest -q -s tests/kernels/test_kernel_chunk.py -k "real_like"
# 3. the converted model's real weights against fp32 / float64 truth (needs the converted SmolLM2 folder)
if [ -n "$MODEL" ]; then
    step real_weights 150 python3 benchmarks/real_weights_check.py --model "$MODEL" --batch 4 --tokens 2048
fi
# 4. last (it may poison its own CUDA context): the v4 keys_da (all M=128 slots in one program), to confirm that
#    it is what faults
step m128_v4_keys_da 60 python3 -c "
import sys; sys.path[:0] = ['tests', 'tests/kernels']
from nha_retrofit.kernels import chunk_fwd
chunk_fwd.CONFIG['keys_da_slots'] = None
import test_kernel_chunk as t
t.test_forward_backward_matches_float64_reference(t.COMBOS[3])
print('v4 keys_da ran clean')"
cat "$LOG/summary.txt"
