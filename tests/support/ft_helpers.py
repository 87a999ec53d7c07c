"""Tiny Llama checkpoints with a byte-level tokenizer, small text corpora and recipes for finetuning tests; a run's
loss curve, and a free port for the multi-process launchers."""

import json
import socket
from pathlib import Path

import yaml

from tiny_models import tiny_llama

EOS = 256


def byte_tokenizer():
    """A 257-token byte-level tokenizer (256 bytes + <eos>), built in memory with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: i for i, char in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def write_tiny_original(folder: Path, seed: int = 7) -> Path:
    """A tiny random Llama (vocab 257, 4 layers, 128 positions) with its tokenizer: an 'original' model."""
    model = tiny_llama(seed=seed, vocab_size=257, max_position_embeddings=128, pad_token_id=EOS,
                       bos_token_id=EOS, eos_token_id=EOS)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def write_corpus(folder: Path, files: int = 6, size: int = 3000) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    for f in range(files):
        text = " ".join(words[(f * 7 + i * i) % len(words)] for i in range(size // 6))
        (folder / f"doc{f}.txt").write_text(text[:size])
    return folder


def tiny_recipe(model_path: Path, data_dir: Path, out: Path, **sections) -> dict:
    recipe = {
        "model": {"path": str(model_path), "convert": {"full_layers": 1, "select": "even", "window": 4, "slots": 4}},
        "data": {"files": [str(data_dir / "*.txt")], "seq_len": 32, "eval_blocks": 2},
        "train": {"lr": 1e-3, "batch_size": 2, "warmup_steps": 1, "output_dir": str(out), "checkpoint_every": 2,
                  "threads": 1},
        "stages": {"attention_transfer": {"tokens": 128}, "lm": {"tokens": 256, "distill_weight": 1.0}},
    }
    for name, values in sections.items():
        recipe.setdefault(name, {}).update(values)
    return recipe


def save_recipe(recipe: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


def loss_curve(output_dir: Path) -> list[tuple[int, str, float]]:
    """(step, stage, loss) of every logged training step of the run written to `output_dir`."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["stage"], r["loss"]) for r in rows if "loss" in r]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
