"""The state one NHA layer carries from one call to the next (prefill, then decode steps).

It is the fixed-size slot memory plus the last `window` tokens, which are still read exactly and will be
absorbed into the slots when they leave the window. Its size does not depend on how many tokens came before.

The window is a ring buffer: entry `(window_start + i) % P` holds the i-th oldest of its P tokens. Prefill
produces it in order (`window_start` 0); decode steps (`for_decoding`, then `nha_recurrent_step`) give it room
for the whole window once and from then on overwrite the oldest entry in place, so a step copies nothing.
Entries that hold no token yet are padding (`window_mask` False): they are never read and, when they leave,
change nothing.
"""

from dataclasses import dataclass, fields

import torch

WINDOW_FIELDS = ("window_keys", "window_keys_rope", "window_values", "window_log_alpha", "window_mask")


@dataclass
class NHAState:
    slot_keys: torch.Tensor  # [B, H, M, D] float32 (float64 for float64 inputs): the key half of the memory
    slot_values: torch.Tensor  # [B, H, M, Dv], like slot_keys
    slots_filled: torch.Tensor  # [B] bool: has any real (non-padding) token been absorbed yet?
    window_keys: torch.Tensor  # [B, P, H, D] pre-RoPE keys of the tokens still in the window (P <= window)
    window_keys_rope: torch.Tensor  # [B, P, H, D]
    window_values: torch.Tensor  # [B, P, H, Dv]
    window_log_alpha: torch.Tensor  # [B, P, H, M] gates, applied when those tokens are absorbed
    window_mask: torch.Tensor  # [B, P] bool: False for padding
    window_start: torch.Tensor | None = None  # [B] int64: the ring entry of the oldest window token (None: 0)

    def __post_init__(self):
        if self.window_start is None:
            self.window_start = torch.zeros(self.window_mask.shape[0], dtype=torch.long,
                                            device=self.window_mask.device)

    @classmethod
    def empty(cls, batch, kv_heads, slots, head_dim, value_dim, dtype, device) -> "NHAState":
        """No token seen yet; `dtype` is the dtype of the window tensors (slots and gates: at least float32)."""
        state_dtype = torch.promote_types(dtype, torch.float32)

        def zeros(*shape, dtype=dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            slot_keys=zeros(batch, kv_heads, slots, head_dim, dtype=state_dtype),
            slot_values=zeros(batch, kv_heads, slots, value_dim, dtype=state_dtype),
            slots_filled=zeros(batch, dtype=torch.bool),
            window_keys=zeros(batch, 0, kv_heads, head_dim),
            window_keys_rope=zeros(batch, 0, kv_heads, head_dim),
            window_values=zeros(batch, 0, kv_heads, value_dim),
            window_log_alpha=zeros(batch, 0, kv_heads, slots, dtype=state_dtype),
            window_mask=zeros(batch, 0, dtype=torch.bool),
        )

    @classmethod
    def cat(cls, states) -> "NHAState":
        """The states of consecutive batch slices as one state (tensors concatenated along the batch)."""
        return cls(**{f.name: torch.cat([getattr(s, f.name) for s in states]) for f in fields(cls)})

    def map(self, fn) -> "NHAState":
        """A new state with `fn` applied to every tensor (batch selection, device moves, ...)."""
        return NHAState(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def compact(self) -> "NHAState":
        """This state with every tensor holding only its own elements (views copied out). A prefill's window is a
        slice of the whole prompt's keys, values and gates: kept in a cache as a view, it would keep all of them
        alive, O(prompt) memory per layer where the state promises a fixed size."""
        return self.map(lambda t: t if _owns_its_memory(t) else t.clone(memory_format=torch.contiguous_format))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    @property
    def window_length(self) -> int:
        """P: the window entries held (tokens, and padding where the window has not filled up yet)."""
        return self.window_mask.shape[1]

    def chronological(self) -> "NHAState":
        """The same state with its window entries oldest first (`window_start` 0): what prefill reads."""
        length = self.window_length
        if length == 0:
            return self
        order = (self.window_start[:, None] + torch.arange(length, device=self.window_start.device)) % length
        moved = {}
        for name in WINDOW_FIELDS:
            x = getattr(self, name)
            moved[name] = x.gather(1, order.view(*order.shape, *[1] * (x.dim() - 2)).expand_as(x))
        return NHAState(self.slot_keys, self.slot_values, self.slots_filled, **moved)

    def for_decoding(self, window: int) -> "NHAState":
        """This state with room for exactly `window` entries and every tensor contiguous, so that decode steps
        can update it in place: `self` when it already is, else a copy (once per prefill) with the missing
        entries as padding in front, oldest first."""
        length = self.window_length
        if length > window:
            raise ValueError(f"this NHA state holds {length} window tokens, more than the window of {window}")
        if length == window and all(t.is_contiguous() for t in self.tensors()):
            return self
        state = self.chronological()
        padded = {}
        for name in WINDOW_FIELDS:
            x = getattr(state, name)
            padded[name] = torch.cat([x.new_zeros(x.shape[0], window - length, *x.shape[2:]), x], 1)
        return NHAState(state.slot_keys.contiguous(), state.slot_values.contiguous(),
                        state.slots_filled.contiguous(), **padded)


def _owns_its_memory(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is the whole of its storage (not a view into a larger tensor)."""
    return tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
