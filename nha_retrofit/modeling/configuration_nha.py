"""Configuration of NHA hybrids: the original family's config plus the layer plan.

Saved in config.json as `nha_windows` (one entry per layer: an int window, or null for a full-attention
layer), `nha_num_slots`, `nha_gate_normalizer`, `nha_slot_bias_init` and `nha_gate_bias_init` (null: the gate
projection has no bias, as in checkpoints made before it existed). A conversion writes all five, chosen by the
plan (`nha_retrofit.plan.PlanSpec` owns the conversion defaults); `NHA_DEFAULTS` only fill in a config that lacks a
field, so they are part of the checkpoint format and do not follow the conversion defaults. This file ships inside
every checkpoint as remote code and imports nothing from nha_retrofit.

The `model_type` stays the family's own (llama, qwen2, qwen3_moe): code that reads config.json without running
remote code (AutoTokenizer loads the config before the tokenizer) then finds an architecture transformers knows, and
asks nothing; `auto_map` names these classes.
"""

from dataclasses import dataclass

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

NHA_DEFAULTS = {"nha_num_slots": 64, "nha_gate_normalizer": 8.0, "nha_slot_bias_init": -4.0, "nha_gate_bias_init": None}


@dataclass
class NHAConfigMixin:
    """The NHA fields and their validation, shared by every family (listed first among the config's bases)."""

    nha_windows: list | None = None
    nha_num_slots: int = NHA_DEFAULTS["nha_num_slots"]
    nha_gate_normalizer: float = NHA_DEFAULTS["nha_gate_normalizer"]
    nha_slot_bias_init: float = NHA_DEFAULTS["nha_slot_bias_init"]
    nha_gate_bias_init: float | None = NHA_DEFAULTS["nha_gate_bias_init"]

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.validate_nha()

    def validate_nha(self):
        windows = self.nha_windows
        if windows is not None:
            if len(windows) != self.num_hidden_layers:
                raise ValueError(f"nha_windows has {len(windows)} entries for {self.num_hidden_layers} layers")
            for layer, window in enumerate(windows):
                if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
                    raise ValueError(f"nha_windows[{layer}] = {window!r}: a window is an int >= 0, or null (full)")
        if self.nha_num_slots < 1:
            raise ValueError(f"nha_num_slots = {self.nha_num_slots}: at least one slot is needed")
        if self.nha_gate_normalizer <= 0:
            raise ValueError(f"nha_gate_normalizer = {self.nha_gate_normalizer} must be > 0")

    @property
    def nha_layer_windows(self) -> list:
        """Per-layer windows; a config without a plan is all full attention (the original model)."""
        return list(self.nha_windows) if self.nha_windows is not None else [None] * self.num_hidden_layers


@strict
class NHALlamaConfig(NHAConfigMixin, LlamaConfig):
    pass


@strict
class NHAQwen2Config(NHAConfigMixin, Qwen2Config):
    """Qwen2/2.5. Its own sliding-window fields are switched off: the NHA plan decides every layer's window."""


@strict
class NHAQwen3MoeConfig(NHAConfigMixin, Qwen3MoeConfig):
    pass
