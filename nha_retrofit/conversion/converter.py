"""Turn a pretrained checkpoint into a self-contained NHA checkpoint (safetensors + remote code + tokenizer).

`convert` works on the files: it validates the plan and the checkpoint before writing anything, copies the
original shards, adds one shard holding each NHA layer's gate projection and slot-logit offset, writes the NHA
config (with `auto_map`) and the package's modeling files beside it, all into a temporary folder renamed when
complete. `build_nha_model` is the in-memory equivalent (finetuning from a base model converts on the fly).
"""

import json
import re
import shutil
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig

from ..atomic import atomic_folder, check_output_folder
from ..checksums import write_checksums
from ..errors import NHARetrofitError
from ..modeling.modeling_nha import NHA_MODEL_CLASSES
from ..modeling.remote_code import write_remote_code
from ..plan import LayerPlan, PlanSpec, build_plan, cache_dims
from .download import TOKENIZER_FILES
from .layer_ranking import plan_ranking
from .resolve import resolve_model
from .shards import TensorReader, find_checkpoint, write_sharded
from .source import read_source_config_dict

CONVERSION_RECORD = "nha_conversion.json"
GATE_INITS = ("from_k", "random")


def nha_config_for(source_config: dict, plan: LayerPlan):
    """The NHA config: the original's fields plus the plan; the original's own window settings are switched off."""
    model_class = NHA_MODEL_CLASSES[source_config["model_type"]]
    fields = {k: v for k, v in source_config.items() if k not in ("model_type", "architectures", "auto_map")}
    fields.pop("layer_types", None)
    if "use_sliding_window" in fields:
        fields["use_sliding_window"] = False
    try:
        config = model_class.config_class.from_dict({**fields, **plan.config_fields()})
    except (ValueError, TypeError) as error:
        raise NHARetrofitError(f"invalid config for {source_config['model_type']}: {str(error).splitlines()[0]}") from None
    config.architectures = [model_class.__name__]
    return model_class, config


def gate_from_keys(key_weight: torch.Tensor, num_kv_heads: int, slots: int) -> torch.Tensor:
    """g_proj starts as k_proj: slot i of KV head h takes the weights of key channel (i mod D) of that head.

    With M == D it is a copy per head; M < D takes the first M channels; M > D repeats them cyclically.
    """
    per_head = key_weight.view(num_kv_heads, -1, key_weight.shape[-1])
    channel = torch.arange(slots) % per_head.shape[1]
    return per_head[:, channel].reshape(num_kv_heads * slots, -1).clone()


def new_layer_tensors(config, plan: LayerPlan, key_weight, layer: int, gate_init: str) -> dict:
    """The tensors an NHA layer adds: `g_proj.weight` and `slot_bias` (and `g_proj.bias` when the plan sets a gate
    bias), in the checkpoint's dtype."""
    prefix = f"model.layers.{layer}.self_attn."
    kv_heads = config.num_key_value_heads
    if gate_init == "from_k":
        gate = gate_from_keys(key_weight, kv_heads, plan.num_slots)
    else:
        generator = torch.Generator().manual_seed(layer)
        gate = torch.randn(kv_heads * plan.num_slots, key_weight.shape[-1], generator=generator)
        gate = (gate * config.initializer_range).to(key_weight.dtype)
    bias = torch.full((config.num_attention_heads,), plan.slot_bias_init, dtype=key_weight.dtype)
    added = {prefix + "g_proj.weight": gate, prefix + "slot_bias": bias}
    if plan.gate_bias_init is not None:
        added[prefix + "g_proj.bias"] = torch.full((kv_heads * plan.num_slots,), plan.gate_bias_init,
                                                   dtype=key_weight.dtype)
    return added


def check_tensor_names(checkpoint, model_class, config) -> None:
    """Every tensor of the checkpoint is one the config's model loads, and every one it needs is there: a config
    that names fewer layers than the shards hold (or more) is refused instead of converting part of them. Names go
    through transformers' own renaming of checkpoint keys (per-expert tensors load into fused ones)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = model_class(config)
    loads_into = _model_names(model, checkpoint.weight_map)
    expected = set(model.state_dict())
    added = {name for name in expected if name.endswith((".g_proj.weight", ".g_proj.bias", ".slot_bias"))}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(expected - added - optional - set(loads_into.values()))
    ignored = [re.compile(p) for p in getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or []]
    extra = sorted(name for name, target in loads_into.items()
                   if target not in expected and not any(p.search(name) for p in ignored))
    if missing or extra:
        layers = f"config.json gives {config.num_hidden_layers} layers; "
        detail = f"it lacks {missing[0]}" if missing else f"it holds {extra[0]}, which that model does not have"
        raise NHARetrofitError(f"the checkpoint in {checkpoint.folder} does not match its config: {layers}{detail} "
                               f"({len(missing)} missing, {len(extra)} unexpected)")


def _model_names(model, names) -> dict:
    """checkpoint tensor name -> the name of the model's tensor it loads into, as transformers renames them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    expected = model.state_dict()
    renamed = {name: rename_source_key(name, renamings, converters, model.base_model_prefix, expected)[0]
               for name in names}
    return {name: name if target not in expected and name in expected else target for name, target in renamed.items()}


def copy_tokenizer_files(source: Path, folder: Path) -> list[str]:
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, folder / name)
    return copied


def convert(
    model: str,
    output: str | Path,
    spec: PlanSpec = PlanSpec(),
    *,
    gate_init: str = "from_k",
    allow_pickle: bool = False,
    overwrite: bool = False,
    revision: str | None = None,
    token: str | None = None,
    log=print,
) -> Path:
    """Convert `model` (local folder, Hub id, or an embedded name such as "smollm2-135m") into an NHA checkpoint at
    `output`, with the layer plan `spec` asks for. A Hub id missing from the Hugging Face cache is downloaded into it
    first (at `revision`, with `token`). Everything is validated before a byte is written; the output appears
    atomically."""
    output = Path(output)
    check_output_folder(output, overwrite)
    if gate_init not in GATE_INITS:
        raise NHARetrofitError(f"--gate-init {gate_init}: choose one of {', '.join(GATE_INITS)}")
    # the config first: a model the plan or the family rules out is refused before any weight is downloaded
    source = resolve_model(model, revision=revision, token=token, weights=False)
    source_config = read_source_config_dict(source)
    num_layers, kv_heads = source_config["num_hidden_layers"], cache_dims(source_config)[0]
    placeholder = [(layer, head) for layer in range(num_layers) for head in range(kv_heads)]
    model_class, config = nha_config_for(source_config, build_plan(num_layers, spec, list(range(num_layers)),
                                                                   placeholder, kv_heads))
    source = resolve_model(model, revision=revision, token=token, allow_pickle=allow_pickle)
    checkpoint = find_checkpoint(source, allow_pickle=allow_pickle)  # damaged shards are refused before the probe
    check_tensor_names(checkpoint, model_class, config)
    ranking = plan_ranking(source, spec, num_layers, log=log)
    plan = build_plan(num_layers, spec, ranking.layers, ranking.heads, kv_heads)
    model_class, config = nha_config_for(source_config, plan)
    log(f"plan: {plan.describe()}")
    with atomic_folder(output, overwrite, log=log) as tmp:
        reader = TensorReader(checkpoint)
        new_tensors = {}
        for layer in range(len(plan.windows)):
            key_weight = reader.get(f"model.layers.{layer}.self_attn.k_proj.weight")
            new_tensors.update(new_layer_tensors(config, plan, key_weight, layer, gate_init))
        digests = write_sharded(checkpoint, new_tensors, tmp)
        config.dtype = _checkpoint_dtype(source_config, new_tensors)
        config.save_pretrained(tmp)
        write_remote_code(tmp, model_class)
        copy_tokenizer_files(source, tmp)
        record = {"source": str(model), "source_path": str(source), "plan": plan.as_dict(), "gate_init": gate_init}
        if ranking.scores:
            record["layer_retrieval_scores"] = ranking.scores.layers
            record["head_retrieval_scores"] = ranking.scores.heads
        (tmp / CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        write_checksums(tmp, digests)
    log(f"wrote {output}")
    return output


def _checkpoint_dtype(source_config: dict, new_tensors: dict) -> str:
    dtype = source_config.get("dtype") or source_config.get("torch_dtype")
    return dtype or str(next(iter(new_tensors.values())).dtype).removeprefix("torch.")


def build_nha_model(source: Path, plan: LayerPlan, gate_init: str = "from_k"):
    """In memory: load the original weights straight into the NHA class and initialise the new parameters exactly
    as `convert` writes them."""
    model_class, config = nha_config_for(read_source_config_dict(source), plan)
    original = AutoConfig.from_pretrained(source)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the gate weights are "missing" from the original: expected
    try:
        model = model_class.from_pretrained(source, config=config, dtype=original.dtype or torch.float32)
    finally:
        transformers.logging.set_verbosity(verbosity)
    with torch.no_grad():
        for layer, attention in enumerate(model.nha_attention_layers()):
            prefix = f"model.layers.{layer}.self_attn."
            tensors = new_layer_tensors(config, plan, attention.k_proj.weight.detach().cpu(), layer, gate_init)
            for name, tensor in tensors.items():
                attention.get_parameter(name[len(prefix):]).copy_(tensor)
    return model.eval()


def save_nha_checkpoint(model, folder: Path, tokenizer_source: Path | None = None, record: dict | None = None):
    """save_pretrained with remote code (auto_map + modeling files copied verbatim), tokenizer and a record."""
    model.save_pretrained(folder)
    write_remote_code(folder, type(model))
    if tokenizer_source is not None:
        copy_tokenizer_files(Path(tokenizer_source), folder)
        if not (folder / "generation_config.json").is_file() and model.generation_config is not None:
            model.generation_config.save_pretrained(folder)
    if record is not None:
        (folder / CONVERSION_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    write_checksums(folder)
