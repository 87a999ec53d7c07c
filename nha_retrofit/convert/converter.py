"""Turn a pretrained checkpoint into a self-contained NHA checkpoint (safetensors + remote code + tokenizer)."""

import json
import logging
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ..atomic import atomic_folder, check_output_folder
from ..errors import NHARetrofitError
from ..modeling.configuration_nha import NHALlamaConfig
from ..modeling.modeling_nha import NHAAttentionMixin, NHALlamaForCausalLM
from ..plan import LayerPlan, build_plan
from .resolve import resolve_model

# model_type of the original -> (NHA config class, NHA model class)
FAMILIES = {"llama": (NHALlamaConfig, NHALlamaForCausalLM)}
CONVERSION_RECORD = "nha_conversion.json"


def read_source_config(source: Path):
    """The original's config, after checking that its family is one we convert."""
    try:
        model_type = json.loads((Path(source) / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError) as error:
        raise NHARetrofitError(f"cannot read {Path(source) / 'config.json'}: {error}") from None
    if model_type.startswith("nha_"):
        raise NHARetrofitError(f"{source} is already an NHA checkpoint ({model_type}); change its windows instead")
    if model_type not in FAMILIES:
        raise NHARetrofitError(
            f"unsupported architecture {model_type or 'unknown'} in {source}; supported families: "
            + ", ".join(sorted(FAMILIES))
        )
    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise NHARetrofitError(f"invalid {Path(source) / 'config.json'}: {str(error).splitlines()[0]}") from None


def init_gate_from_keys(attention: NHAAttentionMixin) -> None:
    """g_proj starts as k_proj: slot i of KV head h takes the weights of key channel (i mod D) of that head.

    With M == D (the default 64 slots for 64- or 128-dim heads take the first M channels) this is a copy per
    head; with M > D channels repeat cyclically. The paper initialises the gate from k_proj the same way.
    """
    head_dim, slots = attention.head_dim, attention.num_slots
    keys = attention.k_proj.weight.detach().view(attention.num_kv_heads, head_dim, -1)
    channel = torch.arange(slots, device=keys.device) % head_dim
    with torch.no_grad():
        attention.g_proj.weight.copy_(keys[:, channel].reshape(attention.num_kv_heads * slots, -1))


def build_nha_model(source: Path, plan: LayerPlan, source_config=None):
    """Load the original weights straight into the NHA model class and initialise the new parameters."""
    source_config = source_config or read_source_config(source)
    config_class, model_class = FAMILIES[source_config.model_type]
    config_dict = {**source_config.to_dict(), **plan.config_fields()}
    for key in ("model_type", "architectures", "auto_map", "transformers_version"):
        config_dict.pop(key, None)
    config = config_class(**config_dict)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the gate weights are "missing" from the original: expected
    try:
        model = model_class.from_pretrained(source, config=config, dtype=source_config.dtype or torch.float32)
    finally:
        transformers.logging.set_verbosity(verbosity)
    for attention in model.nha_attention_layers():
        init_gate_from_keys(attention)
        with torch.no_grad():
            attention.slot_bias.fill_(plan.slot_bias_init)
    return model.eval()


def save_nha_checkpoint(model, folder: Path, tokenizer_source: Path | None = None, record: dict | None = None):
    """save_pretrained with remote code (auto_map + modeling files copied verbatim), tokenizer and a record."""
    type(model.config).register_for_auto_class()
    type(model).register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(folder)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if tokenizer_source is not None and any((Path(tokenizer_source) / f).is_file() for f in tokenizer_files):
        try:
            AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(folder)
        except (OSError, ValueError) as error:
            logging.getLogger(__name__).warning("no tokenizer copied from %s: %s", tokenizer_source, error)
    if tokenizer_source is not None and (Path(tokenizer_source) / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(tokenizer_source).save_pretrained(folder)
    if record is not None:
        (folder / CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def convert(
    model: str,
    output: str | Path,
    *,
    full_layers: int | None = 4,
    full_layer_ids: list[int] | None = None,
    window: int = 64,
    slots: int = 64,
    gate_normalizer: float = 8.0,
    slot_bias_init: float = -4.0,
    overwrite: bool = False,
    log=print,
) -> Path:
    """Convert `model` (local folder, cached Hub id, or an embedded name such as "smollm2-135m") into an NHA
    checkpoint at `output`. Validates everything before reading weights; writes atomically."""
    output = Path(output)
    check_output_folder(output, overwrite)
    build_plan(1, full_layers=0, window=window, num_slots=slots, gate_normalizer=gate_normalizer)  # early checks
    source = resolve_model(model)
    source_config = read_source_config(source)
    plan = build_plan(
        source_config.num_hidden_layers, full_layers=full_layers, full_layer_ids=full_layer_ids, window=window,
        num_slots=slots, gate_normalizer=gate_normalizer, slot_bias_init=slot_bias_init,
    )
    log(f"plan: {plan.describe()}")
    nha_model = build_nha_model(source, plan, source_config)
    record = {"source": str(model), "source_path": str(source), "plan": plan.as_dict()}
    with atomic_folder(output, overwrite) as tmp:
        save_nha_checkpoint(nha_model, tmp, tokenizer_source=source, record=record)
    log(f"wrote {output}")
    return output
