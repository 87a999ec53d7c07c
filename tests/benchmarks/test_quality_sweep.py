"""benchmarks/quality_sweep.py --report: the quality-against-cost table of rows from different GPUs, each row's
retrieval the finetuned model's mean accuracy over the original's, per group, and its cache cost from its plan."""

import json
import random

import pytest
import quality_sweep


def suite_row(rng: random.Random, lengths: int = 4) -> tuple[dict, dict]:
    """A retrieval-suite result of two groups with random accuracies, and the expected ratio of means per group."""
    groups, ratios = {}, {}
    for group in ("tuning", "heldout"):
        tasks, sums = {}, {"nha": 0.0, "original": 0.0}
        for task in ("passkey", "multikey", "kv"):
            summary = {}
            for variant in ("nha", "original"):
                values = [rng.uniform(0.05, 1.0) for _ in range(lengths)]
                sums[variant] += sum(values)
                summary[variant] = [{"accuracy": v} for v in values]
            tasks[task] = {"summary": summary}
        groups[group] = {"tasks": tasks}
        ratios[group] = sums["nha"] / sums["original"]
    return {"groups": groups}, ratios


@pytest.mark.parametrize("seed", [0, 1])
def test_report_names_each_rows_gpu_and_its_retrieval_ratio(tmp_path, seed):
    rng = random.Random(seed)
    rows, expected = {}, {}
    settings = (("a", "1 x NVIDIA H200", [7, 14], 8.0, "full"), ("b", "1 x NVIDIA H100 80GB HBM3", [3], None, "lora"))
    for name, machine, layers, gate_bias, trainable in settings:
        suite, expected[name] = suite_row(rng)
        rows[name] = {"machine": machine, "trainable": trainable, "lm_tokens": 2_457_600,
                      "train_wall_time_s": rng.uniform(100, 500),
                      "suite": suite, "perplexity_ratio": {t: rng.uniform(0.8, 1.5) for t in
                                                           ("python-docs", "python-stdlib", "shakespeare")},
                      "plan": {"full_layer_ids": layers, "window": 256, "slots": 64, "layers": 30,
                               "gate_bias_init": gate_bias}}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": rows}))
    lines = quality_sweep.report(path, None).splitlines()
    assert lines[0].startswith("| setting | GPU |") and len(lines) == 4
    for line, (name, tag, gate_bias, trainable) in zip(lines[2:], (("a", "h200", "8", "full"),
                                                                   ("b", "h100", "-", "lora"))):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:2] == [name, tag] and cells[4:6] == [gate_bias, trainable]
        assert cells[8] == f"{expected[name]['tuning']:.2f} / {expected[name]['heldout']:.2f}"
        assert cells[11] == f"{rows[name]['perplexity_ratio']['shakespeare']:.3f}"
    # more full layers cost more cache at 8K
    assert float(lines[2].split("|")[13].split("/")[0]) > float(lines[3].split("|")[13].split("/")[0])


def test_full_kv_heads_cost_their_keys_and_values_per_token_instead_of_their_state():
    from nha_retrofit.plan import nha_state_bytes

    heads = [[layer, layer % 3] for layer in range(15)]
    costs = quality_sweep.cache_costs([256] * 30, 64, 30, kv_heads=3, head_dim=64, full_kv_heads=heads,
                                      swept_kv_heads=3)
    state = nha_state_bytes(3, 64, 64, 256, 2)
    head_state = nha_state_bytes(1, 64, 64, 256, 2) - nha_state_bytes(0, 64, 64, 256, 2)
    assert (costs["full_layers"], costs["full_kv_heads"]) == (0, 15)
    assert costs["cache_bytes_8192"] == 30 * state + 15 * (8192 * 2 * 64 * 2 - head_state)
    on_8b = quality_sweep.cache_costs([256] * 30, 64, full_kv_heads=heads, swept_kv_heads=3, **quality_sweep.LLAMA3_8B)
    assert on_8b["full_kv_heads"] == round(15 / 90 * 32 * 8)  # the same share of the 8B shape's 256 KV heads
    assert quality_sweep.full_attention({"full_layer_ids": [], "full_kv_heads": [[6, 0], [7, 2]]}) == "[] + 6:0 7:2"


def test_scoring_a_trained_variant_writes_its_row(tmp_path, tiny_checkpoint, tiny_finetuned_checkpoint):
    """`--skip-training --converted`: a trained variant (here a stand-in exported model) scored on the suite against
    the converted checkpoint's original, once through one forward and once through an fp8 full-layer cache, each a
    row with its machine, plan, perplexity ratios from its summary, and the table of both."""
    import shutil

    root, output = tmp_path / "runs", tmp_path / "sweep.json"
    shutil.copytree(tiny_finetuned_checkpoint, root / "tiny" / "model")
    summary = {"machine": "1 x NVIDIA H100 80GB HBM3", "trainable": "attention", "tokens": 4096, "wall_time_s": 12.5,
               "before": {f"{t}_original_ppl": 10.0 + i for i, t in enumerate(("python-docs", "python-stdlib",
                                                                                "shakespeare"))},
               "after": {f"{t}_ppl": 11.0 + 2 * i for i, t in enumerate(("python-docs", "python-stdlib",
                                                                         "shakespeare"))}}
    (root / "tiny" / "summary.json").write_text(json.dumps(summary))
    common = ["--variant", "tiny=train.lr=1e-4", "--root", str(root), "--converted", str(tiny_checkpoint),
              "--skip-training", "--tokens", "4096", "--lengths", "500", "--depths", "50", "--samples", "2",
              "--group", "tuning", "--output", str(output)]
    assert quality_sweep.main(common) == 0
    assert quality_sweep.main([*common, "--kv-cache-dtype", "float8_e4m3"]) == 0
    rows = json.loads(output.read_text())["rows"]
    assert list(rows) == ["tiny", "tiny+kv_float8_e4m3"]
    row = rows["tiny"]
    assert row["machine"] == summary["machine"] and row["overrides"] == ["train.lr=1e-4"]
    gate_bias = json.loads((tiny_finetuned_checkpoint / "config.json").read_text())["nha_gate_bias_init"]
    assert row["plan"] == {"full_layer_ids": [0], "full_kv_heads": [], "window": 8, "slots": 5, "layers": 4,
                           "gate_bias_init": gate_bias}
    assert row["trainable"] == "attention"
    assert row["perplexity_ratio"] == pytest.approx({"python-docs": 1.1, "python-stdlib": 13 / 11,
                                                     "shakespeare": 15 / 12})
    assert set(row["suite"]["groups"]) == {"tuning"} and "kv_cache" not in row["suite"]
    assert rows["tiny+kv_float8_e4m3"]["suite"]["kv_cache"] == "float8_e4m3"
    assert "float8_e4m3" in rows["tiny+kv_float8_e4m3"]["scorer"]
    lines = quality_sweep.report(output, None).splitlines()
    assert [line.split("|")[1:3] for line in lines[2:]] == [[" tiny ", " h100 "], [" tiny+kv_float8_e4m3 ", " h100 "]]
    one_cell = tmp_path / "cell.json"
    assert quality_sweep.main([*common[:-1], str(one_cell), "--tasks", "niah_word"]) == 0
    row = json.loads(one_cell.read_text())["rows"]["tiny"]
    assert list(row["suite"]["groups"]["tuning"]["tasks"]) == ["niah_word"] and "tasks niah_word" in row["scorer"]
