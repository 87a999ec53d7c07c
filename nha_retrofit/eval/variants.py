"""The models an evaluation compares, all on one NHA checkpoint's weight tensors (loaded once, on one device):

- ``original``: the family's own transformers class (`LlamaForCausalLM`, ...) holding the same tensors, every layer
  full attention through transformers' attention code;
- ``nha``: the checkpoint as planned;
- ``nha_all_full``: the NHA model with every window full (`set_windows([None] * L)`), which must score exactly as
  ``original``: a visible check of the conversion;
- ``window_only``: the NHA model with its slot reads switched off (`slot_reads_disabled()`), the same windows: the
  sliding-window baseline that shows what the slots add.

On a finetuned checkpoint the weights are the trained ones, so ``original`` is those weights under full attention;
the pretrained model is the ``original`` of the checkpoint it was converted to before training.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..conversion.converter import CONVERSION_RECORD
from ..errors import NHARetrofitError
from ..modeling.decoding import original_sharing_weights
from ..modeling.load import nha_checkpoint_class

VARIANTS = ("original", "nha", "nha_all_full", "window_only")
VARIANT_TITLES = {"original": "original", "nha": "NHA", "nha_all_full": "NHA, all full", "window_only": "window only"}


def check_variants(names) -> list[str]:
    names = list(names)
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise NHARetrofitError(f"unknown model variant {unknown[0] if unknown else '(none given)'!r}; choose from "
                               f"{', '.join(VARIANTS)}")
    return names


def training_context(folder: Path, config) -> int:
    """Tokens per sequence the checkpoint was trained on: the finetuning's `data.seq_len` when the conversion record
    holds one, else the config's `max_position_embeddings` (the pretrained model's own context)."""
    record_path = Path(folder) / CONVERSION_RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    seq_len = ((record.get("finetune") or {}).get("recipe") or {}).get("data", {}).get("seq_len")
    return int(seq_len) if seq_len else int(config.max_position_embeddings)


def read_checkpoint_facts(folder) -> tuple[int, int]:
    """(max_position_embeddings, training context) from the files alone, before any weights are loaded."""
    folder = Path(folder)
    config = nha_checkpoint_class(folder).config_class.from_pretrained(folder)
    return int(config.max_position_embeddings), training_context(folder, config)


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise NHARetrofitError(f"{folder} has no usable tokenizer ({str(error).splitlines()[0]})") from None


class Variants:
    """The compared models of one NHA model, switched in turn: `with variants.use(name) as model: ...`."""

    def __init__(self, model, names=VARIANTS):
        self.model = model
        self.names = check_variants(names)
        self._original = None

    @contextlib.contextmanager
    def use(self, name: str):
        """`name`'s model while inside; the NHA model is back as planned (windows, slot reads) on leaving."""
        if name == "original":
            if self._original is None:
                self._original = original_sharing_weights(self.model)
            yield self._original
        elif name == "nha":
            yield self.model
        elif name == "nha_all_full":
            planned = list(self.model.config.nha_windows)
            heads = self.model.config.nha_layer_full_kv_heads
            self.model.set_windows([None] * len(planned))
            try:
                yield self.model
            finally:
                self.model.set_windows(planned, heads)
        elif name == "window_only":
            with self.model.slot_reads_disabled():
                yield self.model
        else:
            check_variants([name])
