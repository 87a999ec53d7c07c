"""NHA hybrids of Hugging Face decoder models.

Each family's NHA attention is its original attention class plus a gate projection and a slot-logit offset:
the q/k/v/o weights (biases, Qwen3's q_norm/k_norm) and RoPE are the original layer's own. A layer whose
window is None runs the original attention code unchanged, with an ordinary KV cache; any other layer runs
the NHA operator, except on its full KV heads (`nha_full_kv_heads`), whose query heads attend over every position
with the model's attention function and cache those heads' keys and values. This file and the files it imports are
copied into converted checkpoints (remote code, `remote_code.py`), so it imports only torch, transformers and those
files; nha_retrofit's Triton kernels are used where nha_retrofit is installed (`ops/nha/dispatch.py`).
"""

import contextlib
import inspect

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb, eager_attention_forward
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

from .configuration_nha import NHALlamaConfig, NHAQwen2Config, NHAQwen3MoeConfig
from ..ops.nha.dispatch import nha_operator
from .decode_graph import DecodeGraph
from .fused_step import fused_decoder_layers, merge_projections
from .head_split import merge_heads, split_heads
from .nha_cache import NHACache, NHAStaticCache, StaticFullLayer


def operator_inputs(*tensors):
    """The operator's inputs in one dtype, as SDPA computes them: under autocast its dtype; otherwise the widest.
    Under autocast, q and k leave an fp32-weighted norm (Qwen3's q_norm/k_norm during training) in fp32 while v
    leaves its projection in bf16; mixed dtypes would send the operator to its PyTorch form."""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = tensors[0].dtype
        for tensor in tensors[1:]:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return tuple(tensor.to(dtype) for tensor in tensors)


class NHAAttentionMixin:
    """Adds NHA to a family's attention module (mixed in before the original class)."""

    rotary_fn = staticmethod(apply_rotary_pos_emb)
    # the small functions a fused decode step swaps for compiled ones (`fused_step.py`), `projections` too
    split_heads = staticmethod(split_heads)
    merge_heads = staticmethod(merge_heads)

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.window = config.nha_layer_windows[layer_idx]
        self.full_kv_heads = config.nha_layer_full_kv_heads[layer_idx]
        self._head_index_cache = {}
        self.num_slots = config.nha_num_slots
        self.gate_normalizer = config.nha_gate_normalizer
        self.num_kv_heads = config.num_key_value_heads
        self.g_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.num_slots,
                                bias=config.nha_gate_bias_init is not None)
        self.slot_bias = nn.Parameter(torch.full((config.num_attention_heads,), float(config.nha_slot_bias_init)))
        # Attention transfer: when True, each forward also runs the original full attention (no grad) on the same
        # projections and stores the MSE between the two layer outputs, over positions from `transfer_from` on, in
        # `transfer_loss`.
        self.attention_transfer = False
        self.transfer_from = 0
        self.transfer_loss = None
        # False: the slots get no softmax mass (slot logits -inf), so the layer is exactly sliding-window attention
        # over its window; the slot state is still kept. Set through the model's `slot_reads_disabled()`.
        self.slot_reads = True

    def project_qkv(self, hidden_states):
        """Pre-RoPE q [B, T, HQ, D], k and v [B, T, H, D], exactly as the original layer computes them."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        if hasattr(self, "q_norm"):  # Qwen3 families: per-head RMSNorm before RoPE (the slots see normed q/k too)
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, self.v_proj(hidden_states).view(shape)

    def rotary_qkv(self, hidden_states, position_embeddings):
        """(q, k, v, q_rope, k_rope): the projections before RoPE (the slots read them) and q, k after it."""
        q, k, v = self.project_qkv(hidden_states)
        cos, sin = position_embeddings
        return q, k, v, *self.rotary_fn(q, k, cos, sin, unsqueeze_dim=2)

    def gate_logits(self, hidden_states):
        """The gate logits f = g_proj(x) per KV head and slot, [B, T, H, M] (log(alpha) = logsigmoid(f) / tau); a
        positive bias in g_proj lengthens every slot's memory (alpha nearer 1)."""
        return self.g_proj(hidden_states).view(*hidden_states.shape[:-1], self.num_kv_heads, self.num_slots)

    def projections(self, hidden_states, position_embeddings):
        """(q, k, v, q_rope, k_rope, gate logits): `rotary_qkv`'s tensors and, in an NHA layer, `gate_logits`' (None in
        a full layer), from one method, so that a fused decode step computes them with one matmul."""
        gates = self.gate_logits(hidden_states) if self.window is not None else None
        return *self.rotary_qkv(hidden_states, position_embeddings), gates

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        padding_mask = kwargs.pop("nha_padding_mask", None)
        if self.window is None:  # a full layer: the original attention, positional args across transformers 5.x
            if cache is not None and hidden_states.shape[1] == 1 and isinstance(cache.layers[self.layer_idx],
                                                                                StaticFullLayer):
                return self._decode_on_static_cache(hidden_states, position_embeddings, cache.layers[self.layer_idx])
            return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)

        batch, length = hidden_states.shape[:2]
        *projected, gate_logits = self.projections(hidden_states, position_embeddings)
        q, k, v, q_rope, k_rope = operator_inputs(*projected)
        layer_cache = cache.layers[self.layer_idx] if cache is not None else None
        slot_bias = self.slot_bias if self.slot_reads else torch.full_like(self.slot_bias, float("-inf"))
        if self.full_kv_heads:
            index = self._head_index(q.device)
            (q, k, v, q_rope, k_rope, gate_logits, slot_bias), full = self.split_heads(
                index, q, k, v, q_rope, k_rope, gate_logits, slot_bias)
            full = self._full_heads_attention(*full, attention_mask, layer_cache, kwargs)
        out, state = nha_operator(
            q, k, v, q_rope, k_rope, gate_logits, self.gate_normalizer, self.window, self.scaling,
            padding_mask, slot_bias, layer_cache.state if layer_cache is not None else None,
            layer_cache is not None,
        )
        if layer_cache is not None:
            layer_cache.store(state, length)
        if self.full_kv_heads:
            out = self.merge_heads(index[-1], out, full)
        output = self.o_proj(out.reshape(batch, length, -1))
        if self.attention_transfer:
            self.transfer_loss = self._transfer_loss(output, hidden_states, position_embeddings, attention_mask,
                                                     padding_mask, kwargs)
        return output, None

    def _head_index(self, device):
        """(NHA KV heads, their query heads, full KV heads, their query heads, order) as index tensors on `device`;
        `order` puts the query heads of [NHA outputs, full outputs] back in the layer's head order."""
        if device not in self._head_index_cache:
            groups = self.config.num_attention_heads // self.num_kv_heads
            full = list(self.full_kv_heads)
            nha = [head for head in range(self.num_kv_heads) if head not in full]
            query = lambda heads: [head * groups + i for head in heads for i in range(groups)]
            ordered = query(nha) + query(full)
            order = sorted(range(len(ordered)), key=ordered.__getitem__)
            self._head_index_cache[device] = tuple(torch.tensor(ids, dtype=torch.long, device=device)
                                                   for ids in (nha, query(nha), full, query(full), order))
        return self._head_index_cache[device]

    def _full_heads_attention(self, q, k, v, attention_mask, layer_cache, kwargs):
        """The full KV heads' attention, as the original layer computes it (q, k post-RoPE; [B, T, heads, D]): their
        keys and values join the layer cache's full part, and the model's attention function reads them with the mask
        full layers get; a one-token step on a static cache reads every stored position (`StaticFullLayer.decode`)."""
        if isinstance(layer_cache, StaticFullLayer) and q.shape[1] == 1:
            return layer_cache.decode(q, k, v, self.scaling)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if layer_cache is not None:
            k, v = layer_cache.update(k, v)
        implementation = self.config._attn_implementation
        attend = eager_attention_forward if implementation == "eager" else ALL_ATTENTION_FUNCTIONS[implementation]
        out, _ = attend(self, q.transpose(1, 2), k, v, attention_mask,
                        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
        return out

    def _decode_on_static_cache(self, hidden_states, position_embeddings, layer_cache):
        """A full layer's one-token step on a static cache: the original projections and RoPE, then attention over the
        cache's stored positions (`StaticFullLayer.decode`: no mask over the whole cache, no per-head copies)."""
        _, _, v, q, k, _ = self.projections(hidden_states, position_embeddings)
        out = layer_cache.decode(q, k, v, self.scaling)
        return self.o_proj(out.reshape(*hidden_states.shape[:2], -1)), None

    def _transfer_loss(self, output, hidden_states, position_embeddings, attention_mask, padding_mask, kwargs):
        """MSE to what the original (full-attention) layer outputs for the same input, over real tokens from
        position `transfer_from` on (a block no longer than that gives a zero that still reaches the graph)."""
        if output.shape[1] <= self.transfer_from:
            return output.float().sum() * 0.0
        with torch.no_grad():
            target, _ = super().forward(hidden_states, position_embeddings, attention_mask, None, **kwargs)
        error = (output.float() - target.float()).pow(2).mean(-1)[:, self.transfer_from :]
        if padding_mask is None:
            return error.mean()
        real = padding_mask[:, -output.shape[1] :][:, self.transfer_from :].to(error.dtype)
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
                if module.g_proj.bias is not None:
                    module.g_proj.bias.fill_(self.config.nha_gate_bias_init)

    def nha_attention_layers(self):
        return [layer.self_attn for layer in self.model.layers]

    def set_windows(self, windows, full_kv_heads=None):
        """Change every layer's window at inference time (int >= 0, or None = full attention) and, when given, its
        full KV heads (one list per layer); the new plan is written to `config.nha_windows` and
        `config.nha_full_kv_heads`, so it is what `save_pretrained` records. Without `full_kv_heads`, a layer made
        full drops its full KV heads (all of its heads are full then) and the others keep theirs."""
        windows = list(windows)
        previous = self.config.nha_windows, self.config.nha_full_kv_heads
        self.config.nha_windows = windows
        if full_kv_heads is not None:
            self.config.nha_full_kv_heads = [list(heads) for heads in full_kv_heads]
        elif previous[1] is not None:
            self.config.nha_full_kv_heads = [[] if window is None else heads
                                             for window, heads in zip(windows, previous[1])]
        try:
            self.config.validate_nha()
        except ValueError:
            self.config.nha_windows, self.config.nha_full_kv_heads = previous
            raise
        for attention, window, heads in zip(self.nha_attention_layers(), windows,
                                            self.config.nha_layer_full_kv_heads):
            attention.window, attention.full_kv_heads = window, heads
            attention._head_index_cache.clear()

    @contextlib.contextmanager
    def slot_reads_disabled(self):
        """Inside: every NHA layer attends to its window alone (its slots get no softmax mass), the sliding-window
        baseline of the same weights and windows; full layers are unchanged. A layer of window 0 then sees nothing
        and outputs zeros."""
        layers = self.nha_attention_layers()
        previous = [attention.slot_reads for attention in layers]
        for attention in layers:
            attention.slot_reads = False
        try:
            yield self
        finally:
            for attention, reads in zip(layers, previous):
                attention.slot_reads = reads

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """transformers reads this from the source of the class's own module (this one); the experts are the original
        family's modules, so the original class answers (Qwen3-MoE: yes, so its experts run grouped, not one by one)."""
        return cls.__bases__[-1]._can_set_experts_implementation()

    def _prepare_static_cache(self, cache_implementation, batch_size, max_cache_len, prefill_chunk_size, model_kwargs):
        """`generate(..., cache_implementation="static")`: an `NHAStaticCache` for the whole generation, whose
        one-token steps replay a CUDA graph on CUDA (transformers' own StaticCache holds no NHA state)."""
        if cache_implementation != "static":
            raise ValueError(f"cache_implementation={cache_implementation!r}: an NHA model takes 'static' or the "
                             "default dynamic cache")
        return NHAStaticCache(self.config, batch_size, max_cache_len, self.dtype, self.device)

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
        if use_cache and not isinstance(cache, (NHACache, NHAStaticCache)):
            if cache is not None and cache.get_seq_length() > 0:
                raise TypeError(f"an NHA model needs an NHACache, got a filled {type(cache).__name__}")
            cache = NHACache(self.config)
        tokens = input_ids if input_ids is not None else inputs_embeds
        if attention_mask is not None and attention_mask.dim() == 2:
            # a one-token step reads only its own column: passed on without a device sync to learn whether all are 1
            if tokens.shape[1] == 1 or not bool(attention_mask.all()):
                kwargs["nha_padding_mask"] = attention_mask
        if (isinstance(cache, NHAStaticCache) and cache.cuda_graph and input_ids is not None and input_ids.shape[1] == 1
                and labels is None and not kwargs.get("output_attentions") and not kwargs.get("output_hidden_states")
                and self._decode_capturable() and not torch.cuda.is_current_stream_capturing()):
            return self._replayed_step(input_ids, position_ids, kwargs.get("nha_padding_mask"), cache)
        return self._step(input_ids, attention_mask, position_ids, inputs_embeds, labels, use_cache, logits_to_keep,
                          cache, **kwargs)

    def _step(self, input_ids, attention_mask, position_ids, inputs_embeds, labels, use_cache, logits_to_keep, cache,
              **kwargs):
        """One eager forward on `cache` (None, an `NHACache` or an `NHAStaticCache`)."""
        tokens = input_ids if input_ids is not None else inputs_embeds
        static = isinstance(cache, NHAStaticCache)
        if static:
            cache.positions.admit(tokens.shape[1], kwargs.get("nha_padding_mask"))
            if tokens.shape[1] == 1:  # its layers read the cache's real-token flags, not transformers' masks
                attention_mask = None
        kwargs[CACHE_ARGUMENT] = cache
        # cuDNN's SDPA plans anew for every key length: ~35 ms of CPU per decode step on an H200 (torch 2.11). The
        # full layers' decode steps use the other SDPA backends, set once per model step (a switch costs host time).
        decoding_on_gpu = tokens is not None and tokens.is_cuda and tokens.shape[1] == 1
        with sdpa_kernel(_DECODE_SDPA_BACKENDS) if decoding_on_gpu else contextlib.nullcontext():
            output = super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        if static:
            cache.positions.advance(tokens.shape[1])
        return output

    def _decode_capturable(self) -> bool:
        """Whether a one-token step can be captured as a CUDA graph: not with MoE experts in transformers' eager form,
        which finds each expert's tokens with a host sync."""
        return not hasattr(self.config, "num_experts") or self.config._experts_implementation != "eager"

    def _replayed_step(self, input_ids, position_ids, token_mask, cache):
        """A one-token step on a static CUDA cache through its `DecodeGraph` (captured at the first such step), each
        decoder layer's small work between its matmuls fused (`fused_step.py`)."""
        if cache.decode_graph is None:
            merge_projections(self.model.layers)  # before the graph's first step, on this stream (`fused_step.py`)
            cache.decode_graph = DecodeGraph(input_ids.shape[0], input_ids.device)
        if position_ids is None:  # as the model would compute them: after the filled positions
            position_ids = cache.positions.length.view(1, 1).expand(input_ids.shape[0], 1)

        def step(ids, positions, mask):
            with fused_decoder_layers(self.model.layers):
                return self._step(ids, None, positions, None, None, True, 1, cache, nha_padding_mask=mask)

        output = cache.decode_graph(step, input_ids, position_ids, token_mask)
        output[CACHE_ARGUMENT] = cache
        return output


_DECODE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# The keyword a model's forward takes its generation cache under: transformers renamed `past_key_values` to `cache`
# during 5.x, and this is whichever the installed version's models take.
CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


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
