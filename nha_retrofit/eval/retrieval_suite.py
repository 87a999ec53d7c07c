"""The retrieval suite: RULER-style tasks over several templates, value kinds and haystacks, in two groups (`tuning`
and `heldout`, `needles.py`), with a 95% interval on every accuracy and each model's score against a reference.

Tasks (the needle phrased differently from the question where the templates say so):

- `passkey`: one 5-digit pass key; `niah_number`, `niah_word`, `niah_id`: one key's 7-digit number, word, or hex id;
- `multikey`: four keys' numbers, one asked; `multivalue`: four numbers of one key, all asked, in text order;
- `kv`: one key's value among many JSON-ish pairs of uuid keys and hex-id values (one pair per 128 tokens);
- `vartrack`: a chain of four variables copying a number, and a distractor chain; all variables of the asked
  number, in chain order.

Each sample is exactly `length` tokens (`retrieval.insert_needles`): one needle sits at the line start nearest to the
asked depth, the others at random line starts, chains in order. Samples are deterministic given the seed; each
cell's strings are tokenized in one batch and each haystack once. Scoring is `retrieval.greedy_exact_matches` over
the answer's tokens (for several values: the whole answer, separators included).
"""

from __future__ import annotations

import contextlib
import random
import string
from dataclasses import dataclass, field

from ..errors import NHARetrofitError
from .intervals import wilson_interval
from .needles import GROUPS, SUITE_TASKS, NeedleGroup, Template
from .retrieval import DEFAULT_DEPTHS, Sample, greedy_exact_matches, insert_needles, open_haystack

SUITE_LENGTHS = (1024, 2048, 4096, 8192)
SUITE_SAMPLES = 20
SUITE_GROUPS = ("tuning", "heldout", "all")
NEEDLES_PER_SAMPLE = 4  # multikey's keys, multivalue's values, each variable-tracking chain's variables
TOKENS_PER_PAIR = 128  # kv: one key-value pair per this many tokens of the sample
REFERENCE_SHARE, LOW_REFERENCE, LOW_MARGIN = 0.9, 0.2, 0.05  # the bar: 90% of the reference, or it minus 5 points


@dataclass
class Prompt:
    """One sample's texts before tokenization: the question ends with `answer`, the scored text."""

    template: Template
    needles: list[str]
    question: str
    answer: str
    chains: tuple = ()


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _hex_id(rng: random.Random) -> str:
    return f"{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}"


def _uuid(rng: random.Random) -> str:
    digits = f"{rng.getrandbits(128):032x}"
    return "-".join(digits[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))


def _distinct(rng: random.Random, make, count: int) -> list[str]:
    values = []
    while len(values) < count:
        value = make()
        values += [value] if value not in values else []
    return values


def _one_needle(template: Template, key: str, value: str) -> Prompt:
    return Prompt(template, [template.needle.format(key=key, value=value)],
                  template.question.format(key=key, value=value, answer=value), value)


def make_prompt(task: str, group: NeedleGroup, length: int, rng: random.Random) -> Prompt:
    """The texts of one sample of `task`; the needle listed first goes to the asked depth."""
    template = rng.choice(group.templates[task])
    if task == "passkey":
        return _one_needle(template, "", _number(rng, 5))
    if task in ("niah_number", "niah_word", "niah_id"):
        value = {"niah_number": lambda: _number(rng, 7), "niah_word": lambda: rng.choice(group.words),
                 "niah_id": lambda: _hex_id(rng)}[task]()
        return _one_needle(template, rng.choice(group.keys), value)
    if task == "multikey":
        keys = rng.sample(group.keys, NEEDLES_PER_SAMPLE)
        values = _distinct(rng, lambda: _number(rng, 7), NEEDLES_PER_SAMPLE)
        return Prompt(template, [template.needle.format(key=k, value=v) for k, v in zip(keys, values)],
                      template.question.format(key=keys[0], answer=values[0]), values[0])
    if task == "multivalue":
        key = rng.choice(group.keys)
        values = _distinct(rng, lambda: _number(rng, 7), NEEDLES_PER_SAMPLE)
        answer = ", ".join(values)
        return Prompt(template, [template.needle.format(key=key, value=v) for v in values],
                      template.question.format(key=key, answer=answer), answer, (tuple(range(len(values))),))
    if task == "kv":
        pairs = max(NEEDLES_PER_SAMPLE, length // TOKENS_PER_PAIR)
        keys, values = _distinct(rng, lambda: _uuid(rng), pairs), [_hex_id(rng) for _ in range(pairs)]
        return Prompt(template, [template.needle.format(key=k, value=v) for k, v in zip(keys, values)],
                      template.question.format(key=keys[0], answer=values[0]), values[0])
    if task == "vartrack":
        names = _distinct(rng, lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), 2 * NEEDLES_PER_SAMPLE)
        numbers = _distinct(rng, lambda: _number(rng, 5), 2)
        chains = (tuple(range(NEEDLES_PER_SAMPLE)), tuple(range(NEEDLES_PER_SAMPLE, 2 * NEEDLES_PER_SAMPLE)))
        needles = []
        for chain, number in zip(chains, numbers):
            needles.append(template.needle.format(key=names[chain[0]], value=number))
            needles += [template.link.format(key=names[i], source=names[i - 1]) for i in chain[1:]]
        answer = ", ".join(names[:NEEDLES_PER_SAMPLE])
        return Prompt(template, needles, template.question.format(value=numbers[0], answer=answer), answer, chains)
    raise NHARetrofitError(f"unknown suite task {task!r}; choose from {', '.join(SUITE_TASKS)}")


@dataclass
class SuiteSpec:
    """What `eval` asks the suite for (`build_suite`'s arguments; lengths None: `retrieval.default_lengths`)."""

    lengths: list[int] | None = None
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    samples: int = SUITE_SAMPLES
    group: str = "all"
    haystack: str | None = None
    seed: int = 0
    kv_cache: str | None = None  # NHA variants read the answers from a static cache in this dtype


@dataclass
class Suite:
    """The samples of every (group, task, length, depth) cell, and what they were made of."""

    lengths: list[int]
    depths: list[float]
    samples: int
    seed: int
    haystacks: dict  # {group: [haystack names]}
    tasks: list[str]
    cells: dict = field(default_factory=dict)  # {(group, task, length, depth): [Sample]}


def _encode_cell(tokenizer, prompts: list[Prompt], instructions: dict) -> list[tuple]:
    """(instruction, needles, question, answer tokens) per prompt: one tokenizer call for all the needles and one for
    all the questions; each template's instruction (with the special tokens a prompt starts with) once."""
    flat = [needle for prompt in prompts for needle in prompt.needles]
    needle_ids = tokenizer(flat, add_special_tokens=False)["input_ids"]
    questions = tokenizer([p.question for p in prompts], add_special_tokens=False, return_offsets_mapping=True)
    encoded, cursor = [], 0
    for prompt, question, offsets in zip(prompts, questions["input_ids"], questions["offset_mapping"]):
        if prompt.template not in instructions:
            instructions[prompt.template] = tokenizer(prompt.template.instruction)["input_ids"]
        answer_start = len(prompt.question) - len(prompt.answer)
        answer_length = sum(1 for _, end in offsets if end > answer_start)
        encoded.append((instructions[prompt.template], needle_ids[cursor : cursor + len(prompt.needles)], question,
                        answer_length))
        cursor += len(prompt.needles)
    return encoded


def check_suite_options(lengths, depths, samples: int, group: str, tasks) -> None:
    if group not in SUITE_GROUPS:
        raise NHARetrofitError(f"unknown suite group {group!r}; choose from {', '.join(SUITE_GROUPS)}")
    unknown = [task for task in tasks if task not in SUITE_TASKS]
    if unknown or not tasks:
        raise NHARetrofitError(f"unknown suite task {unknown[0] if unknown else '(none given)'!r}; choose from "
                               f"{', '.join(SUITE_TASKS)}")
    if not depths or any(not 0 <= depth <= 100 for depth in depths):
        raise NHARetrofitError(f"needle depths are percentages from 0 to 100, got {list(depths)}")
    if samples < 1:
        raise NHARetrofitError(f"samples per length and depth must be >= 1, got {samples}")
    if not lengths or min(lengths) < 2:
        raise NHARetrofitError(f"lengths must be >= 2 tokens, got {list(lengths)}")


def build_suite(tokenizer, lengths=SUITE_LENGTHS, samples: int = SUITE_SAMPLES, depths=DEFAULT_DEPTHS,
                group: str = "all", haystack_path=None, seed: int = 0, tasks=SUITE_TASKS) -> Suite:
    """`samples` samples per (group, task, length, depth); `group` `all` builds both groups. `haystack_path`: a text
    file of the user's own (or a held-out text's name), the haystack of every group instead of the groups' own."""
    lengths, depths, tasks = list(lengths), list(depths), list(tasks)
    check_suite_options(lengths, depths, samples, group, tasks)
    names = ["tuning", "heldout"] if group == "all" else [group]
    if haystack_path is not None:
        own = open_haystack(tokenizer, haystack_path)
        haystacks = {name: [own] for name in names}
    else:
        loaded = {text: open_haystack(tokenizer, text) for name in names for text in GROUPS[name].haystacks}
        haystacks = {name: [loaded[text] for text in GROUPS[name].haystacks] for name in names}
    suite = Suite(lengths, depths, samples, seed, {name: [h.name for h in haystacks[name]] for name in names}, tasks)
    instructions = {}
    for name in names:
        for task in tasks:
            for length in lengths:
                for depth in depths:
                    rng = random.Random(f"{seed}:{name}:{task}:{length}:{depth}")
                    prompts = [make_prompt(task, GROUPS[name], length, rng) for _ in range(samples)]
                    cell = []
                    for prompt, (instruction, needles, question, answer_length) in zip(
                            prompts, _encode_cell(tokenizer, prompts, instructions)):
                        ids, needle_start = insert_needles(instruction, needles, question, rng.choice(haystacks[name]),
                                                           length, depth, rng, task, prompt.chains)
                        cell.append(Sample(ids, answer_length, needle_start, prompt.answer))
                    suite.cells[name, task, length, depth] = cell
    return suite


class _Models:
    """Named models given as a dict, used as `Variants` are."""

    def __init__(self, models: dict):
        self.models, self.names = models, list(models)

    @contextlib.contextmanager
    def use(self, name: str):
        yield self.models[name]


def _device(model):
    return getattr(model, "device", None) or next(model.parameters()).device


def accuracy_stat(hits: list[bool]) -> dict:
    """Accuracy, counts and its 95% Wilson interval."""
    correct = sum(hits)
    low, high = wilson_interval(correct, len(hits))
    return {"accuracy": correct / len(hits), "correct": correct, "samples": len(hits), "interval": [low, high]}


def reference_bar(reference: float) -> float:
    """The accuracy a model must reach against the reference's: 90% of it, or it minus 5 points under 20%."""
    return REFERENCE_SHARE * reference if reference >= LOW_REFERENCE else max(0.0, reference - LOW_MARGIN)


def score_suite(models, suite: Suite, *, batch_size: int = 8, progress: bool = False,
                kv_cache: str | None = None) -> dict:
    """{(model, group, task, length, depth): [hit per sample]} for every model (a `Variants`, or a dict
    {name: model}) on every sample of `suite`, batched across the cells of one length. `kv_cache`: the NHA models
    read the answers from a static cache whose full layers store keys and values in that dtype
    (`greedy_exact_matches`). Models scored apart can be reported together (`suite_report`)."""
    from tqdm.auto import tqdm

    models = _Models(models) if isinstance(models, dict) else models
    if batch_size < 1:
        raise NHARetrofitError(f"batch size must be >= 1, got {batch_size}")
    by_length = {length: [(cell, i) for cell, samples in suite.cells.items() if cell[2] == length
                          for i in range(len(samples))] for length in suite.lengths}
    hits = {}
    total = sum(-(-len(items) // batch_size) for items in by_length.values()) * len(models.names)
    with tqdm(total=total, desc="retrieval suite", unit="batch", disable=not progress) as progress_bar:
        for variant in models.names:
            with models.use(variant) as model:
                device = _device(model)
                for items in by_length.values():
                    for start in range(0, len(items), batch_size):
                        batch = items[start : start + batch_size]
                        matches = greedy_exact_matches(model, [suite.cells[cell][i] for cell, i in batch], device,
                                                       kv_cache)
                        for (cell, i), match in zip(batch, matches):
                            hits.setdefault((variant, *cell), [None] * suite.samples)[i] = match
                        progress_bar.update()
    return hits


def suite_report(hits: dict, suite: Suite, names: list[str], *, reference: str | None = "original",
                 kv_cache: str | None = None) -> dict:
    """The JSON-able result of `score_suite`'s hits for the models `names`: per group and task, each model's accuracy
    per (length, depth) and per length, and, against the `reference` model (when among them), the ratio and the bar
    per length."""
    result = suite_result(hits, suite, names)
    if kv_cache is not None:
        result["kv_cache"] = kv_cache
    return against_reference(result, reference) if reference in names else result


def run_suite(models, suite: Suite, *, batch_size: int = 8, progress: bool = False,
              reference: str | None = "original", kv_cache: str | None = None) -> dict:
    """`score_suite`, then `suite_report` of every model scored."""
    models = _Models(models) if isinstance(models, dict) else models
    hits = score_suite(models, suite, batch_size=batch_size, progress=progress, kv_cache=kv_cache)
    return suite_report(hits, suite, models.names, reference=reference, kv_cache=kv_cache)


def suite_result(hits: dict, suite: Suite, variants: list[str]) -> dict:
    """The JSON-able result from {(variant, group, task, length, depth): [hit per sample]}: per group, the
    accuracy of every model over all its samples (`overall`), and per task, per (length, depth) (`cells`) and per
    length (`summary`)."""
    groups = {}
    for group, haystacks in suite.haystacks.items():
        tasks = {}
        for task in suite.tasks:
            cells = {v: [[hits[v, group, task, length, depth] for depth in suite.depths] for length in suite.lengths]
                     for v in variants}
            tasks[task] = {
                "cells": {v: [[accuracy_stat(h) for h in row] for row in rows] for v, rows in cells.items()},
                "summary": {v: [accuracy_stat(sum(row, [])) for row in rows] for v, rows in cells.items()},
            }
        overall = {v: accuracy_stat([hit for task in suite.tasks for length in suite.lengths
                                     for depth in suite.depths for hit in hits[v, group, task, length, depth]])
                   for v in variants}
        groups[group] = {"haystacks": haystacks, "overall": overall, "tasks": tasks}
    return {"lengths": suite.lengths, "depths": suite.depths, "samples": suite.samples, "seed": suite.seed,
            "tasks": suite.tasks, "variants": list(variants), "reference": None, "groups": groups}


def against_reference(result: dict, reference: str) -> dict:
    """`result` with, per group, task and length, the bar the reference's accuracy sets (`bar`), and each other
    model's accuracy over the reference's (`ratio`, None where the reference scores 0) and whether it reaches the
    bar (`meets_bar`); per group, how many (task, length) pairs each model meets (`meets_bar`)."""
    others = [v for v in result["variants"] if v != reference]
    groups = {}
    for group, entry in result["groups"].items():
        tasks = {}
        for task, scores in entry["tasks"].items():
            base = [stat["accuracy"] for stat in scores["summary"][reference]]
            bars = [reference_bar(b) for b in base]
            tasks[task] = {
                **scores, "bar": bars,
                "ratio": {v: [s["accuracy"] / b if b else None for s, b in zip(scores["summary"][v], base)]
                          for v in others},
                "meets_bar": {v: [s["accuracy"] >= level for s, level in zip(scores["summary"][v], bars)]
                              for v in others},
            }
        met = {v: sum(sum(t["meets_bar"][v]) for t in tasks.values()) for v in others}
        groups[group] = {**entry, "tasks": tasks,
                         "meets_bar": {v: {"met": met[v], "of": len(tasks) * len(result["lengths"])} for v in others}}
    return {**result, "reference": reference, "groups": groups}
