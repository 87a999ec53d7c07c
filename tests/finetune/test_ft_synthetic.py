"""Recall exercises in the training blocks: lengths kept, every asked record present before its question, the draw
deterministic and resumable, and no template phrase shared with the retrieval suite."""

import re

import pytest
import torch

from ft_helpers import byte_tokenizer
from nha_retrofit.eval.needles import GROUPS, fixed_texts, word_ngrams
from nha_retrofit.finetune.data import load_blocks
from nha_retrofit.finetune.recipe import DataSection, SyntheticSection
from nha_retrofit.finetune.synthetic import LINE_QUOTE, RECORD_FORMATS, MixedBlocks, RecallExercises

SEQ_LEN = 1024


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def prose_block(tokenizer, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    words = "the tide turns at dawn while gulls circle over the harbour wall and nets dry".split()
    lines = [" ".join(words[i] for i in torch.randint(len(words), (9,), generator=generator).tolist())
             for _ in range(200)]
    return torch.tensor(tokenizer("\n".join(lines))["input_ids"][:SEQ_LEN])


def test_an_exercise_keeps_the_length_and_asks_only_records_it_holds(tokenizer):
    exercises = RecallExercises(tokenizer, share=1.0, records=4, seed=3)
    asked = 0
    for index in range(12):
        block = prose_block(tokenizer, index)
        out = exercises.apply(block, index)
        assert out.shape == block.shape and out.dtype == block.dtype
        text = tokenizer.decode(out)
        assert not torch.equal(out, block)
        for record, question in RECORD_FORMATS:
            pattern = re.escape(question.strip()).replace(r"\{key\}", r"(\S+)").replace(r"\{value\}", r"(\S+?)")
            for key, value in re.findall(pattern + r"(?:\.|\n|$)", text):
                asked += 1
                record_text = record.strip().format(key=key, value=value)
                first_question = text.index(question.strip().format(key=key, value=value))
                assert record_text in text[:first_question], (record_text, index)
        quote = re.search(r'The line starting with "(.+)" continues: (.+)\n', text)
        if quote:
            assert f"{quote.group(1)} {quote.group(2)}" in text[: quote.start()]
    assert asked >= 12  # at least one record asked back per exercise


def test_some_values_are_words_of_the_block_itself(tokenizer):
    """Besides numbers, hex strings and made-up words, records hold words the block's own text uses elsewhere."""
    exercises = RecallExercises(tokenizer, share=1.0, records=4, seed=5)
    prose = set("the tide turns at dawn while gulls circle over the harbour wall and nets dry".split())
    values = []
    for index in range(24):
        text = tokenizer.decode(exercises.apply(prose_block(tokenizer, index), index))
        for _, question in RECORD_FORMATS:
            pattern = re.escape(question.strip()).replace(r"\{key\}", r"\S+").replace(r"\{value\}", r"(\S+?)")
            values += re.findall(pattern + r"(?:\.|\n|$)", text)
    from_text = [value for value in values if value in prose]
    assert from_text and all(len(value) >= 4 for value in from_text)
    assert len(from_text) < len(values)


def test_the_share_is_drawn_per_block_and_repeats_exactly(tokenizer):
    exercises = RecallExercises(tokenizer, share=0.5, records=3, seed=0)
    block = prose_block(tokenizer, 0)
    changed = [not torch.equal(exercises.apply(block, i), block) for i in range(200)]
    assert 70 < sum(changed) < 130
    again = RecallExercises(tokenizer, share=0.5, records=3, seed=0)
    assert all(torch.equal(exercises.apply(block, i), again.apply(block, i)) for i in range(20))
    other_seed = RecallExercises(tokenizer, share=0.5, records=3, seed=1)
    assert any(not torch.equal(exercises.apply(block, i), other_seed.apply(block, i)) for i in range(20))


def test_mixed_blocks_resume_at_the_same_exercise(tmp_path, tokenizer):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a long text about tides and harbours" for i in range(3000)))
    spec = DataSection(files=[str(corpus)], seq_len=256, eval_blocks=2, synthetic=SyntheticSection(share=0.5))
    data = load_blocks(spec, tokenizer)
    assert isinstance(data, MixedBlocks) and "recall records" in data.describe()
    data.next_blocks(5)
    state = data.state_dict()
    expected = data.next_blocks(4)
    resumed = load_blocks(spec, tokenizer)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next_blocks(4), expected)
    plain = load_blocks(DataSection(files=[str(corpus)], seq_len=256, eval_blocks=2), tokenizer)
    assert not isinstance(plain, MixedBlocks)


def test_training_templates_share_no_phrase_with_the_retrieval_suite():
    training = [text for pair in RECORD_FORMATS for text in pair] + list(LINE_QUOTE)
    for group in GROUPS.values():
        assert not word_ngrams(training) & word_ngrams(fixed_texts(group))
