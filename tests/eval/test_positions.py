"""Loss by position: log-spaced ranges, sequences cut from the held-out texts in turn, and each range's mean loss equal
to the one computed independently from the original checkpoint loaded by transformers."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.eval.positions import PositionSpec, long_sequences, position_buckets, run_positions
from nha_retrofit.eval.texts import load_heldout_tokens
from nha_retrofit.eval.variants import Variants
from nha_retrofit.modeling.load import load_for_inference

LENGTH = 200


def test_buckets_double_from_64_up_to_the_length():
    assert position_buckets(1000) == [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1000)]
    assert position_buckets(512) == [(0, 64), (64, 128), (128, 256), (256, 512)]
    assert position_buckets(40) == [(0, 40)]


def test_sequences_are_consecutive_pieces_of_each_text_in_turn(tiny_tokenizer):
    docs = load_heldout_tokens(tiny_tokenizer, "python-docs", None)[0]
    stdlib = load_heldout_tokens(tiny_tokenizer, "python-stdlib", None)[0]
    sequences = long_sequences(tiny_tokenizer, ["python-docs", "python-stdlib"], LENGTH, 3)
    assert sequences.shape == (3, LENGTH)
    for got, expected in zip(sequences, [docs[:LENGTH], stdlib[:LENGTH], docs[LENGTH : 2 * LENGTH]]):
        assert torch.equal(got, expected)
    with pytest.raises(NHARetrofitError, match="no held-out text of python-docs has 10000000 tokens"):
        long_sequences(tiny_tokenizer, ["python-docs"], 10_000_000, 1)


def test_mean_loss_per_range_matches_the_original_checkpoint(tiny_checkpoint, tiny_tokenizer):
    spec = PositionSpec(length=LENGTH, sequences=3, texts=["python-docs", "python-stdlib"])
    sequences = long_sequences(tiny_tokenizer, spec.texts, LENGTH, spec.sequences)
    variants = Variants(load_for_inference(tiny_checkpoint, "cpu", "float32"), ["original", "nha", "nha_all_full"])
    result = run_positions(variants, sequences, spec, batch_size=2)
    assert result["buckets"] == [[0, 64], [64, 128], [128, LENGTH]] and result["sequences"] == 3

    original = AutoModelForCausalLM.from_pretrained(tiny_checkpoint.parent / "original", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = original(sequences).logits[:, :-1]
    losses = F.cross_entropy(logits.transpose(1, 2), sequences[:, 1:], reduction="none")  # position p at p - 1
    expected = [losses[:, max(start, 1) - 1 : end - 1].mean().item() for start, end in result["buckets"]]
    assert result["loss"]["original"] == pytest.approx(expected, rel=1e-5)
    assert result["loss"]["nha_all_full"] == result["loss"]["original"]
    assert all(abs(a - b) > 1e-4 for a, b in zip(result["loss"]["nha"][1:], expected[1:]))  # beyond the window
