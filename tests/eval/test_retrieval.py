"""Passkey and needle-in-a-haystack samples (exact length, deterministic, the needle at its depth, the number once in
the needle and at the end) and their scoring (greedy exact match of the number's tokens alone), with a model that
predicts the next token perfectly except where told."""

import json
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.eval.retrieval import (RETRIEVAL_TASKS, Haystack, build_samples, check_lengths, default_lengths,
                                         greedy_exact_matches)
from nha_retrofit.eval.variants import training_context

LENGTH = 900


@pytest.fixture(scope="module")
def haystack(tiny_tokenizer):
    return Haystack(tiny_tokenizer, "python-docs")


@pytest.mark.parametrize("task_name", list(RETRIEVAL_TASKS))
def test_samples_hold_the_needle_at_its_depth_and_end_with_the_number(tiny_tokenizer, haystack, task_name):
    task = RETRIEVAL_TASKS[task_name]
    instruction = len(tiny_tokenizer(task.instruction)["input_ids"])
    for depth in (0, 30, 50, 100):
        samples = build_samples(tiny_tokenizer, haystack, task, LENGTH, depth, 3, seed=1)
        assert [s.ids for s in samples] == [s.ids for s in build_samples(tiny_tokenizer, haystack, task, LENGTH,
                                                                         depth, 3, seed=1)]
        assert [s.ids for s in samples] != [s.ids for s in build_samples(tiny_tokenizer, haystack, task, LENGTH,
                                                                         depth, 3, seed=2)]
        assert len({tuple(s.ids) for s in samples}) == 3
        for sample in samples:
            text = tiny_tokenizer.decode(sample.ids)
            value = str(sample.value)
            assert len(sample.ids) == LENGTH and len(value) == task.digits
            assert tiny_tokenizer.decode(sample.ids[-sample.answer_length :]) == value
            needle = tiny_tokenizer.decode(sample.ids[sample.needle_start :])
            key = needle.removeprefix("\nOne of the special magic numbers for ").split(" ")[0]
            assert needle.startswith(task.needle.format(key=key, value=value))
            assert text.count(value) == (3 if task_name == "passkey" else 2)
            assert text.endswith(task.question.format(key=key, value=value))
            if task.needles > 1:
                assert text.count("\nOne of the special magic numbers for ") == task.needles
                continue
            lengths = [len(tiny_tokenizer(part.format(key=key, value=value), add_special_tokens=False)["input_ids"])
                       for part in (task.needle, task.question)]
            share = (sample.needle_start - instruction) / (LENGTH - instruction - sum(lengths))  # haystack before it
            assert share == depth / 100 if depth in (0, 100) else abs(share - depth / 100) < 0.1


class NextTokenOracle(torch.nn.Module):
    """Logits whose argmax at position t is the input's token t+1, except at `wrong` positions counted from the end
    (0 = the last position)."""

    def __init__(self, vocab_size, wrong=()):
        super().__init__()
        self.vocab_size, self.wrong = vocab_size, wrong

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        following = torch.roll(input_ids, -1, 1)
        for back in self.wrong:
            following[:, -1 - back] = (following[:, -1 - back] + 1) % self.vocab_size
        return SimpleNamespace(logits=F.one_hot(following, self.vocab_size).float()[:, -logits_to_keep:])


def test_greedy_exact_match_scores_the_number_alone(tiny_tokenizer, haystack):
    """A batch of passkey (5 digits) and multi-key (7 digits) samples: right when every digit is predicted, wrong
    when any one is not, and not judged on the question's tokens before the number."""
    samples = (build_samples(tiny_tokenizer, haystack, RETRIEVAL_TASKS["passkey"], LENGTH, 50, 2, seed=0)
               + build_samples(tiny_tokenizer, haystack, RETRIEVAL_TASKS["niah_multikey"], LENGTH, 50, 2, seed=0))
    assert [s.answer_length for s in samples] == [5, 5, 7, 7]
    vocab = len(tiny_tokenizer)
    assert greedy_exact_matches(NextTokenOracle(vocab), samples, "cpu") == [True] * 4
    assert greedy_exact_matches(NextTokenOracle(vocab, wrong=[1]), samples, "cpu") == [False] * 4  # the last digit
    assert greedy_exact_matches(NextTokenOracle(vocab, wrong=[5]), samples, "cpu") == [False, False, False, False]
    assert greedy_exact_matches(NextTokenOracle(vocab, wrong=[6]), samples, "cpu") == [True, True, False, False]
    assert greedy_exact_matches(NextTokenOracle(vocab, wrong=[0, 8, 9]), samples, "cpu") == [True] * 4


def test_a_length_too_short_for_the_prompt_is_one_line(tiny_tokenizer, haystack):
    with pytest.raises(NHARetrofitError, match=r"length 40 is too short for niah_multikey: its instruction, needles"):
        build_samples(tiny_tokenizer, haystack, RETRIEVAL_TASKS["niah_multikey"], 40, 0, 1, seed=0)


def test_default_lengths_reach_four_times_the_training_context_within_the_positions():
    assert default_lengths(2048, 8192) == [1024, 2048, 4096, 8192]
    assert default_lengths(8192, 8192) == [1024, 2048, 4096, 8192]
    assert default_lengths(8192, 8192, allow_beyond_positions=True) == [1024, 2048, 4096, 8192, 16384, 32768]
    assert default_lengths(100, 512) == [400]
    assert check_lengths([1024, 16384], 8192, allow_beyond_positions=True) == [1024, 16384]
    with pytest.raises(NHARetrofitError, match=r"length 16384 is beyond the model's 8192 positions .*"
                                               r"--allow-beyond-positions"):
        check_lengths([1024, 16384], 8192, allow_beyond_positions=False)


def test_training_context_is_the_finetuning_sequence_length(tmp_path):
    config = SimpleNamespace(max_position_embeddings=8192)
    assert training_context(tmp_path, config) == 8192
    (tmp_path / "nha_conversion.json").write_text(json.dumps({"source": "x"}))
    assert training_context(tmp_path, config) == 8192
    (tmp_path / "nha_conversion.json").write_text(json.dumps({"finetune": {"recipe": {"data": {"seq_len": 2048}}}}))
    assert training_context(tmp_path, config) == 2048


def test_haystack_slices_start_at_lines_and_wrap_around(tiny_tokenizer, haystack):
    rng = random.Random(0)
    ids, boundaries = haystack.take(rng, len(haystack.ids) + 50)  # longer than the text: read again from its start
    assert len(ids) == len(haystack.ids) + 50 and boundaries[0] == 0 and boundaries[-1] == len(ids)
    assert len(boundaries) > 100 and boundaries == sorted(set(boundaries))
    for start in boundaries[1:-1]:
        before, token = tiny_tokenizer.decode(ids[start - 1 : start]), tiny_tokenizer.decode(ids[start : start + 1])
        assert before.endswith("\n") or token.startswith("\n")
