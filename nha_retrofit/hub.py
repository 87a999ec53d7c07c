"""Publishing an NHA checkpoint on the Hugging Face Hub.

The folder is checked complete first (config, every safetensors shard whole, remote code, tokenizer), only the files
a checkpoint consists of are sent, a model card is written from the conversion record unless the folder has its own
README.md, and everything goes up in one commit through huggingface_hub (large files included), so the repository
never shows half a model.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

from .checksums import CHECKSUMS, checksums_of, verify_checksums
from .conversion.converter import CONVERSION_RECORD, TOKENIZER_FILES
from .conversion.shards import SAFETENSORS_INDEX, find_checkpoint
from .errors import NHARetrofitError
from .eval.report import EVAL_RECORD, read_record
from .modeling.load import nha_checkpoint_class
from .modeling.remote_code import checkpoint_remote_code
from .plan import cache_dims, nha_state_bytes

CARD_TAGS = ["nha", "native-hybrid-attention", "hybrid-attention", "nha-retrofit"]


@dataclass
class Upload:
    """What one push sends: files copied from the folder, and files written for the Hub (path -> bytes)."""

    folder: Path
    files: list[str]
    written: dict[str, bytes]
    skipped: list[str]

    def describe(self) -> str:
        lines = [f"upload from {self.folder}:"]
        lines += [f"  {name}" for name in self.files]
        lines += [f"  {name} (written for the Hub)" for name in self.written]
        lines += [f"  skipped: {name}" for name in self.skipped]
        return "\n".join(lines)

    def model_card(self) -> str:
        """The README.md the push sends: the one written for the Hub, or the folder's own."""
        if "README.md" in self.written:
            return self.written["README.md"].decode()
        return (self.folder / "README.md").read_text()


def checkpoint_files(folder: Path) -> list[str]:
    """The files an NHA checkpoint consists of, after checking they are all there, whole and unaltered."""
    nha_checkpoint_class(folder)
    config = json.loads((folder / "config.json").read_text())
    if "auto_map" not in config:
        raise NHARetrofitError(f"{folder}/config.json has no auto_map: it would not load with trust_remote_code")
    try:
        modeling = checkpoint_remote_code(folder)
    except FileNotFoundError as missing:
        raise NHARetrofitError(f"{folder} lacks the remote code file {missing}") from None
    weights = find_checkpoint(folder).files  # allow_pickle=False: only safetensors, each checked whole
    index = [SAFETENSORS_INDEX] if (folder / SAFETENSORS_INDEX).is_file() else []
    if not (folder / "tokenizer_config.json").is_file():
        raise NHARetrofitError(f"{folder} has no tokenizer files: the model would not be usable from the Hub")
    tokenizer = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    verify_checksums(folder)
    return ["config.json", *index, *weights, *modeling, *tokenizer]


def public_record(folder: Path) -> dict | None:
    """The conversion record as it goes out: only the fields `PUBLIC_RECORD` allows, so no path of this machine."""
    path = folder / CONVERSION_RECORD
    if not path.is_file():
        return None
    return _allowed(json.loads(path.read_text()), PUBLIC_RECORD)


ANY, NAME = "any", "name"  # the value goes out as it is; only when it names a Hub repository or an embedded model
_TRAIN_FIELDS = (
    "trainable", "lora", "optimizer", "lr", "weight_decay", "betas", "schedule", "warmup_steps", "min_lr_ratio",
    "batch_size", "grad_accum", "max_grad_norm", "precision", "gradient_checkpointing", "seed", "checkpoint_every",
    "keep_checkpoints", "eval_every", "log_every", "tensorboard", "stop_after_steps", "threads",
)
_RUN_PLAN_FIELDS = (
    "converted_on_the_fly", "full_layers", "windows", "processes", "tokens_per_step", "attention_transfer_steps",
    "lm_steps", "total_steps", "total_tokens", "sharding", "trainable_parameters", "total_parameters", "epochs",
    "memory_per_gpu_gib",
)
PUBLIC_RECORD = {
    "source": NAME, "plan": ANY, "gate_init": ANY,
    "finetune": {
        **dict.fromkeys(("machine", "trainable_parameters", "total_parameters", "steps", "tokens", "wall_time_s",
                         "peak_gib", "before", "after"), ANY),
        "plan": dict.fromkeys(_RUN_PLAN_FIELDS, ANY),
        "recipe": {
            "model": {"path": NAME, "revision": ANY, "convert": ANY},
            "data": {"dataset": NAME, **dict.fromkeys(("dataset_config", "split", "text_field", "seq_len",
                                                       "eval_blocks", "seed", "shuffle_buffer"), ANY)},
            "train": dict.fromkeys(_TRAIN_FIELDS, ANY),
            "stages": ANY, "eval": ANY, "export": {"enabled": ANY},
        },
    },
}


def _allowed(value, spec):
    """`value` cut down to what `spec` (a nested dict of field -> ANY, NAME or a further spec) allows."""
    if spec == ANY:
        return value
    if spec == NAME:
        return value if isinstance(value, str) and _names_a_repository(value) else None
    if not isinstance(value, dict):
        return None
    kept = {key: _allowed(value[key], rule) for key, rule in spec.items() if key in value}
    return {key: item for key, item in kept.items() if item is not None}


def _names_a_repository(text: str) -> bool:
    from .conversion.resolve import EMBEDDED_MODELS, is_hub_id

    return text.lower() in EMBEDDED_MODELS or is_hub_id(text)


def card_eval_results(evaluation: dict | None) -> list:
    """The NHA model's scores in the latest evaluation (`nha-retrofit eval`'s `nha_eval.json`) as the card's
    `eval_results`: held-out perplexities, lm-evaluation-harness metrics, and retrieval accuracy per length (mean
    over needle depths). The other compared models are the card's tables, not its metadata."""
    from huggingface_hub import EvalResult

    results = []
    evaluation = evaluation or {}
    for text, values in (evaluation.get("heldout") or {}).items():
        if "nha" in values:
            results.append(EvalResult(task_type="text-generation", dataset_type=f"nha-retrofit/{text}",
                                      dataset_name=f"held-out {text}", metric_type="perplexity",
                                      metric_value=round(values["nha"], 4)))
    for task, entry in (evaluation.get("harness") or {}).items():
        for metric, values in entry["metrics"].items():
            if "nha" in values:
                results.append(EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                          metric_type=metric, metric_value=round(values["nha"], 4)))
    for task, result in (evaluation.get("retrieval") or {}).items():
        grid = result["accuracy"].get("nha")
        for length, row in zip(result["lengths"], grid or []):
            results.append(EvalResult(task_type="text-generation", dataset_type=f"nha-retrofit/{task}",
                                      dataset_config=str(length), dataset_name=f"{task}, {length} tokens",
                                      metric_type="accuracy", metric_value=round(sum(row) / len(row), 4)))
    return results


def model_card(repo_id: str, config: dict, record: dict | None, evaluation: dict | None = None) -> str:
    """A README.md for the Hub: metadata for search (with the latest `nha-retrofit eval` scores as `eval_results`),
    what the model is, how to load it, what was measured."""
    from huggingface_hub import ModelCardData

    windows = config["nha_windows"]
    full = [i for i, w in enumerate(windows) if w is None]
    full_heads = ", ".join(f"{layer}:{head}" for layer, heads in enumerate(config.get("nha_full_kv_heads") or [])
                           for head in heads)
    nha_windows = sorted({w for w in windows if w is not None})
    slots = config["nha_num_slots"]
    source = (record or {}).get("source", "")
    base = source if "/" in source and not Path(source).is_absolute() else None
    scores = card_eval_results(evaluation)
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=CARD_TAGS,
                         base_model=base, eval_results=scores or None,
                         model_name=repo_id.split("/")[-1] if scores else None)
    kv_heads, head_dim, width = cache_dims(config)
    state = nha_state_bytes(kv_heads, head_dim, slots, max(nha_windows, default=0), width)
    of = f"of [{base}](https://huggingface.co/{base})" if base else f"of {source or 'a pretrained model'}"
    lines = [
        f"---\n{data.to_yaml()}\n---",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"A Native Hybrid Attention (NHA, arXiv 2510.07019) hybrid {of}, made with nha-retrofit. "
        f"{len(windows) - len(full)} of {len(windows)} layers read a {slots}-slot gated memory plus a sliding window "
        f"of {', '.join(map(str, nha_windows)) or '-'} tokens under one softmax; layers {full or 'none'} keep full "
        "attention" + (f", and so do KV heads (layer:head) {full_heads} inside NHA layers" if full_heads else "")
        + ". Each NHA layer adds a gate projection and a per-head slot offset to the original attention.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)',
        'inputs = tokenizer("The capital of France is", return_tensors="pt")',
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))",
        "```",
        "",
        f"Generation keeps an ordinary KV cache only for the full layers{' and heads' if full_heads else ''}; each "
        f"NHA layer holds a fixed {state:,} bytes per sequence{' at most' if full_heads else ''} however long the "
        "context. `model.set_windows([...])` changes any layer's window at "
        "inference time (`None` = full attention).",
    ]
    finetune = (record or {}).get("finetune")
    if finetune and (finetune.get("before") or finetune.get("after")):
        before, after = finetune.get("before", {}), finetune.get("after", {})
        lines += ["", "## Measured during finetuning (held out)", "", "| metric | before | after |", "|---|---|---|"]
        for key in sorted(set(before) | set(after)):
            cells = [f"{table[key]:.4g}" if key in table else "-" for table in (before, after)]
            lines.append(f"| {key} | {cells[0]} | {cells[1]} |")
    elif record is not None and not finetune:
        lines += ["", "Converted, not finetuned: the gates start from the key projections; finetune before use."]
    if evaluation:
        from .eval.report import format_report

        lines += ["", "## Evaluation", "", "The latest `nha-retrofit eval` of this checkpoint: the original model "
                  "(every layer full attention, the same weights), the NHA model, it with every window full, and it "
                  "with its slot reads off (sliding windows alone).", "", format_report(evaluation).rstrip()]
    return "\n".join(lines) + "\n"


def prepare_upload(folder, repo_id: str) -> Upload:
    """Check the folder and the repository id; decide what goes up. Touches no network."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    folder = Path(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise NHARetrofitError(f"{repo_id!r} is not a Hub repository id such as your-name/model-nha") from None
    if "/" not in repo_id:
        raise NHARetrofitError(f"{repo_id!r}: name the owner too, e.g. your-name/{repo_id}")
    files = checkpoint_files(folder)
    written = {}
    record = public_record(folder)
    if record is not None:
        written[CONVERSION_RECORD] = (json.dumps(record, indent=2) + "\n").encode()
    evaluation = read_record(folder)
    if evaluation is not None:
        files.append(EVAL_RECORD)
    if (folder / "README.md").is_file():
        files.append("README.md")
    else:
        config = json.loads((folder / "config.json").read_text())
        written["README.md"] = model_card(repo_id, config, record, evaluation).encode()
    if (folder / CHECKSUMS).is_file():  # verified above: the repository carries the digests of what it holds
        written[CHECKSUMS] = checksums_of(folder, files, written)
    sent = set(files) | set(written)
    skipped = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                     if p.is_file() and str(p.relative_to(folder)) not in sent)
    return Upload(folder, files, written, skipped)


def transport_errors() -> tuple[type, ...]:
    """The HTTP client's connection errors (huggingface_hub 1.x uses httpx, later versions httpx2)."""
    for name in ("httpx2", "httpx"):
        try:
            return (importlib.import_module(name).TransportError,)
        except ImportError:
            continue
    return ()


def push_checkpoint(upload: Upload, repo_id: str, *, private: bool = False, branch: str | None = None,
                    commit_message: str | None = None, token: str | None = None, api=None) -> str:
    """Create the repository if needed and send `upload` in one commit; returns the commit's URL."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    api = api or HfApi(token=token)
    try:
        api.whoami()
        api.create_repo(repo_id, private=private, exist_ok=True)
        if branch is not None:
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(upload.folder / name))
                      for name in upload.files]
        operations += [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data)
                       for name, data in upload.written.items()]
        commit = api.create_commit(repo_id, operations=operations, revision=branch,
                                   commit_message=commit_message or f"Upload NHA checkpoint from {upload.folder.name}")
    except LocalTokenNotFoundError:
        raise NHARetrofitError("not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN") from None
    except HfHubHTTPError as error:
        raise NHARetrofitError(f"the Hub refused the upload: {str(error).splitlines()[0]}") from None
    except (OSError, *transport_errors()) as error:  # no network, offline mode (HF_HUB_OFFLINE=1)
        raise NHARetrofitError(f"the Hub could not be reached: {str(error).splitlines()[0]}") from None
    return commit.commit_url
