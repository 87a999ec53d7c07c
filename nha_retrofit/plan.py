"""The layer plan: which layers keep full attention, and the window, slots and gate settings of the others.

A plan is validated before any weight is read or written, and its errors name the offending value.
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


def evenly_spaced(num_layers: int, count: int) -> list[int]:
    """`count` layer ids spread evenly, each in the middle of its share (4 of 32 -> 3, 11, 19, 27)."""
    return [((2 * i + 1) * num_layers - count) // (2 * count) for i in range(count)]


def build_plan(
    num_layers: int,
    *,
    full_layers: int | None = 4,
    full_layer_ids: list[int] | None = None,
    window: int = DEFAULT_WINDOW,
    num_slots: int = NHA_DEFAULTS["nha_num_slots"],
    gate_normalizer: float = NHA_DEFAULTS["nha_gate_normalizer"],
    slot_bias_init: float = NHA_DEFAULTS["nha_slot_bias_init"],
) -> LayerPlan:
    """Full layers evenly spaced by default, or exactly `full_layer_ids`; every other layer gets `window`."""
    if window is None or window < 0:
        raise NHARetrofitError(f"--window {window}: a window is an integer >= 0")
    if num_slots < 1:
        raise NHARetrofitError(f"--slots {num_slots}: at least one slot is needed")
    if gate_normalizer <= 0:
        raise NHARetrofitError(f"--gate-normalizer {gate_normalizer}: must be > 0")
    if full_layer_ids is not None:
        bad = [i for i in full_layer_ids if not 0 <= i < num_layers]
        if bad:
            raise NHARetrofitError(f"--full-layer-ids {bad[0]}: out of range, the model has layers 0..{num_layers - 1}")
        repeated = sorted({i for i in full_layer_ids if full_layer_ids.count(i) > 1})
        if repeated:
            raise NHARetrofitError(f"--full-layer-ids {repeated[0]}: listed more than once")
        if full_layers is not None and full_layers != len(full_layer_ids):
            raise NHARetrofitError(
                f"--full-layers {full_layers} disagrees with the {len(full_layer_ids)} ids of --full-layer-ids"
            )
        full = set(full_layer_ids)
    else:
        if full_layers is None or not 0 <= full_layers <= num_layers:
            raise NHARetrofitError(f"--full-layers {full_layers}: must be between 0 and {num_layers} (the layer count)")
        full = set(evenly_spaced(num_layers, full_layers)) if full_layers else set()
    windows = tuple(None if i in full else window for i in range(num_layers))
    return LayerPlan(windows, num_slots, float(gate_normalizer), float(slot_bias_init))
