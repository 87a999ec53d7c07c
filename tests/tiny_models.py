"""Small randomly initialised models for fast tests (the real SmolLM2 is used only in a few end-to-end tests)."""

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


def tiny_nha_pair(windows, slots=5, seed=0, slot_bias_init=-1.0, **overrides):
    """An original tiny Llama and an NHA model sharing its weights (random gates), in eval mode."""
    original = tiny_llama(seed, **overrides)
    config = NHALlamaConfig(
        **{**TINY_LLAMA, **overrides}, nha_windows=list(windows), nha_num_slots=slots, nha_slot_bias_init=slot_bias_init
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
