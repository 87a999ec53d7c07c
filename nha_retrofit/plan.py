"""The layer plan: which layers keep full attention, and the window, slots and gate settings of the others.

A plan is validated before any weight is read or written, and its errors name the offending value. This module
reads no files: its callers hand it the layer count or the source's config.json already read, and the converter
takes the `LayerPlan` it returns (CLI -> plan -> converter -> model).
"""

from dataclasses import asdict, dataclass

from .errors import NHARetrofitError
from .modeling.configuration_nha import NHA_DEFAULTS

DEFAULT_WINDOW = 64


@dataclass(frozen=True)
class LayerPlan:
    windows: tuple  # one entry per layer: int window, or None for full attention
    num_slots: int = NHA_DEFAULTS["nha_num_slots"]
    gate_normalizer: float = NHA_DEFAULTS["nha_gate_normalizer"]
    slot_bias_init: float = NHA_DEFAULTS["nha_slot_bias_init"]

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i, window in enumerate(self.windows) if window is None]

    def config_fields(self) -> dict:
        """The `nha_*` fields this plan writes into config.json."""
        return {
            "nha_windows": list(self.windows),
            "nha_num_slots": self.num_slots,
            "nha_gate_normalizer": self.gate_normalizer,
            "nha_slot_bias_init": self.slot_bias_init,
        }

    def describe(self) -> str:
        nha = len(self.windows) - len(self.full_layer_ids)
        windows = sorted({w for w in self.windows if w is not None})
        return (
            f"{len(self.windows)} layers: full attention at {self.full_layer_ids or 'none'}; "
            f"{nha} NHA layers (window {', '.join(map(str, windows)) or '-'}, {self.num_slots} slots, "
            f"gate normalizer {self.gate_normalizer:g}, slot bias init {self.slot_bias_init:g})"
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "windows": list(self.windows)}


SELECTIONS = ("even", "first", "last")


def evenly_spaced(num_layers: int, count: int) -> list[int]:
    """`count` layer ids spread evenly, each in the middle of its share (4 of 32 -> 3, 11, 19, 27)."""
    return [((2 * i + 1) * num_layers - count) // (2 * count) for i in range(count)]


def select_full_layers(num_layers: int, count: int, select: str = "even") -> list[int]:
    if select == "even":
        return evenly_spaced(num_layers, count) if count else []
    if select == "first":
        return list(range(count))
    if select == "last":
        return list(range(num_layers - count, num_layers))
    raise NHARetrofitError(f"--select {select}: choose one of {', '.join(SELECTIONS)}")


def parse_windows(text: str) -> list:
    """`64,64,full,...` -> [64, 64, None, ...]."""
    windows = []
    for position, part in enumerate(p.strip() for p in text.split(",")):
        if part.lower() in ("full", "none"):
            windows.append(None)
        elif part.lstrip("-").isdigit():
            windows.append(int(part))
        else:
            raise NHARetrofitError(f"--windows entry {position} is {part!r}: expected an integer or 'full'")
    return windows


def build_plan(
    num_layers: int,
    *,
    full_layers: int | None = 4,
    full_layer_ids: list[int] | None = None,
    select: str = "even",
    windows: list | None = None,
    window: int = DEFAULT_WINDOW,
    slots: int = NHA_DEFAULTS["nha_num_slots"],
    gate_normalizer: float = NHA_DEFAULTS["nha_gate_normalizer"],
    slot_bias_init: float = NHA_DEFAULTS["nha_slot_bias_init"],
) -> LayerPlan:
    """Exactly `windows` (one per layer) if given; else full layers chosen by `select` (or exactly
    `full_layer_ids`) and `window` everywhere else."""
    if slots < 1:
        raise NHARetrofitError(f"--slots {slots}: at least one slot is needed")
    if gate_normalizer <= 0:
        raise NHARetrofitError(f"--gate-normalizer {gate_normalizer}: must be > 0")
    if windows is not None:
        if len(windows) != num_layers:
            raise NHARetrofitError(f"--windows has {len(windows)} entries; the model has {num_layers} layers")
        negative = [(i, w) for i, w in enumerate(windows) if w is not None and w < 0]
        if negative:
            raise NHARetrofitError(f"--windows entry {negative[0][0]} is {negative[0][1]}: a window is >= 0 or 'full'")
        return LayerPlan(tuple(windows), slots, float(gate_normalizer), float(slot_bias_init))
    if window is None or window < 0:
        raise NHARetrofitError(f"--window {window}: a window is an integer >= 0")
    if full_layer_ids is not None:
        bad = [i for i in full_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise NHARetrofitError(f"--full-layer-ids {bad[0]}: out of range, the model has layers 0..{num_layers - 1}")
        repeated = sorted({i for i in full_layer_ids if full_layer_ids.count(i) > 1})
        if repeated:
            raise NHARetrofitError(f"--full-layer-ids {repeated[0]}: listed more than once")
        full = set(full_layer_ids)
    else:
        if full_layers is None or not 0 <= full_layers <= num_layers:
            raise NHARetrofitError(f"--full-layers {full_layers}: must be between 0 and {num_layers} (the layer count)")
        full = set(select_full_layers(num_layers, full_layers, select))
    return LayerPlan(
        tuple(None if i in full else window for i in range(num_layers)), slots, float(gate_normalizer),
        float(slot_bias_init),
    )


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def cache_dims(config: dict) -> tuple[int, int, int]:
    """(kv heads, head dim, bytes per cached key or value element) of a model's config.json."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return kv_heads, head_dim, DTYPE_BYTES.get(config.get("dtype") or config.get("torch_dtype") or "float32", 4)


def nha_state_bytes(kv_heads: int, head_dim: int, slots: int, window: int, width: int) -> int:
    """Bytes of one sequence's NHA layer state once `window` tokens were seen (the fields of `NHAState`): float32
    slot keys and values; per window token pre- and post-RoPE keys and values (`width` bytes each), float32 gates
    and a padding flag; a flag for filled slots and an int64 ring start."""
    return 2 * kv_heads * slots * head_dim * 4 + window * (kv_heads * (3 * head_dim * width + 4 * slots) + 1) + 1 + 8


def plan_table(config: dict, **plan_args) -> str:
    """The plan for the model whose config.json is `config` (already read and checked, see
    `conversion.source`) as a table: per layer window, slots, new parameters and cache cost."""
    plan = build_plan(config["num_hidden_layers"], **plan_args)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_heads, head_dim, width = cache_dims(config)
    kv_per_token = 2 * kv_heads * head_dim * width
    lines = [plan.describe(), "", "| layer | window | slots | new parameters | cache |", "|---|---|---|---|---|"]
    new_params = fixed_bytes = 0
    for layer, window in enumerate(plan.windows):
        params = kv_heads * plan.num_slots * hidden + heads
        new_params += params
        if window is None:
            lines.append(f"| {layer} | full | - | {params:,} (unused) | {kv_per_token:,} B per token |")
            continue
        state = nha_state_bytes(kv_heads, head_dim, plan.num_slots, window, width)
        fixed_bytes += state
        lines.append(f"| {layer} | {window} | {plan.num_slots} | {params:,} | {state:,} B fixed |")
    full = len(plan.full_layer_ids)
    lines += [
        "",
        f"new parameters: {new_params:,}; cache per sequence: {full * kv_per_token:,} B per token (full layers) "
        f"+ {fixed_bytes:,} B fixed (NHA layers); the original needs {len(plan.windows) * kv_per_token:,} B per token",
    ]
    return "\n".join(lines)
