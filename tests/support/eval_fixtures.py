"""Fixtures of the evaluation and evaluation-benchmark tests (a pytest plugin of tests/conftest.py): a tiny
byte-level BPE tokenizer trained here on local text (digits one token each, as in SmolLM2's), a tiny converted Llama
with that vocabulary, and a folder of local lm-eval tasks."""

import json

import pytest

from nha_retrofit.eval.texts import python_docs
from tiny_models import tiny_llama

WINDOW, SLOTS = 8, 5

CHOICE_TASK = """task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Line: {{{{line}}}}\\nNext line:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
ROLLING_TASK = """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"], show_progress=False)
    bpe.train_from_iterator([python_docs()[:40_000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


def converted_checkpoint(folder, tokenizer, seed, record_update=None):
    """A tiny random Llama with `tokenizer`'s vocabulary (512 positions), converted: layer 0 full, layers 1-3 NHA
    (window 8, 5 slots). `record_update` is merged into its nha_conversion.json (a finetuning summary, say)."""
    from nha_retrofit.conversion import convert
    from nha_retrofit.plan import PlanSpec

    tiny_llama(seed=seed, vocab_size=len(tokenizer)).save_pretrained(folder / "original")
    tokenizer.save_pretrained(folder / "original")
    out = convert(folder / "original", folder / "nha",
                  PlanSpec(full_layer_ids=[0], window=WINDOW, slots=SLOTS, slot_bias_init=-1.0), log=lambda *_: None)
    if record_update:  # as a finetuning run writes it: the record, then the checksums of the folder as it is
        from nha_retrofit.checksums import write_checksums

        record_path = out / "nha_conversion.json"
        record_path.write_text(json.dumps({**json.loads(record_path.read_text()), **record_update}))
        write_checksums(out)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer):
    return converted_checkpoint(tmp_path_factory.mktemp("eval"), tiny_tokenizer, seed=5)


@pytest.fixture(scope="session")
def tiny_finetuned_checkpoint(tmp_path_factory, tiny_tokenizer):
    """Another tiny checkpoint standing for a finetuned one: other weights, a finetuning record of 128-token
    sequences."""
    return converted_checkpoint(tmp_path_factory.mktemp("finetuned"), tiny_tokenizer, seed=9,
                                record_update={"finetune": {"recipe": {"data": {"seq_len": 128}}}})


@pytest.fixture(scope="session")
def local_tasks(tmp_path_factory):
    """A folder of two lm-eval tasks over JSON lines made from the Python language reference's prose."""
    folder = tmp_path_factory.mktemp("tasks")
    lines = [line.strip() for line in python_docs().splitlines() if len(line.strip()) > 40][:200]
    choices = [{"line": lines[i], "choices": [lines[i + 1], lines[i + 50], lines[i + 90]], "label": 0}
               for i in range(0, 60, 6)]
    paragraphs = [{"text": " ".join(lines[i : i + 5])} for i in range(100, 130, 6)]
    for name, rows, template in (("choice", choices, CHOICE_TASK), ("rolling", paragraphs, ROLLING_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"tiny_{name}.yaml").write_text(template.format(data=data))
    return folder
