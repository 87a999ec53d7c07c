"""The layer plan: which layers keep full attention, and the window, slots and gate settings of the others.

`PlanSpec` is what a user asks for (every verb, the recipe's `model.convert`, the layer search build one); it owns
every plan default and the checks that need no model. `build_plan` turns it into the `LayerPlan` of a model with a
given layer count. This module reads no files: its callers hand it the layer count or the source's config.json
already read, and the converter takes the `LayerPlan` it returns (CLI -> plan -> converter -> model).
"""

from dataclasses import asdict, dataclass

from .errors import NHARetrofitError

SELECTIONS = ("retrieval", "even", "first", "last")
FULL_LAYER_SHARE = 6  # by default one layer in six keeps full attention (5 of SmolLM2's 30, 5 of Llama-3-8B's 32)


class PlanSpecError(NHARetrofitError, ValueError):
    """A plan value that cannot work, named by its field. Shown as the CLI option (`--slots 0: ...`); the recipe
    names the field by its key instead. A ValueError too, so that pydantic reports it at its place in a recipe."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"--{field.replace('_', '-')} {detail}")
        self.field, self.detail = field, detail


@dataclass(frozen=True)
class PlanSpec:
    """A conversion plan before the model's layer count is known. The full layers come from, in this order of
    precedence: `windows` (one per layer, None = full), `full_layer_ids`, or `full_layers` placed by `select`; the
    other layers get `window`. Lists are kept as tuples; with `full_layer_ids`, `full_layers` is their count;
    `full_layers=None` is one layer in `FULL_LAYER_SHARE`, rounded, at least one (`full_layer_count`).
    `select="retrieval"` keeps the layers that hold the original's retrieval heads (`conversion/layer_ranking.py`):
    the defaults are the best setting of the quality sweep (docs/benchmarks.md#quality-sweep-benchmarksquality_sweeppy)."""

    full_layers: int | None = None
    select: str = "retrieval"
    full_layer_ids: tuple[int, ...] | None = None
    windows: tuple[int | None, ...] | None = None
    window: int = 256
    slots: int = 64
    gate_normalizer: float = 8.0
    slot_bias_init: float = -4.0
    gate_bias_init: float | None = 8.0  # b > 0 lengthens the slots' memory at conversion; None: no gate bias

    def __post_init__(self):
        if self.windows is not None:
            object.__setattr__(self, "windows", tuple(self.windows))
            for position, window in enumerate(self.windows):
                if window is not None and window < 0:
                    raise PlanSpecError("windows", f"entry {position} is {window}: a window is >= 0 or 'full'")
        if self.full_layer_ids is not None:
            ids = tuple(self.full_layer_ids)
            object.__setattr__(self, "full_layer_ids", ids)
            object.__setattr__(self, "full_layers", len(ids))
            if any(i < 0 for i in ids):
                raise PlanSpecError("full_layer_ids", f"{min(ids)}: layer ids start at 0")
            repeated = sorted({i for i in ids if ids.count(i) > 1})
            if repeated:
                raise PlanSpecError("full_layer_ids", f"{repeated[0]}: listed more than once")
        if self.full_layers is not None and self.full_layers < 0:
            raise PlanSpecError("full_layers", f"{self.full_layers}: must be >= 0")
        if self.select not in SELECTIONS:
            raise PlanSpecError("select", f"{self.select}: choose one of {', '.join(SELECTIONS)}")
        if self.window < 0:
            raise PlanSpecError("window", f"{self.window}: a window is an integer >= 0")
        if self.slots < 1:
            raise PlanSpecError("slots", f"{self.slots}: at least one slot is needed")
        if self.gate_normalizer <= 0:
            raise PlanSpecError("gate_normalizer", f"{self.gate_normalizer:g}: must be > 0")

    @property
    def needs_ranking(self) -> bool:
        """Whether the full layers depend on the model's weights (the retrieval probe's layer ranking)."""
        return self.select == "retrieval" and self.windows is None and self.full_layer_ids is None \
            and self.full_layers != 0

    def full_layer_count(self, num_layers: int) -> int:
        """How many layers keep full attention on a model of `num_layers` layers."""
        if self.full_layers is not None:
            return self.full_layers
        return max(1, round(num_layers / FULL_LAYER_SHARE))


@dataclass(frozen=True)
class LayerPlan:
    windows: tuple  # one entry per layer: int window, or None for full attention
    num_slots: int
    gate_normalizer: float
    slot_bias_init: float
    gate_bias_init: float | None = None

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
            "nha_gate_bias_init": self.gate_bias_init,
        }

    def describe(self) -> str:
        nha = len(self.windows) - len(self.full_layer_ids)
        windows = sorted({w for w in self.windows if w is not None})
        return (
            f"{len(self.windows)} layers: full attention at {self.full_layer_ids or 'none'}; "
            f"{nha} NHA layers (window {', '.join(map(str, windows)) or '-'}, {self.num_slots} slots, "
            f"gate normalizer {self.gate_normalizer:g}, slot bias init {self.slot_bias_init:g}"
            + (f", gate bias init {self.gate_bias_init:g})" if self.gate_bias_init is not None else ")")
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "windows": list(self.windows)}


def evenly_spaced(num_layers: int, count: int) -> list[int]:
    """`count` layer ids spread evenly, each in the middle of its share (4 of 32 -> 3, 11, 19, 27)."""
    return [((2 * i + 1) * num_layers - count) // (2 * count) for i in range(count)]


def select_full_layers(num_layers: int, count: int, select: str = "even", ranking=None) -> list[int]:
    """The `count` full layers `select` places; `retrieval` takes the first `count` of `ranking` (layer ids, the
    strongest retrieval layer first)."""
    if select == "retrieval" and count:
        if ranking is None:
            raise NHARetrofitError("--select retrieval ranks the layers by probing the model's weights, which this "
                                   "step does not read; pass --full-layer-ids or --select even")
        return sorted(ranking[:count])
    if select == "even":
        return evenly_spaced(num_layers, count) if count else []
    if select == "first":
        return list(range(count))
    return list(range(num_layers - count, num_layers))


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


def build_plan(num_layers: int, spec: PlanSpec = PlanSpec(), ranking=None) -> LayerPlan:
    """The plan `spec` asks for, on a model of `num_layers` layers; `ranking` (layer ids, strongest retrieval layer
    first) places the full layers of `select="retrieval"`."""
    if spec.windows is not None:
        if len(spec.windows) != num_layers:
            raise PlanSpecError("windows", f"has {len(spec.windows)} entries; the model has {num_layers} layers")
        windows = spec.windows
    else:
        if spec.full_layer_ids is not None:
            beyond = [i for i in spec.full_layer_ids if i >= num_layers]
            if beyond:
                raise PlanSpecError("full_layer_ids",
                                    f"{beyond[0]}: out of range, the model has layers 0..{num_layers - 1}")
            full = set(spec.full_layer_ids)
        else:
            count = spec.full_layer_count(num_layers)
            if count > num_layers:
                raise PlanSpecError("full_layers", f"{count}: must be between 0 and {num_layers} (the layer count)")
            full = set(select_full_layers(num_layers, count, spec.select, ranking))
        windows = tuple(None if i in full else spec.window for i in range(num_layers))
    gate_bias = None if spec.gate_bias_init is None else float(spec.gate_bias_init)
    return LayerPlan(windows, spec.slots, float(spec.gate_normalizer), float(spec.slot_bias_init), gate_bias)


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


def plan_table(config: dict, spec: PlanSpec = PlanSpec(), ranking=None) -> str:
    """The plan `spec` asks for on the model whose config.json is `config` (already read and checked, see
    `conversion.source`) as a table: per layer window, slots, new parameters and cache cost."""
    plan = build_plan(config["num_hidden_layers"], spec, ranking)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_heads, head_dim, width = cache_dims(config)
    kv_per_token = 2 * kv_heads * head_dim * width
    lines = [plan.describe(), "", "| layer | window | slots | new parameters | cache |", "|---|---|---|---|---|"]
    new_params = fixed_bytes = 0
    for layer, window in enumerate(plan.windows):
        params = kv_heads * plan.num_slots * (hidden + (plan.gate_bias_init is not None)) + heads
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
