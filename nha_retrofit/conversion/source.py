"""The original checkpoint's config.json, read once and checked: a family we convert, with the fields we need.

The CLI reads it here and hands the dict on (to `plan.plan_table` for `nha-retrofit plan`); the converter, the
finetuning loader and the layer search read it here too, so the checks and their messages are the same everywhere.
"""

import json
from pathlib import Path

from ..errors import NHARetrofitError
from ..modeling.load import nha_family
from ..modeling.modeling_nha import NHA_MODEL_CLASSES

REQUIRED_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size")



def read_source_config_dict(source: Path) -> dict:
    """The original's config.json, after checking that its family is one we convert and it has what we need."""
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise NHARetrofitError(f"cannot read {Path(source) / 'config.json'}: {error}") from None
    model_type = config.get("model_type", "")
    if nha_family(config) is not None:
        raise NHARetrofitError(f"{source} is already an NHA checkpoint ({model_type}); change its windows instead")
    if model_type not in NHA_MODEL_CLASSES:
        supported = ", ".join(f"{t} ({NHA_MODEL_CLASSES[t].__mro__[2].__name__})" for t in sorted(NHA_MODEL_CLASSES))
        raise NHARetrofitError(f"unsupported architecture {model_type or 'unknown'} in {source}; supported: {supported}")
    missing = [field for field in REQUIRED_FIELDS if not isinstance(config.get(field), int)]
    if missing:
        raise NHARetrofitError(f"{Path(source) / 'config.json'} lacks the required field {missing[0]}")
    return config
