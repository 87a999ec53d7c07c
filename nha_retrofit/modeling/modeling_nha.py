"""NHA hybrids of Hugging Face decoder models.

Each family's NHA attention is its original attention class plus a gate projection and a slot-logit offset:
the q/k/v/o weights (biases, Qwen3's q_norm/k_norm) and RoPE are the original layer's own. A layer whose
window is None runs the original attention code unchanged, with an ordinary KV cache; any other layer runs
the NHA operator. This file and the files it imports are copied into converted checkpoints (remote code,
`remote_code.py`), so it imports only torch, transformers and those files; nha_retrofit's Triton kernels are used
where nha_retrofit is installed (`ops/nha/dispatch.py`).
"""

import contextlib
import inspect

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

from .configuration_nha import NHALlamaConfig, NHAQwen2Config, NHAQwen3MoeConfig
from ..ops.nha.dispatch import nha_operator
from .nha_cache import NHACache


class NHAAttentionMixin:
    """Adds NHA to a family's attention module (mixed in before the original class)."""

    rotary_fn = staticmethod(apply_rotary_pos_emb)

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.window = config.nha_layer_windows[layer_idx]
        self.num_slots = config.nha_num_slots
        self.gate_normalizer = config.nha_gate_normalizer
        self.num_kv_heads = config.num_key_value_heads
        self.g_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.num_slots, bias=False)
        self.slot_bias = nn.Parameter(torch.full((config.num_attention_heads,), float(config.nha_slot_bias_init)))
        # Attention transfer: when True, each forward also runs the original full attention (no grad) on the same
        # projections and stores the MSE between the two layer outputs in `transfer_loss`.
        self.attention_transfer = False
        self.transfer_loss = None

    def project_qkv(self, hidden_states):
        """Pre-RoPE q [B, T, HQ, D], k and v [B, T, H, D], exactly as the original layer computes them."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        if hasattr(self, "q_norm"):  # Qwen3 families: per-head RMSNorm before RoPE (the slots see normed q/k too)
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, self.v_proj(hidden_states).view(shape)

    def gate_logits(self, hidden_states):
        """The gate logits f = g_proj(x) per KV head and slot, [B, T, H, M] (log(alpha) = logsigmoid(f) / tau)."""
        return self.g_proj(hidden_states).view(*hidden_states.shape[:-1], self.num_kv_heads, self.num_slots)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        padding_mask = kwargs.pop("nha_padding_mask", None)
        if self.window is None:  # a full layer: the original attention, positional args across transformers 5.x
            return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)

        batch, length = hidden_states.shape[:2]
        q, k, v = self.project_qkv(hidden_states)
        cos, sin = position_embeddings
        q_rope, k_rope = self.rotary_fn(q, k, cos, sin, unsqueeze_dim=2)
        layer_cache = cache.layers[self.layer_idx] if cache is not None else None
        out, state = nha_operator(
            q, k, v, q_rope, k_rope, self.gate_logits(hidden_states), self.gate_normalizer, self.window, self.scaling,
            padding_mask, self.slot_bias, layer_cache.state if layer_cache is not None else None,
            layer_cache is not None,
        )
        if layer_cache is not None:
            layer_cache.store(state, length)
        output = self.o_proj(out.reshape(batch, length, -1))
        if self.attention_transfer:
            self.transfer_loss = self._transfer_loss(output, hidden_states, position_embeddings, attention_mask,
                                                     padding_mask, kwargs)
        return output, None

    def _transfer_loss(self, output, hidden_states, position_embeddings, attention_mask, padding_mask, kwargs):
        """MSE to what the original (full-attention) layer outputs for the same input, over real tokens."""
        with torch.no_grad():
            target, _ = super().forward(hidden_states, position_embeddings, attention_mask, None, **kwargs)
        error = (output.float() - target.float()).pow(2).mean(-1)
        if padding_mask is None:
            return error.mean()
        real = padding_mask[:, -output.shape[1] :].to(error.dtype)
        return (error * real).sum() / real.sum().clamp(min=1)


class NHAForCausalLMMixin:
    """Swaps in NHA attention, owns the NHA cache, routes the 2-D padding mask, and changes windows."""

    nha_attention_class: type

    def __init__(self, config):
        super().__init__(config)
        for layer_idx, layer in enumerate(self.model.layers):
            layer.self_attn = self.nha_attention_class(config, layer_idx)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, NHAAttentionMixin):
            with torch.no_grad():
                module.slot_bias.fill_(self.config.nha_slot_bias_init)

    def nha_attention_layers(self):
        return [layer.self_attn for layer in self.model.layers]

    def set_windows(self, windows):
        """Change every layer's window at inference time (int >= 0, or None = full attention); the new plan is
        written to `config.nha_windows`, so it is what `save_pretrained` records."""
        windows = list(windows)
        previous = self.config.nha_windows
        self.config.nha_windows = windows
        try:
            self.config.validate_nha()
        except ValueError:
            self.config.nha_windows = previous
            raise
        for attention, window in zip(self.nha_attention_layers(), windows):
            attention.window = window

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        cache=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and not isinstance(cache, NHACache):
            if cache is not None and cache.get_seq_length() > 0:
                raise TypeError(f"an NHA model needs an NHACache, got a filled {type(cache).__name__}")
            cache = NHACache(self.config)
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            kwargs["nha_padding_mask"] = attention_mask
        kwargs[_CACHE_ARGUMENT] = cache
        # cuDNN's SDPA plans anew for every key length: ~35 ms of CPU per decode step on an H200 (torch 2.11). The
        # full layers' decode steps use the other SDPA backends, set once per model step (a switch costs host time).
        tokens = input_ids if input_ids is not None else inputs_embeds
        decoding_on_gpu = tokens is not None and tokens.is_cuda and tokens.shape[1] == 1
        with sdpa_kernel(_DECODE_SDPA_BACKENDS) if decoding_on_gpu else contextlib.nullcontext():
            return super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )


_DECODE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# transformers renamed `past_key_values` to `cache` during 5.x; pass whichever this version's models take.
_CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class NHALlamaAttention(NHAAttentionMixin, LlamaAttention):
    pass


class NHALlamaForCausalLM(NHAForCausalLMMixin, LlamaForCausalLM):
    config_class = NHALlamaConfig
    nha_attention_class = NHALlamaAttention


class NHAQwen2Attention(NHAAttentionMixin, Qwen2Attention):
    pass


class NHAQwen2ForCausalLM(NHAForCausalLMMixin, Qwen2ForCausalLM):
    config_class = NHAQwen2Config
    nha_attention_class = NHAQwen2Attention


class NHAQwen3MoeAttention(NHAAttentionMixin, Qwen3MoeAttention):
    pass


class NHAQwen3MoeForCausalLM(NHAForCausalLMMixin, Qwen3MoeForCausalLM):
    """Experts, router, mlp_only_layers and decoder_sparse_step are the original's; router logits and the aux loss
    are returned as usual (`output_router_logits=True`)."""

    config_class = NHAQwen3MoeConfig
    nha_attention_class = NHAQwen3MoeAttention


# model_type of the original family -> its NHA model class
NHA_MODEL_CLASSES = {
    "llama": NHALlamaForCausalLM,
    "qwen2": NHAQwen2ForCausalLM,
    "qwen3_moe": NHAQwen3MoeForCausalLM,
}


def _share_checkpoint_conversions():
    """transformers rewrites some checkpoints while loading (Qwen3-MoE experts are stored per expert and fused in
    memory) by model_type; NHA model types load and save the original's files, so they get the same rewrites."""
    for original_type, model_class in NHA_MODEL_CLASSES.items():
        mapping = get_checkpoint_conversion_mapping(original_type)
        if mapping is not None:
            register_checkpoint_conversion_mapping(model_class.config_class.model_type, mapping, overwrite=True)


_share_checkpoint_conversions()
