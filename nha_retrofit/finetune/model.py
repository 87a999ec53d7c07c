"""The model to finetune: a converted checkpoint, or an original converted on the fly; its trainable set."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import NHARetrofitError
from ..modeling.modeling_nha import NHAAttentionMixin
from .recipe import ModelSection, TrainSection


@dataclass
class ModelSource:
    folder: Path  # the checkpoint folder read (converted NHA, or the original): its config and tokenizer
    converted: bool  # True when folder already is an NHA checkpoint
    original: str  # what the user named as the original model (for the export record)
    original_path: Path | None
    plan: object = None  # LayerPlan when converting on the fly
    record: dict | None = None  # the conversion record of a converted checkpoint
    spec: ModelSection | None = None  # the recipe's model section (its weights are resolved when loading)


def resolve_source(spec: ModelSection) -> ModelSource:
    """Decide how to obtain the NHA model, reading only config and tokenizer files (a Hub id's weights are not
    downloaded for a dry run: `load_model` fetches them), unless the plan's full layers are chosen by the retrieval
    probe, which reads the original's weights."""
    from ..conversion.converter import CONVERSION_RECORD
    from ..conversion.resolve import resolve_model
    from ..conversion.source import read_source_config_dict
    from ..modeling.load import nha_family
    from ..conversion.layer_ranking import Ranking, plan_ranking
    from ..plan import PlanSpec, PlanSpecError, build_plan, cache_dims

    folder = resolve_model(spec.path, revision=spec.revision, weights=False)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise NHARetrofitError(f"cannot read {folder / 'config.json'}: {error}") from None
    if nha_family(config) is not None:
        if spec.convert is not None:
            raise NHARetrofitError(
                f"recipe key model.convert: {spec.path} is already converted ({config['model_type']}); remove "
                f"model.convert"
            )
        record_path = folder / CONVERSION_RECORD
        record = json.loads(record_path.read_text()) if record_path.is_file() else None
        original_path = Path(record["source_path"]) if record and record.get("source_path") else None
        original = record.get("source", str(original_path)) if record else "unknown"
        return ModelSource(folder, True, original, original_path, None, record, spec)
    config = read_source_config_dict(folder)
    plan_spec = spec.convert or PlanSpec()
    ranking = Ranking(None, None, None)
    if plan_spec.needs_ranking:  # the retrieval probe reads the weights (downloaded here for a Hub id)
        folder = resolve_model(spec.path, revision=spec.revision)
        ranking = plan_ranking(folder, plan_spec, config["num_hidden_layers"])
    try:
        plan = build_plan(config["num_hidden_layers"], plan_spec, ranking.layers, ranking.heads, cache_dims(config)[0])
    except PlanSpecError as error:
        raise NHARetrofitError(f"recipe key model.convert.{error.field}: {error.detail}") from None
    return ModelSource(folder, False, spec.path, folder, plan, None, spec)


def _model_class_and_config(source: ModelSource):
    from ..conversion.converter import nha_config_for
    from ..conversion.source import read_source_config_dict
    from ..modeling.load import nha_family
    from ..modeling.modeling_nha import NHA_MODEL_CLASSES

    if source.converted:
        family = nha_family(json.loads((source.folder / "config.json").read_text()))
        if family not in NHA_MODEL_CLASSES:
            raise NHARetrofitError(f"{source.folder}: unsupported NHA family {family}")
        model_class = NHA_MODEL_CLASSES[family]
        return model_class, model_class.config_class.from_pretrained(source.folder)
    return nha_config_for(read_source_config_dict(source.folder), source.plan)


def model_config(source: ModelSource):
    """The NHA config of the model to train, without reading weights."""
    return _model_class_and_config(source)[1]


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """The NHA model in `dtype` on the CPU (accelerate moves it)."""
    from ..conversion.converter import build_nha_model
    from ..conversion.resolve import resolve_model
    from ..modeling.load import load_nha_checkpoint

    folder = source.folder if source.spec is None else resolve_model(source.spec.path, revision=source.spec.revision)
    if source.converted:
        return load_nha_checkpoint(folder, dtype=dtype)
    model = build_nha_model(folder, source.plan)
    for param in model.parameters():  # buffers (RoPE frequencies) stay as transformers made them, in fp32
        param.data = param.data.to(dtype)
    return model


def frozen_matrices(model) -> list:
    """Frozen weights that autocast casts at every use (matrices and expert tensors; not embeddings)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [p for p in model.parameters() if not p.requires_grad and p.ndim >= 2 and id(p) not in embeddings]


def fp32_except_frozen_matrices(model):
    """fp32 for what trains (the optimizer's master copy) and for what autocast does not cast at use (norms, biases,
    embeddings: the residual stream stays fp32); frozen matrices keep the dtype they were loaded in, the compute dtype
    when the checkpoint holds them in it. Autocast would cast them to it at every use anyway: the numbers are those of
    all-fp32 weights, at half the memory and without the casts."""
    low = {id(p) for p in frozen_matrices(model)}
    for param in model.parameters():
        if id(param) not in low and param.dtype != torch.float32:
            param.data = param.data.float()
    return model


def trainable_in(model, dtype: torch.dtype):
    """Every trained parameter in `dtype`, for DeepSpeed: it flattens each parameter group into one buffer of one
    dtype and keeps its own fp32 master copy, while peft makes LoRA weights fp32 beside a bf16 model's gates."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


def meta_model(source: ModelSource):
    """A weightless copy (parameters on the meta device, buffers such as RoPE frequencies real) for --dry-run and
    export skeletons: no gigabytes read."""
    from accelerate import init_empty_weights

    model_class, config = _model_class_and_config(source)
    with init_empty_weights(include_buffers=False):
        return model_class(config)


def nha_modules(model) -> list[NHAAttentionMixin]:
    return [m for m in model.modules() if isinstance(m, NHAAttentionMixin)]


def _nha_layer_prefixes(model) -> list[str]:
    return [name + "." for name, m in model.named_modules() if isinstance(m, NHAAttentionMixin) and m.window is not None]


def select_trainable(model, spec: TrainSection):
    """Apply the trainable set; returns the model to train (a peft model for `lora`)."""
    prefixes = _nha_layer_prefixes(model)
    if not prefixes:
        raise NHARetrofitError("the model has no NHA layer (every window is full): nothing of NHA to train")
    projections = ("q_proj.", "k_proj.", "v_proj.", "o_proj.")
    for name, param in model.named_parameters():
        in_nha = any(name.startswith(p) for p in prefixes)
        local = name[len(next(p for p in prefixes if name.startswith(p))) :] if in_nha else ""
        gate = in_nha and (local.startswith("g_proj.") or local == "slot_bias")
        if spec.trainable == "full":
            param.requires_grad_(True)
        elif spec.trainable in ("gates", "lora"):
            param.requires_grad_(gate)
        else:  # attention: the paper's setting (FFN, embeddings, norms and full layers frozen)
            param.requires_grad_(gate or (in_nha and local.startswith(projections)))
    if spec.trainable != "lora":
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise NHARetrofitError("train.trainable: lora needs the `peft` package: pip install peft") from None
    targets = "|".join(t.replace(".", r"\.") for t in spec.lora.target_modules)
    layers = "|".join(p.rstrip(".").replace(".", r"\.") for p in prefixes)
    config = LoraConfig(
        r=spec.lora.r, lora_alpha=spec.lora.alpha, lora_dropout=spec.lora.dropout,
        target_modules=rf"^(?:{layers})\.(?:{targets})$", bias="none",
    )
    gates = {n for n, p in model.named_parameters() if p.requires_grad}
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as error:
        raise NHARetrofitError(f"recipe key train.lora.target_modules: {str(error).splitlines()[0]}") from None
    for name, param in peft_model.get_base_model().named_parameters():
        if name in gates:  # peft froze the base model: gates and slot offsets stay fully trainable
            param.requires_grad_(True)
    return peft_model


def count_parameters(model) -> tuple[int, int]:
    seen, trainable, total = set(), 0, 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return trainable, total
