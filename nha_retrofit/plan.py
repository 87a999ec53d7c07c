"""The layer plan: which layers keep full attention, which KV heads keep it inside NHA layers, and the window, slots
and gate settings of the rest.

`PlanSpec` is what a user asks for (every verb, the recipe's `model.convert`, the layer search build one); it owns
every plan default and the checks that need no model. `build_plan` turns it into the `LayerPlan` of a model with a
given layer count. This module reads no files: its callers hand it the layer count or the source's config.json
already read, and the converter takes the `LayerPlan` it returns (CLI -> plan -> converter -> model).
"""

from dataclasses import asdict, dataclass, replace

from .errors import NHARetrofitError

SELECTIONS = ("retrieval", "even", "first", "last")
# by default the cache of one layer in six stays full: the KV heads of 5 of SmolLM2's 30 layers, 5 of Llama-3-8B's 32
FULL_LAYER_SHARE = 6


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
    other layers get `window`. Lists are kept as tuples; with `full_layer_ids`, `full_layers` is their count.

    Full attention can also be kept per KV head inside NHA layers: `full_kv_head_ids` ((layer, head) pairs), or the
    `full_kv_heads` strongest heads of the retrieval probe (`conversion/layer_ranking.py`). Either makes `full_layers`
    default to 0 (whole full layers can still be asked for beside them); a layer whose every KV head is chosen
    becomes a full layer.

    When none of these is given (`uses_default_full_set`), the cache of one layer in `FULL_LAYER_SHARE` stays full
    (`full_layer_count`, rounded, at least one layer): with `select="retrieval"` as the probe's strongest KV heads,
    that many layers' worth, wherever they are; where the probe cannot run (no weights or tokenizer; random weights)
    or with another `select`, as that many whole layers. The defaults are the best setting of the quality sweep
    (docs/benchmarks.md#quality-sweep-benchmarksquality_sweeppy)."""

    full_layers: int | None = None
    select: str = "retrieval"
    full_layer_ids: tuple[int, ...] | None = None
    windows: tuple[int | None, ...] | None = None
    window: int = 256
    slots: int = 64
    gate_normalizer: float = 8.0
    slot_bias_init: float = -4.0
    gate_bias_init: float | None = 8.0  # b > 0 lengthens the slots' memory at conversion; None: no gate bias
    full_kv_heads: int | None = None
    full_kv_head_ids: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        if self.full_kv_head_ids is not None:
            pairs = tuple(tuple(pair) for pair in self.full_kv_head_ids)
            if any(len(pair) != 2 or min(pair) < 0 for pair in pairs):
                raise PlanSpecError("full_kv_head_ids", "takes (layer, KV head) pairs of ids >= 0")
            if len(set(pairs)) != len(pairs):
                raise PlanSpecError("full_kv_head_ids", "lists a head more than once")
            object.__setattr__(self, "full_kv_head_ids", pairs)
            object.__setattr__(self, "full_kv_heads", len(pairs))
        if self.full_kv_heads is not None and self.full_kv_heads < 0:
            raise PlanSpecError("full_kv_heads", f"{self.full_kv_heads}: must be >= 0")
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
        """Whether the full layers or heads depend on the model's weights (the retrieval probe's ranking)."""
        layers = self.select == "retrieval" and self.windows is None and self.full_layer_ids is None \
            and self.full_layers != 0 and not (self.full_layers is None and self.full_kv_heads)
        return layers or self.needs_head_ranking

    @property
    def needs_head_ranking(self) -> bool:
        return bool(self.full_kv_heads) and self.full_kv_head_ids is None

    @property
    def uses_default_full_set(self) -> bool:
        """Whether no option names the full layers or heads, so that the default places them."""
        return (self.windows is None and self.full_layer_ids is None and self.full_layers is None
                and self.full_kv_heads is None)

    def with_default_heads(self, num_layers: int, kv_heads: int) -> "PlanSpec":
        """This spec with the default full set as KV heads: the probe's strongest `full_kv_heads`, as many as the
        default's whole layers hold."""
        return replace(self, full_kv_heads=self.full_layer_count(num_layers) * kv_heads)

    def full_layer_count(self, num_layers: int) -> int:
        """How many layers keep full attention on a model of `num_layers` layers (whole layers: without full KV
        heads)."""
        if self.full_layers is not None:
            return self.full_layers
        if self.full_kv_heads:
            return 0
        return max(1, round(num_layers / FULL_LAYER_SHARE))


@dataclass(frozen=True)
class LayerPlan:
    windows: tuple  # one entry per layer: int window, or None for full attention
    num_slots: int
    gate_normalizer: float
    slot_bias_init: float
    gate_bias_init: float | None = None
    full_kv_heads: tuple | None = None  # None, or per layer a tuple of the KV heads kept full in an NHA layer

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i, window in enumerate(self.windows) if window is None]

    @property
    def full_kv_head_pairs(self) -> list[tuple[int, int]]:
        return [(layer, head) for layer, heads in enumerate(self.full_kv_heads or ()) for head in heads]

    def config_fields(self) -> dict:
        """The `nha_*` fields this plan writes into config.json."""
        return {
            "nha_windows": list(self.windows),
            "nha_full_kv_heads": None if self.full_kv_heads is None else [list(h) for h in self.full_kv_heads],
            "nha_num_slots": self.num_slots,
            "nha_gate_normalizer": self.gate_normalizer,
            "nha_slot_bias_init": self.slot_bias_init,
            "nha_gate_bias_init": self.gate_bias_init,
        }

    def describe(self) -> str:
        nha = len(self.windows) - len(self.full_layer_ids)
        windows = sorted({w for w in self.windows if w is not None})
        heads = ", ".join(f"{layer}:{head}" for layer, head in self.full_kv_head_pairs)
        return (
            f"{len(self.windows)} layers: full attention at {self.full_layer_ids or 'none'}; "
            + (f"full KV heads (layer:head) {heads}; " if heads else "")
            + f"{nha} NHA layers (window {', '.join(map(str, windows)) or '-'}, {self.num_slots} slots, "
            f"gate normalizer {self.gate_normalizer:g}, slot bias init {self.slot_bias_init:g}"
            + (f", gate bias init {self.gate_bias_init:g})" if self.gate_bias_init is not None else ")")
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "windows": list(self.windows), "full_kv_heads": self.config_fields()["nha_full_kv_heads"]}


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


def build_plan(num_layers: int, spec: PlanSpec = PlanSpec(), ranking=None, head_ranking=None,
               kv_heads: int | None = None) -> LayerPlan:
    """The plan `spec` asks for, on a model of `num_layers` layers of `kv_heads` KV heads (needed for full KV heads);
    `ranking` (layer ids, strongest retrieval layer first) places the full layers of `select="retrieval"`, and
    `head_ranking` ((layer, KV head) pairs, strongest first) the `full_kv_heads`, and the default full set's when
    given (`PlanSpec.uses_default_full_set`)."""
    if (spec.uses_default_full_set and spec.select == "retrieval" and head_ranking is not None
            and kv_heads is not None):
        spec = spec.with_default_heads(num_layers, kv_heads)
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
    windows, heads = place_full_kv_heads(windows, spec, head_ranking, kv_heads)
    gate_bias = None if spec.gate_bias_init is None else float(spec.gate_bias_init)
    return LayerPlan(windows, spec.slots, float(spec.gate_normalizer), float(spec.slot_bias_init), gate_bias, heads)


def evenly_placed_heads(layers: list[int], count: int) -> list[tuple[int, int]]:
    """`count` (layer, KV head) pairs spread evenly over `layers`: each layer gets the same number of heads (its
    first ones), and the remainder goes one each to `evenly_spaced` layers (the placement of `select="even"`, whose
    cost is what a random-weights benchmark measures)."""
    rounds, rest = divmod(count, len(layers))
    extra = {layers[i] for i in evenly_spaced(len(layers), rest)} if rest else set()
    return [(layer, head) for layer in layers for head in range(rounds + (layer in extra))]


def place_full_kv_heads(windows: tuple, spec: PlanSpec, head_ranking, kv_heads: int | None):
    """(windows, per-layer full KV heads or None): `spec`'s full KV heads in the NHA layers of `windows`: pinned, or
    the first `full_kv_heads` outside full layers of `head_ranking` (`select="retrieval"`), or `evenly_placed_heads`
    (any other `select`); a layer given every head becomes full."""
    if not spec.full_kv_heads:
        return windows, None
    if kv_heads is None:
        raise NHARetrofitError("full KV heads need the model's KV head count")
    if spec.full_kv_head_ids is not None:
        pairs = spec.full_kv_head_ids
        for layer, head in pairs:
            if layer >= len(windows) or head >= kv_heads:
                raise PlanSpecError("full_kv_head_ids", f"({layer}, {head}): out of range, the model has layers "
                                    f"0..{len(windows) - 1} of KV heads 0..{kv_heads - 1}")
            if windows[layer] is None:
                raise PlanSpecError("full_kv_head_ids", f"({layer}, {head}): layer {layer} is a full layer already")
    else:
        nha_layers = [layer for layer, window in enumerate(windows) if window is not None]
        if spec.full_kv_heads > len(nha_layers) * kv_heads:
            raise PlanSpecError("full_kv_heads", f"{spec.full_kv_heads}: the NHA layers have "
                                f"{len(nha_layers) * kv_heads} KV heads")
        if spec.select != "retrieval":
            pairs = evenly_placed_heads(nha_layers, spec.full_kv_heads)
        elif head_ranking is None:
            raise NHARetrofitError("--full-kv-heads ranks heads by probing the model's weights, which this step "
                                   "does not read; pass --full-kv-head-ids or --select even")
        else:
            pairs = [pair for pair in head_ranking if windows[pair[0]] is not None][: spec.full_kv_heads]
    heads = [sorted(head for layer, head in pairs if layer == i) for i in range(len(windows))]
    windows = tuple(None if len(heads[i]) == kv_heads else window for i, window in enumerate(windows))
    return windows, tuple(() if window is None else tuple(h) for window, h in zip(windows, heads))


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


def plan_table(config: dict, spec: PlanSpec = PlanSpec(), ranking=None, head_ranking=None) -> str:
    """The plan `spec` asks for on the model whose config.json is `config` (already read and checked, see
    `conversion.source`) as a table: per layer window, slots, full KV heads, new parameters and cache cost."""
    kv_heads, head_dim, width = cache_dims(config)
    plan = build_plan(config["num_hidden_layers"], spec, ranking, head_ranking, kv_heads)
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_per_token = 2 * kv_heads * head_dim * width
    lines = [plan.describe(), "", "| layer | window | slots | full KV heads | new parameters | cache |",
             "|---|---|---|---|---|---|"]
    new_params = fixed_bytes = per_token = 0
    for layer, window in enumerate(plan.windows):
        params = kv_heads * plan.num_slots * (hidden + (plan.gate_bias_init is not None)) + heads
        new_params += params
        if window is None:
            per_token += kv_per_token
            lines.append(f"| {layer} | full | - | all | {params:,} (unused) | {kv_per_token:,} B per token |")
            continue
        full_heads = plan.full_kv_heads[layer] if plan.full_kv_heads else ()
        state = nha_state_bytes(kv_heads - len(full_heads), head_dim, plan.num_slots, window, width)
        fixed_bytes += state
        cost = f"{state:,} B fixed"
        if full_heads:
            heads_per_token = len(full_heads) * kv_per_token // kv_heads
            per_token += heads_per_token
            cost += f" + {heads_per_token:,} B per token"
        lines.append(f"| {layer} | {window} | {plan.num_slots} | {','.join(map(str, full_heads)) or '-'} | "
                     f"{params:,} | {cost} |")
    lines += [
        "",
        f"new parameters: {new_params:,}; cache per sequence: {per_token:,} B per token (full layers and heads) "
        f"+ {fixed_bytes:,} B fixed (NHA layers); the original needs {len(plan.windows) * kv_per_token:,} B per token",
    ]
    return "\n".join(lines)
