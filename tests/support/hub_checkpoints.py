"""Checkpoints for the local Hub: a tiny random Llama saved as the Hub stores models (safetensors shards and their
index, config, generation config) with a small word-level tokenizer, and the huggingface_hub client of the test's
process pointed at a LocalHub."""

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tiny_models import tiny_llama

SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}


def word_tokenizer(vocab_size: int = 128) -> PreTrainedTokenizerFast:
    """Words w4 ... w{vocab_size-1} and the special tokens of tiny_models.TINY_LLAMA (pad 0, bos 1, eos 2)."""
    vocab = {**SPECIAL, **{f"w{i}": i for i in range(len(SPECIAL), vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def save_hub_checkpoint(folder: Path, *, seed: int, max_shard_size: str = "150KB", **overrides) -> Path:
    """A tiny Llama (tiny_models.TINY_LLAMA with `overrides`) sharded by `max_shard_size`, with its tokenizer."""
    tiny_llama(seed=seed, **overrides).save_pretrained(folder, max_shard_size=max_shard_size)
    word_tokenizer(overrides.get("vocab_size", 128)).save_pretrained(folder)
    return folder


def use_local_hub(hub, monkeypatch, home: Path, *, token: str | None = None) -> None:
    """What HF_ENDPOINT=hub.url, HF_HOME=home and HF_TOKEN=token do for a fresh process, done in this one.

    huggingface_hub reads the endpoint, the offline switch and the token file's path once, at import, so those
    constants are replaced; nha-retrofit reads HF_HOME / HF_HUB_CACHE from the environment when it resolves a model.
    """
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setenv("HF_HOME", str(home))
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
