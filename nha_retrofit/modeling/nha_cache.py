"""The generation cache of NHA hybrids: an ordinary KV cache for full layers, a fixed-size state for NHA layers."""

from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

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


class NHACache(Cache):
    """Built from the model config's `nha_windows`: `DynamicLayer` for full layers, `NHACacheLayer` otherwise."""

    def __init__(self, config):
        layers = [DynamicLayer() if window is None else NHACacheLayer() for window in config.nha_layer_windows]
        super().__init__(layers=layers)

    def nha_state_bytes(self) -> list[int]:
        """Bytes held by each NHA layer (0 for full layers, which hold an ordinary growing KV cache)."""
        return [layer.state_bytes() if isinstance(layer, NHACacheLayer) else 0 for layer in self.layers]
