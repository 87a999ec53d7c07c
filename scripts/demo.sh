#!/usr/bin/env bash
# The main job on the embedded default, on CPU: convert SmolLM2-135M with the default plan (full attention in the 15 of
# its 90 KV heads that hold its retrieval heads, window 256, 64 slots),
# then finetune it with recipes/smollm2_demo.yaml (attention transfer, then CE + distillation from the original on
# Python standard-library code and Shakespeare, about 20 minutes on 2 cores), which reports held-out perplexity
# (original / converted before / after, on texts excluded from training) and exports a merged self-contained
# checkpoint; finally the exported model loads through transformers alone and generates.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/nha-retrofit convert smollm2-135m --output outputs/smollm2-135m-nha --overwrite
.venv/bin/nha-retrofit finetune recipes/smollm2_demo.yaml --overwrite \
    --set model.path=outputs/smollm2-135m-nha --set model.convert=null
.venv/bin/python - <<'PY'
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = "outputs/smollm2-demo/model"
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
prompt = "The three most important rules of writing readable Python code are"
ids = tokenizer(prompt, return_tensors="pt")
out = model.generate(**ids, max_new_tokens=40, do_sample=False)
print(prompt + tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
PY
