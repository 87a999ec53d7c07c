"""One short end-to-end run on the real SmolLM2 (converted once per pytest run, see conftest.py): transfer,
distillation, export, then the export loads through transformers' remote code and generates."""

import json

import torch

from nha_retrofit.finetune import finetune


def test_smollm2_short_run_exports_a_loadable_checkpoint(smollm2_nha, tmp_path):
    source, converted = smollm2_nha
    recipe = {
        "model": {"path": str(converted)},
        "data": {"files": ["{stdlib}/bisect.py", "{stdlib}/shlex.py"], "seq_len": 64, "eval_blocks": 1},
        "train": {"batch_size": 1, "output_dir": str(tmp_path / "run"), "threads": 2, "lr": 1e-4},
        "stages": {"attention_transfer": {"tokens": 64}, "lm": {"tokens": 64, "ce_weight": 0.5, "distill_weight": 1.0}},
    }
    summary = finetune(recipe, log=lambda *_: None)
    assert summary["steps"] == 2 and summary["before"]["original_eval_ppl"] > 1
    folder = tmp_path / "run" / "model"
    record = json.loads((folder / "nha_conversion.json").read_text())
    assert record["source_path"] == str(source) and record["finetune"]["tokens"] == 128
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert model.config.nha_windows.count(None) == 4
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("def main():", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 3 and torch.isfinite(model(**ids).logits).all()
