"""The state one NHA layer carries from one call to the next (prefill, then decode steps).

It is the fixed-size slot memory plus the last `window` tokens, which are still read exactly and will be
absorbed into the slots when they leave the window. Its size does not depend on how many tokens came before.
"""

from dataclasses import dataclass, fields

import torch


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

    def map(self, fn) -> "NHAState":
        """A new state with `fn` applied to every tensor (batch selection, device moves, ...)."""
        return NHAState(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    @property
    def window_length(self) -> int:
        return self.window_mask.shape[1]
