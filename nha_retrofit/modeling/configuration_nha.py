"""Configuration of NHA hybrids: the original family's config plus the layer plan.

Saved in config.json as `nha_windows` (one entry per layer: an int window, or null for a full-attention
layer), `nha_full_kv_heads` (null, or one list per layer of the KV heads that keep full attention inside an NHA
layer: their query heads attend over every position, the layer's other heads run NHA), `nha_num_slots`, `nha_gate_normalizer`, `nha_slot_bias_init` and `nha_gate_bias_init` (null: the gate
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
    nha_full_kv_heads: list | None = None
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
        heads = self.nha_full_kv_heads
        if heads is not None:
            if len(heads) != self.num_hidden_layers:
                raise ValueError(f"nha_full_kv_heads has {len(heads)} entries for {self.num_hidden_layers} layers")
            kv_heads = self.num_key_value_heads or self.num_attention_heads
            for layer, (window, ids) in enumerate(zip(self.nha_layer_windows, heads)):
                if not isinstance(ids, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < kv_heads
                                                    for i in ids) or len(set(ids)) != len(ids):
                    raise ValueError(f"nha_full_kv_heads[{layer}] = {ids!r}: a list of distinct KV head ids "
                                     f"0..{kv_heads - 1}")
                if ids and window is None:
                    raise ValueError(f"nha_full_kv_heads[{layer}] = {ids!r}: layer {layer} is a full layer already")
                if len(ids) == kv_heads:
                    raise ValueError(f"nha_full_kv_heads[{layer}] lists every KV head: make the layer full instead "
                                     "(its nha_windows entry null)")
        if self.nha_num_slots < 1:
            raise ValueError(f"nha_num_slots = {self.nha_num_slots}: at least one slot is needed")
        if self.nha_gate_normalizer <= 0:
            raise ValueError(f"nha_gate_normalizer = {self.nha_gate_normalizer} must be > 0")

    @property
    def nha_layer_windows(self) -> list:
        """Per-layer windows; a config without a plan is all full attention (the original model)."""
        return list(self.nha_windows) if self.nha_windows is not None else [None] * self.num_hidden_layers

    @property
    def nha_layer_full_kv_heads(self) -> list:
        """Per layer, the sorted KV heads that keep full attention inside an NHA layer (empty: none)."""
        heads = self.nha_full_kv_heads or [[]] * self.num_hidden_layers
        return [sorted(ids) for ids in heads]

    @property
    def nha_full_kv_head_pairs(self) -> list:
        """The full KV heads as [layer, head] pairs."""
        return [[layer, head] for layer, ids in enumerate(self.nha_layer_full_kv_heads) for head in ids]


@strict
class NHALlamaConfig(NHAConfigMixin, LlamaConfig):
    pass


@strict
class NHAQwen2Config(NHAConfigMixin, Qwen2Config):
    """Qwen2/2.5. Its own sliding-window fields are switched off: the NHA plan decides every layer's window."""


@strict
class NHAQwen3MoeConfig(NHAConfigMixin, Qwen3MoeConfig):
    pass
