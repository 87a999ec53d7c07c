"""Small randomly initialised models for fast tests (the real SmolLM2 is used only in a few end-to-end tests)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nha_retrofit.modeling.configuration_nha import NHALlamaConfig
from nha_retrofit.modeling.modeling_nha import NHALlamaForCausalLM

TINY_LLAMA = dict(
    vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def tiny_llama(seed=0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval()


def tiny_nha_pair(windows, slots=5, seed=0, slot_bias_init=-1.0, full_kv_heads=None, **overrides):
    """An original tiny Llama and an NHA model sharing its weights (random gates), in eval mode."""
    original = tiny_llama(seed, **overrides)
    config = NHALlamaConfig(
        **{**TINY_LLAMA, **overrides}, nha_windows=list(windows), nha_num_slots=slots, nha_slot_bias_init=slot_bias_init,
        nha_full_kv_heads=full_kv_heads,
    )
    torch.manual_seed(seed + 1)
    nha = NHALlamaForCausalLM(config).eval()
    nha.load_state_dict(original.state_dict(), strict=False)
    return original, nha


def left_padded_ids(lengths, total, vocab=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), total, dtype=torch.long)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, total - n :] = torch.randint(3, vocab, (n,), generator=gen)
        mask[b, total - n :] = 1
    return ids, mask


# Small random models keeping each real config's structure (GQA ratio, biases, norms, rope, MoE routing).
FAMILY_CONFIGS = {
    "llama3": dict(  # Meta-Llama-3-8B: GQA 4:1, llama3 rope scaling, vocab of the real tokenizer
        model_type="llama", vocab_size=128256, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
        bos_token_id=128000, eos_token_id=128001,
    ),
    "qwen2.5": dict(  # Qwen2.5-7B: GQA 7:1, q/k/v biases, its own (disabled) sliding-window fields
        model_type="qwen2", vocab_size=151936, hidden_size=56, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=7, num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, use_sliding_window=False,
        sliding_window=128, max_window_layers=4, eos_token_id=151643,
    ),
    "qwen3_moe": dict(  # Qwen3-30B-A3B: GQA 8:1 scaled down, head_dim set apart, q/k norms, routed experts
        model_type="qwen3_moe", vocab_size=151936, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[0], norm_topk_prob=True,
        max_position_embeddings=1024, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, eos_token_id=151643,
    ),
}


def tiny_family_model(family: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(FAMILY_CONFIGS[family])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def families(*slow):
    """Parametrize a test's `family` fixture (tests/conftest.py) over every family, those named in `slow` in the slow
    test tier."""
    return pytest.mark.parametrize("family", [pytest.param(name, marks=pytest.mark.slow) if name in slow else name
                                              for name in FAMILY_CONFIGS], indirect=True)
