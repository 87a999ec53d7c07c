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
    for name, machine, layers in (("a", "1 x NVIDIA H200", [7, 14]), ("b", "1 x NVIDIA H100 80GB HBM3", [3])):
        suite, expected[name] = suite_row(rng)
        rows[name] = {"machine": machine, "lm_tokens": 2_457_600, "train_wall_time_s": rng.uniform(100, 500),
                      "suite": suite, "perplexity_ratio": {t: rng.uniform(0.8, 1.5) for t in
                                                           ("python-docs", "python-stdlib", "shakespeare")},
                      "plan": {"full_layer_ids": layers, "window": 256, "slots": 64, "layers": 30}}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": rows}))
    lines = quality_sweep.report(path, None).splitlines()
    assert lines[0].startswith("| setting | GPU |") and len(lines) == 4
    for line, (name, tag) in zip(lines[2:], (("a", "h200"), ("b", "h100"))):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:2] == [name, tag]
        assert cells[6] == f"{expected[name]['tuning']:.2f} / {expected[name]['heldout']:.2f}"
        assert cells[9] == f"{rows[name]['perplexity_ratio']['shakespeare']:.3f}"
    # more full layers cost more cache at 8K
    assert float(lines[2].split("|")[11].split("/")[0]) > float(lines[3].split("|")[11].split("/")[0])
