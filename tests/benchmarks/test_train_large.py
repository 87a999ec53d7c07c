"""benchmarks/train_large.py --quick: every part of the real-size training benchmark at tiny shapes on the CPU
(convert, the recipe with transfer and distillation, the side-by-side with the original and its profile, a run
killed between checkpoints and resumed, the export loaded and generating, the MoE recipe with LoRA); and how GPU
kernels are attributed."""

import json

import pytest

import train_large
from ft_helpers import byte_tokenizer


@pytest.mark.parametrize("name, category", [
    ("_fwd_kernel", "nha"), ("_dkv_kernel", "nha"), ("_chained_scan_kernel", "nha"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>, true>(Flash_fwd_params)", "sdpa"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "sdpa"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"), ("nvjet_hsh_256x128_64x4", "matmul"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
])
def test_kernels_are_attributed_by_name(name, category):
    assert train_large.kernel_category(name) == category


def test_stage_rates_leave_out_each_stage_warm_up():
    rows = [{"step": 1, "stage": "attention_transfer", "tokens": 100, "elapsed_s": 9.0},
            {"step": 2, "stage": "attention_transfer", "tokens": 200, "elapsed_s": 10.0},
            {"step": 3, "stage": "lm", "tokens": 300, "elapsed_s": 15.0},
            {"step": 4, "stage": "lm", "tokens": 400, "elapsed_s": 17.0},
            {"step": 5, "stage": "lm", "tokens": 500, "elapsed_s": 19.0}]
    assert train_large.stage_rates(rows) == {"attention_transfer": 100, "lm": 50}


@pytest.mark.slow
def test_every_part_runs_at_tiny_shapes(tmp_path):
    for family in ("llama", "qwen3_moe"):
        byte_tokenizer().save_pretrained(tmp_path / "tokenizers" / family)
    results = train_large.main(["run", "--quick", "--workdir", str(tmp_path / "work"), "--tokenizers",
                                str(tmp_path / "tokenizers")])
    parts = results["parts"]
    assert not [name for name, part in parts.items() if "failed" in part], parts
    assert parts["convert"]["convert_s"] > 0 and parts["convert"]["converted_gb"] >= 0
    train = parts["train"]
    assert train["steps"] == 7 and all(train["tokens_per_s"][stage] > 0 for stage in ("attention_transfer", "lm"))
    assert [row["context"] for row in train["side_by_side"]] == [32, 32, 64, 64]
    for row in train["side_by_side"]:
        assert row["tokens_per_s"] > 0 and row["objective"] == "CE"
        if row["model"] == "NHA":
            shares = [v for k, v in row["profile"].items() if k.endswith("_share")]
            assert abs(sum(shares) - 1) < 1e-3 and row["profile"]["profiled_ms"] > 0
    assert train["no_gradient_checkpointing"]["tokens_per_s"] > 0
    assert train["projection_10b_8_gpus"]["hours"] > 0 and train["projected_gib_8_gpus_fsdp"]["sharding"] == "fsdp"
    kill, resume = parts["kill"], parts["resume"]
    assert kill["exit_signal"] == 9 and kill["checkpoints_left"] == ["step-00000002"]
    assert resume["steps_compared"] == [3, 4, 5, 6, 7] and resume["max_abs_difference"] < 1e-6
    assert resume["loss_resumed"] == pytest.approx(resume["loss_uninterrupted"], abs=1e-6)
    assert resume["resume_s"] is not None and resume["export_s"] is not None
    assert parts["export"]["new_tokens"] == 32 and parts["export"]["class"] == "NHALlamaForCausalLM"
    moe = parts["moe"]
    assert moe["trainable_parameters"] < moe["total_parameters"] / 2 and len(moe["side_by_side"]) == 2
    assert all(set(parts[name]) >= {"not_run"} for name in ("fsdp", "scaling", "zero3"))  # GPU parts
    saved = json.loads((tmp_path / "work" / "train_large_quick.json").read_text())
    assert saved["parts"].keys() == parts.keys()
    assert "| NHA | 64 |" in (tmp_path / "work" / "train_large_quick.md").read_text()


def test_launched_parts_report_all_processes_and_the_scaling_efficiency():
    def launched(processes, per_process):
        step = {"context": 2048, "model": "NHA", "tokens_per_s": per_process, "profile": {"nha_share": 0.1}}
        return {"steps": [step], "processes": processes, "peak_gib": 40.0, "projected_gib": {"total": 44.0}}

    results = {"machine": "test", "date": "today", "parts": {"fsdp": launched(1, 1000), "scaling": launched(4, 900)}}
    text = train_large.markdown(results)
    assert "| scaling | 4 | 8B, 2048 | 3,600 | 40.0 (44.0) | 10.0% |" in text
    assert "Scaling efficiency on 4 GPUs: 90.0% of 4 x the one-GPU rate (1,000)." in text
