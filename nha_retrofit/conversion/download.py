"""A Hub id's snapshot: found in the Hugging Face cache, or downloaded into it as `hf download` does.

What is fetched follows the repository's file list: config.json, then the weights the way `shards.find_checkpoint`
reads them (the safetensors index and the shards it names, else model.safetensors, else the pickles, only when the
caller accepts pickles), and the tokenizer and generation files. Nothing else: no README, no `original/` folder, no
other weight formats. huggingface_hub does the transfer: progress bars, the token (`token=`, else `HF_TOKEN` or
`hf auth login`), the revision, connections resumed with HTTP Range requests, files already cached never fetched
again. The small files come first and the weights after them, so a cached snapshot that holds every weight file is
complete and is used without asking the Hub.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import NHARetrofitError
from .shards import PICKLE_INDEX, PICKLE_NAMES, SAFETENSORS_INDEX

SAFETENSORS_SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "qwen.tiktoken",
    "tokenizer.tiktoken", "generation_config.json",
)


def cached_snapshot(repo_id: str, cache: Path, revision: str | None, weights: bool) -> Path | None:
    """The cached snapshot of `repo_id` at `revision` (default: main) if it holds what is needed (the weights too
    with `weights`); no network."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
    if not isinstance(config, str):
        return None
    folder = Path(config).parent
    return folder if not weights or has_all_weights(folder) else None


def has_all_weights(folder: Path) -> bool:
    """Whether `folder` holds a whole set of weights: every shard its index names, or a single weights file."""
    for index in (SAFETENSORS_INDEX, PICKLE_INDEX):
        if (folder / index).is_file():
            shards = index_shards(folder / index)
            return bool(shards) and all((folder / shard).is_file() for shard in shards)
    return any((folder / name).is_file() for name in (SAFETENSORS_SINGLE, *PICKLE_NAMES))


def index_shards(index: Path) -> list[str]:
    """The shard files an index's weight_map names ([] for an unreadable index: the converter reports it)."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def download_snapshot(repo_id: str, cache: Path, revision: str | None, token: str | None, *, weights: bool,
                      allow_pickle: bool) -> Path:
    """Download into `cache` what conversion reads of `repo_id` (without `weights`: the config, tokenizer and
    generation files alone); its folder."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    where = dict(revision=revision, token=token, cache_dir=cache)
    fetching = False  # False while the repository is listed, True once files are being fetched
    try:
        info = HfApi(token=token).model_info(repo_id, revision=revision)
        files = {sibling.rfilename for sibling in info.siblings or []}
        if "config.json" not in files:
            raise NHARetrofitError(
                f"'{repo_id}' on the Hub has no config.json: it is not a transformers checkpoint (files: "
                f"{', '.join(sorted(files)[:8]) or 'none'})"
            )
        index, single = weights_to_fetch(repo_id, files, allow_pickle) if weights else (None, [])
        fetching = True
        # config.json alone first: a gated or private repository refuses it before any progress bar is drawn
        folder = Path(hf_hub_download(repo_id, "config.json", **where)).parent
        # the rest from the commit config.json came from, even if the branch has moved since
        at_commit = {**where, "revision": folder.name}
        small = [name for name in (index, *TOKENIZER_FILES) if name in files]
        if small:
            snapshot_download(repo_id, allow_patterns=small, **at_commit)
        shards = (index_shards(folder / index) if index else single) if weights else []
        if shards:
            snapshot_download(repo_id, allow_patterns=shards, **at_commit)
    except NHARetrofitError:
        raise
    except Exception as error:
        failure = download_failure(error, repo_id, revision, cache, fetching)
        if failure is None:
            raise
        raise failure from None
    return folder


def weights_to_fetch(repo_id: str, files: set[str], allow_pickle: bool) -> tuple[str | None, list[str]]:
    """(index to read the shard names from, or None; weight files named directly), in find_checkpoint's order."""
    if SAFETENSORS_INDEX in files:
        return SAFETENSORS_INDEX, []
    if SAFETENSORS_SINGLE in files:
        return None, [SAFETENSORS_SINGLE]
    pickles = [name for name in PICKLE_NAMES if name in files][:1]
    if PICKLE_INDEX not in files and not pickles:
        raise NHARetrofitError(f"'{repo_id}' on the Hub has no weights ({SAFETENSORS_INDEX}, {SAFETENSORS_SINGLE} "
                               f"or pickles)")
    if not allow_pickle:
        raise NHARetrofitError(
            f"'{repo_id}' on the Hub has only pickle weights (.bin/.pt), which can run code when loaded; no weights "
            "were downloaded: pass --allow-pickle to download them and load them with torch.load(weights_only=True)"
        )
    return (PICKLE_INDEX, []) if PICKLE_INDEX in files else (None, pickles)


def download_failure(error: Exception, repo_id: str, revision: str | None, cache: Path,
                     fetching: bool) -> NHARetrofitError | None:
    """One line saying what went wrong with a download and what to do; None for an error that is not the user's."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, GatedRepoError):
        return NHARetrofitError(
            f"'{repo_id}' is gated: request access at {constants.ENDPOINT}/{repo_id}, then log in with "
            "`hf auth login` or pass --token"
        )
    if isinstance(error, RevisionNotFoundError):
        return NHARetrofitError(f"'{repo_id}' has no revision '{revision}' on the Hub: pass a branch, tag or commit "
                                "that exists")
    if isinstance(error, RepositoryNotFoundError):
        return NHARetrofitError(
            f"no model '{repo_id}' on the Hugging Face Hub and no local folder of that name (a private model needs "
            "`hf auth login` or --token)"
        )
    if isinstance(error, OfflineModeIsEnabled):
        return NHARetrofitError(
            f"model '{repo_id}' is not in the local Hugging Face cache, or only in part (looked in {cache}; HF_HOME "
            "and HF_HUB_CACHE choose another), and HF_HUB_OFFLINE is set: unset it to download the model, or pass a "
            "local folder"
        )
    if isinstance(error, HfHubHTTPError) and error.response is not None and error.response.status_code == 401:
        return NHARetrofitError(f"the Hub refused the token (--token, HF_TOKEN or `hf auth login`): {reason}")
    if not isinstance(error, (HfHubHTTPError, LocalEntryNotFoundError, OSError, *transport_errors())):
        return None
    if not fetching:
        return NHARetrofitError(
            f"cannot list '{repo_id}' on the Hugging Face Hub at {constants.ENDPOINT} ({reason}): check the "
            "connection, or pass a local folder"
        )
    return NHARetrofitError(
        f"downloading '{repo_id}' from {constants.ENDPOINT} stopped ({reason}); run the same command again to "
        f"resume: the files already fetched stay in {cache}"
    )


def transport_errors() -> tuple[type, ...]:
    """The connection errors of the HTTP client huggingface_hub uses (httpx in 1.x, httpx2 later)."""
    from huggingface_hub.utils import get_session

    client_package = type(get_session()).__module__.partition(".")[0]
    return (sys.modules[client_package].TransportError,)
