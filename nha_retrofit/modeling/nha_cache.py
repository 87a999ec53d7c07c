"""The generation caches of NHA hybrids: an ordinary KV cache for full layers, a fixed-size state for NHA layers,
and both for an NHA layer with full KV heads (the full heads' keys and values, the other heads' state).

`NHACache` grows its full layers' keys and values token by token (transformers' `DynamicLayer`). `NHAStaticCache`
allocates everything once, for a maximum length, and updates it in place: the full layers' keys and values, the NHA
layers' slots and window ring, and the positions written so far, all on the device. A decode step on it changes no
Python state and allocates nothing that outlives it, so it can be captured once as a CUDA graph and replayed
(`decode_graph.py`); `generate(..., cache_implementation="static")` builds one.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..ops.nha.dispatch import float8_stored_attention
from ..ops.nha.state import NHAState


class NHACacheLayer(CacheLayerMixin):
    """One NHA layer's `NHAState` (slots + the last `window` tokens): its size does not grow with the sequence,
    and decode steps update it in place (the window is a ring buffer, `NHAState`).

    It reports itself as sliding so that transformers' mask builders size the causal mask from a full-attention
    layer; NHA layers build their own masks from the 2-D padding mask.
    """

    is_sliding = True
    is_compileable = False
    is_croppable = False  # absorbed tokens cannot be taken back out of the slots
    supports_early_init = False

    def __init__(self):
        super().__init__()
        self.state: NHAState | None = None
        self.seen_tokens = 0

    def store(self, state: NHAState, new_tokens: int) -> None:
        self.state = state
        self.seen_tokens += new_tokens
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        raise NotImplementedError("NHA cache layers are filled with `store`, not with key/value states")

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("NHA cache layers are filled with `store`, not with key/value states")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def state_bytes(self) -> int:
        """Bytes of memory the state keeps alive: its tensors' storages, once each (a view keeps all of the tensor
        it views alive, and would count as such)."""
        if self.state is None:
            return 0
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.state.tensors()}
        return sum(storages.values())

    def _map_state(self, fn) -> None:
        if self.state is not None:
            self.state = self.state.map(fn)

    def reset(self) -> None:
        self.state, self.seen_tokens, self.is_initialized = None, 0, False

    def offload(self):
        self._map_state(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.state is not None and self.state.slot_keys.device != self.device:
            self._map_state(lambda t: t.to(self.device, non_blocking=True))

    def reorder_cache(self, beam_idx) -> None:
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self._map_state(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("an NHA cache cannot be cropped: absorbed tokens cannot be removed")


class NHAHeadsPart:
    """What a layer with full KV heads shows the NHA operator: the state and `store` of its `nha` part (the other
    heads' cache layer), and that part's bytes."""

    nha: CacheLayerMixin

    @property
    def state(self) -> NHAState | None:
        return self.nha.state

    def store(self, state: NHAState, new_tokens: int) -> None:
        self.nha.store(state, new_tokens)

    def state_bytes(self) -> int:
        return self.nha.state_bytes()


class MixedCacheLayer(NHAHeadsPart, DynamicLayer):
    """An NHA layer with full KV heads: those heads' keys and values grow as a `DynamicLayer`'s (a full layer, to
    transformers' mask builders), the other heads' `NHAState` is kept by `nha` (an `NHACacheLayer`)."""

    def __init__(self):
        super().__init__()
        self.nha = NHACacheLayer()

    def reset(self) -> None:
        super().reset()
        self.nha.reset()

    def offload(self):
        super().offload()
        self.nha.offload()

    def prefetch(self):
        super().prefetch()
        self.nha.prefetch()

    def reorder_cache(self, beam_idx) -> None:
        super().reorder_cache(beam_idx)
        self.nha.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.nha.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        super().batch_select_indices(indices)
        self.nha.batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        self.nha.crop(tokens_to_remove)


class NHACache(Cache):
    """Built from the model config's plan: `DynamicLayer` for full layers, `NHACacheLayer` for NHA layers,
    `MixedCacheLayer` for NHA layers with full KV heads."""

    def __init__(self, config):
        layers = [DynamicLayer() if window is None else MixedCacheLayer() if heads else NHACacheLayer()
                  for window, heads in zip(config.nha_layer_windows, config.nha_layer_full_kv_heads)]
        super().__init__(layers=layers)

    def nha_state_bytes(self) -> list[int]:
        """Bytes held by each layer's NHA state (0 for full layers, which hold an ordinary growing KV cache; an NHA
        layer's full heads hold one too, not counted here)."""
        return [layer.state_bytes() if isinstance(layer, (NHACacheLayer, MixedCacheLayer)) else 0
                for layer in self.layers]


# A static cache longer than this stores a multiple of SPLIT_TOKENS positions per full layer, and a decode step reads
# them in SPLIT_TOKENS-token slices (`attend_stored`), so that a long cache is read by many programs at once.
SPLIT_TOKENS = 256
SPLIT_FROM = 2048


def stored_length(max_cache_len: int) -> int:
    """The positions a static cache allocates for `max_cache_len` tokens (rounded up to whole slices when long)."""
    if max_cache_len <= SPLIT_FROM:
        return max_cache_len
    return -(-max_cache_len // SPLIT_TOKENS) * SPLIT_TOKENS


def attend_stored(query, keys, values, real, scale):
    """One query token per sequence [B, 1, HQ, D] against every stored position [B, H, L, D] whose `real` [B, L] flag
    is set, one softmax: [B, 1, HQ, Dv]. Grouped query heads read their key-value head's tensors in place (no copy per
    query head); scores and softmax in float32; a long cache's values are read in slices whose partial sums are added
    in float32."""
    batch, _, q_heads, head_dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    groups = q_heads // kv_heads
    q = query.reshape(batch, kv_heads, groups, head_dim)
    scores = torch.matmul(q, keys.transpose(2, 3)).float() * scale  # [B, H, G, L]
    probs = scores.masked_fill(~real[:, None, None, :], float("-inf")).softmax(-1).to(values.dtype)
    splits = length // SPLIT_TOKENS if length > SPLIT_FROM else 1
    sliced = probs.view(batch, kv_heads, groups, splits, length // splits).transpose(2, 3)
    parts = torch.matmul(sliced, values.view(batch, kv_heads, splits, length // splits, values.shape[-1]))
    return parts.sum(2, dtype=torch.float32).to(query.dtype).reshape(batch, 1, q_heads, values.shape[-1])


class StaticPositions:
    """The positions a static cache has filled (a device counter) and which of them hold real tokens, not padding
    ([B, L] flags), shared by its layers. A forward first `admit`s its tokens (their positions become `current`),
    and `advance`s the counter when done; a one-token step does both on the device, a prefill also learns the
    counter on the host (one device sync per prefill)."""

    def __init__(self, batch_size: int, length: int, device):
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.real = torch.zeros(batch_size, length, dtype=torch.bool, device=device)
        self.current = None  # [T] positions of the forward in progress
        self.prefill_end = 0  # positions filled once the prefill in progress is stored (host int, prefills only)

    def admit(self, new_tokens: int, attention_mask=None) -> None:
        """Before a forward of `new_tokens` tokens per sequence; `attention_mask` [B, >= T] (None: all real)."""
        if new_tokens > 1:
            start = int(self.length)
            if start + new_tokens > self.real.shape[1]:
                raise ValueError(f"this static cache holds {self.real.shape[1]} positions; {start} are filled and "
                                 f"{new_tokens} more were given")
            self.prefill_end = start + new_tokens
        self.current = self.length + torch.arange(new_tokens, device=self.length.device)
        batch = self.real.shape[0]
        real = (torch.ones(batch, new_tokens, dtype=torch.bool, device=self.real.device) if attention_mask is None
                else attention_mask[:, -new_tokens:].to(torch.bool))
        self.real.index_copy_(1, self.current, real)

    def advance(self, new_tokens: int) -> None:
        self.length.add_(new_tokens)

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, offset) for transformers' mask builders: a prefill attends to what is filled, a one-token step
        (which reads the cache through `attend_stored`, not those masks) to the whole cache."""
        return (self.prefill_end if query_length > 1 else self.real.shape[1]), 0

    def reset(self) -> None:
        self.length.zero_()
        self.real.fill_(False)


class _StaticLayer(CacheLayerMixin):
    """What the layers of a static cache share: their `StaticPositions`, a fixed batch and length, and no moves."""

    is_compileable = False  # the model replays its decode step from a CUDA graph instead
    is_croppable = False
    supports_early_init = False

    def __init__(self, positions: StaticPositions):
        super().__init__()
        self.positions = positions
        self.batch_size, self.max_cache_len = positions.real.shape
        self.device = positions.real.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass  # allocated at construction

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.positions.mask_sizes(query_length)

    def get_seq_length(self):
        return self.positions.length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reorder_cache(self, beam_idx) -> None:
        for tensor in self.tensors():
            tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))

    def offload(self):
        raise NotImplementedError("a static NHA cache stays on its device")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a static NHA cache keeps its batch size (see `NHAStaticCache.repeated`)")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("a static NHA cache keeps its batch size")


class StaticFullLayer(_StaticLayer):
    """A full-attention layer's keys and values [B, H, L, D], allocated once. A prefill runs the original attention
    (`update` stores its keys and values and hands back what it attends to); a one-token step stores its key and
    value at the current position and attends over the whole cache (`decode`).

    With `kv_dtype` float8 (e4m3), keys and values are stored in it with one float32 scale per position and head
    (`quantize`), and dequantized to the model's dtype where they are read: half the bytes of a bfloat16 cache, plus
    4 per head dimension's worth of scales."""

    is_sliding = False

    def __init__(self, positions: StaticPositions, kv_heads: int, head_dim: int, dtype, kv_dtype=None):
        super().__init__(positions)
        if kv_dtype not in (None, dtype, *FLOAT8_DTYPES):
            raise ValueError(f"keys and values are stored in the model's dtype or in float8, not in {kv_dtype}")
        self.dtype = dtype
        self.keys = torch.zeros(self.batch_size, kv_heads, self.max_cache_len, head_dim, dtype=kv_dtype or dtype,
                                device=self.device)
        self.values = torch.zeros_like(self.keys)
        self.quantized = self.keys.dtype in FLOAT8_DTYPES
        if self.quantized:
            self.key_scales = torch.ones(self.keys.shape[:3], dtype=torch.float32, device=self.device)
            self.value_scales = torch.ones_like(self.key_scales)

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values] + ([self.key_scales, self.value_scales] if self.quantized else [])

    def _store(self, keys, values) -> None:
        """Write keys and values [B, H, T, D] at the current positions."""
        index = self.positions.current
        if not self.quantized:
            self.keys.index_copy_(2, index, keys)
            self.values.index_copy_(2, index, values)
            return
        for stored, scales, new in ((self.keys, self.key_scales, keys), (self.values, self.value_scales, values)):
            quantized, scale = quantize(new, stored.dtype)
            stored.view(torch.uint8).index_copy_(2, index, quantized.view(torch.uint8))  # as bytes: no float8 kernel
            scales.index_copy_(2, index, scale)

    def stored(self, end: int | None = None, batch: slice = slice(None)):
        """(keys, values) of positions [0, end) (all: None) of the sequences `batch`, in the model's dtype."""
        keys, values = self.keys[batch, :, :end], self.values[batch, :, :end]
        if not self.quantized:
            return keys, values
        return (dequantize(keys, self.key_scales[batch, :, :end], self.dtype),
                dequantize(values, self.value_scales[batch, :, :end], self.dtype))

    def update(self, key_states, value_states, *args, **kwargs):
        """Store [B, H, T, D] at the current positions; return the keys and values the attention reads: the new
        ones for a first prefill, else every filled position (a one-token step: the whole cache)."""
        self._store(key_states, value_states)
        end = self.positions.mask_sizes(key_states.shape[2])[0]
        if end == key_states.shape[2]:
            return key_states, value_states
        return self.stored(end)

    def decode(self, query, key, value, scale):
        """One token per sequence: store key and value [B, 1, H, D], then attend with query [B, 1, HQ, D] (post-RoPE)
        over every real stored position: [B, 1, HQ, Dv]. A float8 cache is read as float8 by the Triton kernel
        where it applies, else dequantized a few sequences at a time (`DEQUANTIZED_BYTES` at most), so that reading
        it never holds a model-dtype copy of the whole layer."""
        self._store(key.transpose(1, 2), value.transpose(1, 2))
        real = self.positions.real
        if not self.quantized:
            return attend_stored(query, self.keys, self.values, real, scale)
        read = float8_stored_attention(query, self.keys, self.values, real, scale, self.key_scales, self.value_scales)
        if read is not None:
            return read
        per_sequence = 2 * self.keys[0].numel() * query.element_size()
        group = max(1, DEQUANTIZED_BYTES // per_sequence)
        parts = []
        for start in range(0, self.batch_size, group):
            rows = slice(start, start + group)
            parts.append(attend_stored(query[rows], *self.stored(batch=rows), real[rows], scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def reset(self) -> None:
        pass  # stale keys are never read: `StaticPositions.reset` clears the real-token flags


FLOAT8_DTYPES = (torch.float8_e4m3fn,)
DEQUANTIZED_BYTES = 256 * 2**20  # the model-dtype keys and values one float8 layer's decode step reads at once


def quantize(tensor: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(`tensor` [..., D] in the float8 `dtype`, float32 scales [...]): each D-vector divided by its largest magnitude
    over the format's largest finite value, so that it spans the format's range."""
    largest = torch.finfo(dtype).max
    scale = tensor.abs().amax(-1).float().clamp(min=torch.finfo(torch.float32).tiny) / largest
    return (tensor.float() / scale.unsqueeze(-1)).clamp(-largest, largest).to(dtype), scale


def dequantize(tensor: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """The inverse of `quantize`, in `dtype`."""
    return (tensor.float() * scale.unsqueeze(-1)).to(dtype)


class NHAStaticLayer(_StaticLayer):
    """An NHA layer's state allocated once with room for its whole window (`NHAState.for_decoding`): a prefill's state
    is copied in, decode steps update it in place."""

    is_sliding = True  # as `NHACacheLayer`: the mask builders size their masks from a full layer

    def __init__(self, positions: StaticPositions, window: int, kv_heads: int, slots: int, head_dim: int, dtype):
        super().__init__(positions)
        self.window = window
        self.buffers = NHAState.empty(self.batch_size, kv_heads, slots, head_dim, head_dim, dtype,
                                      self.device).for_decoding(window)
        self.filled = False  # whether a prefill was stored (until then the layer's operator starts without a state)

    @property
    def state(self) -> NHAState | None:
        return self.buffers if self.filled else None

    def tensors(self) -> list[torch.Tensor]:
        return self.buffers.tensors()

    def store(self, state: NHAState, new_tokens: int) -> None:
        if state is not self.buffers:  # a prefill's new state (a decode step updated the buffers in place)
            for buffer, tensor in zip(self.buffers.tensors(), state.for_decoding(self.window).tensors()):
                buffer.copy_(tensor)
            self.filled = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("NHA cache layers are filled with `store`, not with key/value states")

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def reset(self) -> None:
        for tensor in self.tensors():
            tensor.zero_()
        self.filled = False


class StaticMixedLayer(NHAHeadsPart, StaticFullLayer):
    """An NHA layer with full KV heads on a static cache: those heads' keys and values as a `StaticFullLayer`'s, the
    other heads' state in `nha` (an `NHAStaticLayer`)."""

    def __init__(self, positions: StaticPositions, full_heads: int, nha: "NHAStaticLayer", head_dim: int, dtype,
                 kv_dtype=None):
        super().__init__(positions, full_heads, head_dim, dtype, kv_dtype)
        self.nha = nha

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + self.nha.tensors()

    def reset(self) -> None:
        self.nha.reset()


class NHAStaticCache(Cache):
    """Everything allocated at construction for `batch_size` sequences of up to `max_cache_len` tokens:
    `StaticFullLayer` for full layers, `NHAStaticLayer` for NHA layers, `StaticMixedLayer` for NHA layers with full
    KV heads, sharing one `StaticPositions`. On CUDA the model
    replays its one-token steps on this cache from a CUDA graph captured at its first one-token step
    (`decode_graph.py`), unless built with `cuda_graph=False`. `kv_cache_dtype` (default: `dtype`) is what the full
    layers store their keys and values in (`StaticFullLayer`: float8 e4m3 halves them)."""

    def __init__(self, config, batch_size: int, max_cache_len: int, dtype, device, cuda_graph: bool = True,
                 kv_cache_dtype=None):
        self.positions = StaticPositions(batch_size, stored_length(max_cache_len), device)
        kv_heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

        def layer(window, full_heads):
            if window is None:
                return StaticFullLayer(self.positions, kv_heads, head_dim, dtype, kv_cache_dtype)
            nha = NHAStaticLayer(self.positions, window, kv_heads - len(full_heads), config.nha_num_slots, head_dim,
                                 dtype)
            if not full_heads:
                return nha
            return StaticMixedLayer(self.positions, len(full_heads), nha, head_dim, dtype, kv_cache_dtype)

        layers = [layer(window, heads) for window, heads in zip(config.nha_layer_windows,
                                                                 config.nha_layer_full_kv_heads)]
        super().__init__(layers=layers)
        self.config, self.dtype, self.kv_cache_dtype = config, dtype, kv_cache_dtype
        self.cuda_graph = cuda_graph and self.positions.real.device.type == "cuda"
        self.decode_graph = None  # the CUDA graph runner of its one-token steps, made by the model at the first one

    def held_bytes(self) -> int:
        """Bytes of every tensor the cache holds."""
        tensors = [self.positions.length, self.positions.real] + [t for layer in self.layers for t in layer.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def nha_state_bytes(self) -> list[int]:
        """Bytes held by each layer's NHA state (0 for full layers; an NHA layer's full heads are not counted here)."""
        return [layer.state_bytes() if isinstance(layer, (NHAStaticLayer, StaticMixedLayer)) else 0
                for layer in self.layers]

    def reset(self) -> None:
        super().reset()
        self.positions.reset()

    def repeated(self, repeats: int) -> "NHAStaticCache":
        """A new static cache of the same length holding each of this cache's sequences `repeats` times in a row (as
        `repeat_interleave`): many continuations of one prefill without prefilling each."""
        batch, length = self.positions.real.shape
        new = NHAStaticCache(self.config, batch * repeats, length, self.dtype, self.positions.real.device,
                             self.cuda_graph, self.kv_cache_dtype)
        pairs = [(new.positions.length, self.positions.length), (new.positions.real, self.positions.real)]
        for target, source in zip(new.layers, self.layers):
            pairs += zip(target.tensors(), source.tensors())
            if isinstance(source, (NHAStaticLayer, StaticMixedLayer)):
                getattr(target, "nha", target).filled = getattr(source, "nha", source).filled
        for target, source in pairs:
            copy_repeated(target, source, repeats)
        return new


def copy_repeated(target: torch.Tensor, source: torch.Tensor, repeats: int) -> None:
    """target = source.repeat_interleave(repeats, dim=0) (0-d: source), written in place without a temporary."""
    if source.dim() == 0:
        target.copy_(source)
    else:
        rest = source.shape[1:]
        target.view(source.shape[0], repeats, *rest).copy_(source.unsqueeze(1).expand(-1, repeats, *rest))
