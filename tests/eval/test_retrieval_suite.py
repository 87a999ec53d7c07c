"""The retrieval suite: every task's samples (exact length, deterministic, the needle at its depth, the answer at the
end, several values and variable chains in text order), the groups phrased apart, the user's own haystack, the
scoring against greedy generation, and the result's intervals, ratios and bars."""

import math
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.eval.intervals import Z_95, wilson_interval
from nha_retrofit.eval.needles import GROUPS, HELDOUT, SUITE_TASKS, TUNING, fixed_texts, word_ngrams
from nha_retrofit.eval.retrieval import greedy_exact_matches
from nha_retrofit.eval.report import suite_tables
from nha_retrofit.eval.retrieval_suite import build_suite, reference_bar, run_suite, score_suite, suite_report
from nha_retrofit.modeling.decoding import nha_static_cache

LENGTHS, DEPTHS = [700, 900], [0, 50, 100]
SINGLE_NEEDLE = ("passkey", "niah_number", "niah_word", "niah_id")


@pytest.fixture(scope="module")
def suite(tiny_tokenizer):
    return build_suite(tiny_tokenizer, lengths=LENGTHS, samples=3, depths=DEPTHS, group="all", seed=4)


def test_every_sample_is_exactly_its_length_and_ends_with_its_answer(tiny_tokenizer, suite):
    assert len(suite.cells) == 2 * len(SUITE_TASKS) * len(LENGTHS) * len(DEPTHS)
    assert suite.haystacks == {"tuning": ["python-docs", "python-stdlib"], "heldout": ["shakespeare"]}
    for (group, task, length, depth), samples in suite.cells.items():
        assert len(samples) == 3 and len({tuple(s.ids) for s in samples}) == 3
        for sample in samples:
            assert len(sample.ids) == length
            assert tiny_tokenizer.decode(sample.ids[-sample.answer_length :]).strip() == sample.value
            assert tiny_tokenizer.decode(sample.ids[sample.needle_start : sample.needle_start + 1]).startswith("\n")


def test_samples_are_the_same_for_a_seed_and_differ_for_another(tiny_tokenizer, suite):
    again = build_suite(tiny_tokenizer, lengths=[700], samples=3, depths=[50], group="heldout", seed=4)
    other = build_suite(tiny_tokenizer, lengths=[700], samples=3, depths=[50], group="heldout", seed=5)
    for task in SUITE_TASKS:
        ids = [s.ids for s in suite.cells["heldout", task, 700, 50]]
        assert [s.ids for s in again.cells["heldout", task, 700, 50]] == ids
        assert [s.ids for s in other.cells["heldout", task, 700, 50]] != ids


@pytest.mark.parametrize("group", ["tuning", "heldout"])
def test_a_single_needle_sits_at_its_depth_in_the_groups_own_phrasing(tiny_tokenizer, suite, group):
    for task in SINGLE_NEEDLE:
        for depth in DEPTHS:
            for sample in suite.cells[group, task, 900, depth]:
                text = tiny_tokenizer.decode(sample.ids)
                template = next(t for t in GROUPS[group].templates[task] if t.instruction in text)
                key = "" if task == "passkey" else next(k for k in GROUPS[group].keys if f" {k}" in text)
                needle = template.needle.format(key=key, value=sample.value)
                question = template.question.format(key=key, answer=sample.value)
                assert tiny_tokenizer.decode(sample.ids[sample.needle_start :]).startswith(needle)
                assert text.endswith(question) and text.count(sample.value) == needle.count(sample.value) + 1
                sizes = [len(tiny_tokenizer(part, add_special_tokens=False)["input_ids"]) for part in (needle,
                                                                                                       question)]
                instruction = len(tiny_tokenizer(template.instruction)["input_ids"])
                share = (sample.needle_start - instruction) / (900 - instruction - sum(sizes))
                assert share == depth / 100 if depth in (0, 100) else abs(share - depth / 100) < 0.1


def test_several_values_and_variable_chains_are_asked_in_text_order(tiny_tokenizer, suite):
    for group in GROUPS:
        for depth in DEPTHS:
            for sample in suite.cells[group, "multivalue", 900, depth]:
                text = tiny_tokenizer.decode(sample.ids)
                values = sample.value.split(", ")
                places = [text.index(f" {value}.") for value in values]
                assert len(values) == 4 and places == sorted(places)
            for sample in suite.cells[group, "vartrack", 900, depth]:
                text = tiny_tokenizer.decode(sample.ids)
                names = sample.value.split(", ")
                firsts = [text.index(name) for name in names]
                assert len(set(names)) == 4 and firsts == sorted(firsts)
                assert len(re.findall(r"\b[A-Z]{5}\b", text[: -len(sample.value)])) >= 8  # a distractor chain too


def test_key_value_pairs_grow_with_the_length_and_one_is_asked(tiny_tokenizer):
    suite = build_suite(tiny_tokenizer, lengths=[1024, 2048], samples=1, depths=[50], group="tuning",
                        tasks=["kv"])
    for length, pairs in ((1024, 8), (2048, 16)):
        sample = suite.cells["tuning", "kv", length, 50][0]
        text = tiny_tokenizer.decode(sample.ids)
        keys = re.findall(r'\{"([0-9a-f-]{36})": "[0-9a-f]{8}-[0-9a-f]{4}"\}', text)
        asked = set(re.findall(r'"([0-9a-f-]{36})"', text.split("\n")[-1]))
        assert len(set(keys)) == pairs and len(asked) == 1 and f'{{"{asked.pop()}": "{sample.value}"}}' in text


def test_the_heldout_group_shares_no_phrase_word_or_haystack_with_the_tuning_group():
    assert set(TUNING.templates) == set(HELDOUT.templates) == set(SUITE_TASKS)
    assert not word_ngrams(fixed_texts(TUNING)) & word_ngrams(fixed_texts(HELDOUT))
    assert not {*TUNING.keys, *TUNING.words} & {*HELDOUT.keys, *HELDOUT.words}
    assert not set(TUNING.haystacks) & set(HELDOUT.haystacks)
    assert ("the", "pass", "key") in word_ngrams(fixed_texts(TUNING))  # the check sees the templates' words


def test_a_users_own_file_is_the_haystack(tiny_tokenizer, tmp_path):
    lines = [f"Line {i} of the user's notes: the tide turns at dawn near pier {i}." for i in range(400)]
    path = tmp_path / "notes.txt"
    path.write_text("\n".join(lines) + "\n")
    suite = build_suite(tiny_tokenizer, lengths=[600], samples=2, depths=[50], group="heldout", haystack_path=path,
                        tasks=["niah_word"])
    assert suite.haystacks == {"heldout": ["notes.txt"]}
    for sample in suite.cells["heldout", "niah_word", 600, 50]:
        assert "of the user's notes: the tide turns at dawn" in tiny_tokenizer.decode(sample.ids)


@pytest.mark.parametrize("options, message", [
    (dict(group="dev"), r"unknown suite group 'dev'; choose from tuning, heldout, all"),
    (dict(tasks=["niah"]), r"unknown suite task 'niah'; choose from passkey, niah_number"),
    (dict(depths=[120]), r"needle depths are percentages from 0 to 100, got \[120\]"),
    (dict(samples=0), r"samples per length and depth must be >= 1, got 0"),
    (dict(lengths=[60], tasks=["kv"]), r"length 60 is too short for kv: its instruction, needles and question"),
    (dict(haystack_path="missing.txt"), r"--haystack missing.txt is neither a held-out text \(python-stdlib, "
                                        r"shakespeare, python-docs\) nor a readable UTF-8 text file"),
])
def test_a_mistake_is_one_line(tiny_tokenizer, options, message):
    with pytest.raises(NHARetrofitError, match=message):
        build_suite(tiny_tokenizer, **{"lengths": [700], "samples": 1, "group": "tuning", **options})


def test_teacher_forced_scoring_equals_greedy_generation(tiny_tokenizer, tiny_checkpoint):
    """On the tiny random model as the original: a sample counts exactly when `generate` writes its answer, and
    a sample whose answer is what `generate` wrote counts."""
    from nha_retrofit.eval.variants import Variants
    from nha_retrofit.modeling.load import load_for_inference

    suite = build_suite(tiny_tokenizer, lengths=[480], samples=2, depths=[50], group="all",
                        tasks=["passkey", "niah_word"])
    samples = [sample for cell in suite.cells.values() for sample in cell]
    # float64: no near-tie between the two most likely tokens of the random model turns on the order of the sums
    with Variants(load_for_inference(tiny_checkpoint, "cpu").double(), ["original"]).use("original") as model:
        model.generation_config.eos_token_id = None  # the tiny vocabulary's token 2 is text, not an end
        written = []
        for sample in samples:
            prompt = torch.tensor([sample.ids[: -sample.answer_length]])
            output = model.generate(prompt, max_new_tokens=sample.answer_length, do_sample=False, pad_token_id=0)
            written.append(output[0, prompt.shape[1] :].tolist())
            assert len(written[-1]) == sample.answer_length  # no end-of-text token stops it early
        expected = [tokens == sample.ids[-sample.answer_length :] for tokens, sample in zip(written, samples)]
        assert greedy_exact_matches(model, samples, "cpu") == expected
        rewritten = [SimpleNamespace(ids=sample.ids[: -sample.answer_length] + tokens,
                                     answer_length=sample.answer_length) for tokens, sample in zip(written, samples)]
        assert greedy_exact_matches(model, rewritten, "cpu") == [True] * len(samples)
        spoiled = [SimpleNamespace(ids=s.ids[:-1] + [(s.ids[-1] + 1) % len(tiny_tokenizer)],
                                   answer_length=s.answer_length) for s in rewritten]
        assert greedy_exact_matches(model, spoiled, "cpu") == [False] * len(samples)


class LengthOracle(torch.nn.Module):
    """Predicts every next token right in sequences of the `right` lengths, and wrong (the next token + 1)
    elsewhere."""

    def __init__(self, vocab_size, right):
        super().__init__()
        self.vocab_size, self.right, self.device = vocab_size, right, torch.device("cpu")

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        following = torch.roll(input_ids, -1, 1)
        if input_ids.shape[1] not in self.right:
            following = (following + 1) % self.vocab_size
        return SimpleNamespace(logits=F.one_hot(following, self.vocab_size).float()[:, -logits_to_keep:])


def test_the_result_scores_each_model_against_the_reference(tiny_tokenizer, suite):
    vocab = len(tiny_tokenizer)
    models = {"original": LengthOracle(vocab, {700, 900}), "finetuned": LengthOracle(vocab, {700}),
              "other": LengthOracle(vocab, set())}
    result = run_suite(models, suite, batch_size=4)
    assert result["variants"] == list(models) and result["reference"] == "original"
    for group in ("tuning", "heldout"):
        assert result["groups"][group]["overall"]["finetuned"]["accuracy"] == 0.5
        for task in SUITE_TASKS:
            entry = result["groups"][group]["tasks"][task]
            first = entry["summary"]["finetuned"][0]
            assert first == {"accuracy": 1.0, "correct": 9, "samples": 9, "interval": list(wilson_interval(9, 9))}
            assert [s["accuracy"] for s in entry["summary"]["finetuned"]] == [1.0, 0.0]
            assert entry["cells"]["other"][1][2] == {"accuracy": 0.0, "correct": 0, "samples": 3,
                                                      "interval": list(wilson_interval(0, 3))}
            assert entry["ratio"] == {"finetuned": [1.0, 0.0], "other": [0.0, 0.0]}
            assert entry["bar"] == [0.9, 0.9] and entry["meets_bar"]["finetuned"] == [True, False]
        assert result["groups"][group]["meets_bar"] == {"finetuned": {"met": 8, "of": 16},
                                                        "other": {"met": 0, "of": 16}}
    assert run_suite({"a": models["finetuned"]}, suite)["reference"] is None

    # models scored apart (the quality sweep scores the original once) report exactly as when scored together
    apart = {**score_suite({"original": models["original"]}, suite, batch_size=3),
             **score_suite({"finetuned": models["finetuned"], "other": models["other"]}, suite, batch_size=5)}
    assert suite_report(apart, suite, list(models)) == result

    low, high = (round(100 * end) for end in wilson_interval(9, 9))
    lines = suite_tables(result, list(models))
    assert f"| kv | finetuned | 100.0 [{low}-{high}] | 0.0 [0-{100 - low}] |" in lines
    assert "| vartrack | finetuned | 1.00 met | 0.00 below 90.0 |" in lines
    assert any(line.startswith("heldout group: accuracy over original's") and line.endswith(
        "bar met: finetuned 8 of 16, other 0 of 16") for line in lines)


def test_the_bar_is_ninety_percent_of_the_reference_or_five_points_below_it_under_twenty():
    assert reference_bar(0.8) == pytest.approx(0.72) and reference_bar(0.2) == pytest.approx(0.18)
    assert reference_bar(0.15) == pytest.approx(0.10) and reference_bar(0.03) == 0.0


def _wilson_by_bisection(correct, total):
    """The interval's ends as the proportions p at which the observed share is z standard errors away from p."""
    share = correct / total

    def distance(p):
        return abs(share - p) - Z_95 * math.sqrt(p * (1 - p) / total)

    def root(low, high):  # distance > 0 at `low`... changes sign once between
        for _ in range(200):
            middle = (low + high) / 2
            low, high = (middle, high) if (distance(middle) > 0) == (distance(low) > 0) else (low, middle)
        return (low + high) / 2

    return (0.0 if correct == 0 else root(0.0, share)), (1.0 if correct == total else root(share, 1.0))


@pytest.mark.parametrize("correct, total", [(0, 20), (1, 20), (7, 20), (10, 20), (19, 20), (20, 20), (3, 8),
                                            (160, 200)])
def test_the_wilson_interval_matches_its_definition(correct, total):
    low, high = wilson_interval(correct, total)
    ref_low, ref_high = _wilson_by_bisection(correct, total)
    assert low == pytest.approx(ref_low, abs=1e-12) and high == pytest.approx(ref_high, abs=1e-12)
    assert low <= correct / total <= high


@pytest.mark.parametrize("kv_cache", ["auto", pytest.param("float8_e4m3", marks=pytest.mark.slow)])
def test_answers_read_from_the_static_cache_match_one_forward(tiny_tokenizer, tiny_checkpoint, kv_cache, monkeypatch):
    """An NHA model's answers predicted through a prefill and one-token steps on an `NHAStaticCache` (its full layers'
    keys and values in the model's dtype, or in float8) against one teacher-forced forward: the same greedy tokens,
    hits and misses; the cache is built in the dtype asked for."""
    from nha_retrofit.eval import retrieval
    from nha_retrofit.modeling.load import load_for_inference

    suite = build_suite(tiny_tokenizer, lengths=[320], samples=2, depths=[50], group="tuning",
                        tasks=["passkey", "niah_number"])
    samples = [sample for cell in suite.cells.values() for sample in cell]
    assert len({s.answer_length for s in samples}) > 1  # answers of several lengths share a batch
    model = load_for_inference(tiny_checkpoint, "cpu").double()
    assert any(w is None for w in model.config.nha_windows) and any(w for w in model.config.nha_windows)
    built = []
    monkeypatch.setattr(retrieval, "nha_static_cache",
                        lambda *args, **kwargs: built.append(args[3]) or nha_static_cache(*args, **kwargs))
    ids = torch.tensor([s.ids for s in samples])
    keep = max(s.answer_length for s in samples) + 1
    with torch.no_grad():
        forward = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[:, :-1]
    cached = retrieval.predictions_from_cache(model, ids, keep - 1, retrieval.kv_cache_dtype(kv_cache))
    agree = (torch.tensor(cached) == forward.argmax(-1)).double().mean().item()
    assert agree == 1.0 if kv_cache == "auto" else agree >= 0.9
    assert built == [retrieval.kv_cache_dtype(kv_cache)]
    rewritten = [SimpleNamespace(ids=list(s.ids), answer_length=s.answer_length) for s in samples]
    for _ in range(keep - 1):  # greedy answers: each pass fixes one more answer token given those before it
        with torch.no_grad():
            rows = model(input_ids=torch.tensor([s.ids for s in rewritten]), use_cache=False,
                         logits_to_keep=keep).logits[:, :-1].argmax(-1).tolist()
        for s, row in zip(rewritten, rows):
            s.ids[-s.answer_length :] = row[len(row) - s.answer_length :]
    hits = greedy_exact_matches(model, rewritten, "cpu", kv_cache)
    assert hits == [True] * len(samples) if kv_cache == "auto" else sum(hits) >= 0.8 * len(samples)
    spoiled = [SimpleNamespace(ids=s.ids[:-1] + [(s.ids[-1] + 1) % len(tiny_tokenizer)],
                               answer_length=s.answer_length) for s in rewritten]
    assert greedy_exact_matches(model, spoiled, "cpu", kv_cache) == [False] * len(samples)
