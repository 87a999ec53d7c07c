"""Long-context retrieval with no download: passkey retrieval and needle in a haystack (one key, or several keys of
which one is asked for), over haystacks of the package's local held-out text (`texts.py`) or a text file.

Each sample is one sequence of exactly `length` tokens: an instruction, haystack text with the needle(s), a question,
and the answer's digits. The asked needle sits at a depth (the share of the haystack before it), at the line start
nearest to it; the other needles of the multi-key task at random line starts. Samples are deterministic given the
seed, and every compared model scores the same samples.

Scoring is greedy exact match, computed by teacher forcing in one forward pass: a sample counts when, at every token
of the answer, the model's most likely next token is that token, which is exactly when greedy decoding after the
question writes the number. Only the number's own tokens are scored: the question ends with the text before it
(`... The pass key is`), so a model that would write another word there first is not counted wrong for it.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import NHARetrofitError
from ..modeling.decoding import kv_cache_dtype, nha_static_cache, one_token_step, prefill
from ..modeling.modeling_nha import NHAForCausalLMMixin
from .texts import HELDOUT_TEXTS

DEFAULT_DEPTHS = (0, 25, 50, 75, 100)
FIRST_LENGTH = 1024

KEY_WORDS = (
    "apple", "river", "candle", "mountain", "violin", "harbor", "pepper", "lantern", "meadow", "falcon", "copper",
    "orchid", "glacier", "anchor", "saffron", "compass", "thunder", "willow", "marble", "beacon", "cactus", "ember",
    "quartz", "tundra", "walnut", "zephyr", "basalt", "coral", "dune", "fern",
)


@dataclass(frozen=True)
class RetrievalTask:
    """One retrieval task: its texts (`{key}` and `{value}` are filled in) and how many needles a sample holds."""

    name: str
    instruction: str
    needle: str
    question: str  # ends with the answer, `{value}`
    digits: int
    needles: int = 1


PASSKEY = RetrievalTask(
    name="passkey",
    instruction="There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                "I will quiz you about the pass key.\n",
    needle="\nThe pass key is {value}. Remember it. {value} is the pass key.\n",
    question="\nWhat is the pass key? The pass key is {value}",
    digits=5,
)
_NIAH = dict(
    instruction="Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                "I will quiz you about the numbers afterwards.\n",
    needle="\nOne of the special magic numbers for {key} is: {value}.\n",
    question="\nWhat is the special magic number for {key} mentioned in the provided text? "
             "The special magic number for {key} mentioned in the provided text is {value}",
    digits=7,
)
RETRIEVAL_TASKS = {
    "passkey": PASSKEY,
    "niah_single": RetrievalTask(name="niah_single", **_NIAH),
    "niah_multikey": RetrievalTask(name="niah_multikey", needles=4, **_NIAH),
}


@dataclass
class RetrievalSpec:
    """What the retrieval tasks measure: lengths in tokens (None: `default_lengths`), needle depths in percent of
    the haystack, samples per (length, depth), the haystack (a held-out text's name or a text file), the seed."""

    lengths: list[int] | None = None
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    samples: int = 10
    haystack: str = "python-docs"
    seed: int = 0


def default_lengths(training_context: int, positions: int, allow_beyond_positions: bool = False) -> list[int]:
    """Powers of two from 1K to 4x the training context, kept within the model's positions unless allowed beyond."""
    limit = 4 * training_context if allow_beyond_positions else min(4 * training_context, positions)
    lengths = []
    length = FIRST_LENGTH
    while length <= limit:
        lengths.append(length)
        length *= 2
    return lengths or [limit]


def check_lengths(lengths, positions: int, allow_beyond_positions: bool, what: str = "length") -> list[int]:
    """One error line for a length the model's positions do not cover (unless allowed: RoPE past its trained
    positions, on purpose)."""
    lengths = list(lengths)
    if not lengths or min(lengths) < 2:
        raise NHARetrofitError(f"{what}s must be >= 2 tokens, got {lengths}")
    beyond = [length for length in lengths if length > positions]
    if beyond and not allow_beyond_positions:
        raise NHARetrofitError(f"{what} {max(beyond)} is beyond the model's {positions} positions "
                               "(max_position_embeddings); pass --allow-beyond-positions to run RoPE past them on "
                               "purpose")
    return lengths


def check_spec(spec: RetrievalSpec) -> None:
    if any(not 0 <= depth <= 100 for depth in spec.depths) or not spec.depths:
        raise NHARetrofitError(f"needle depths are percentages from 0 to 100, got {list(spec.depths)}")
    if spec.samples < 1:
        raise NHARetrofitError(f"samples per length and depth must be >= 1, got {spec.samples}")


class Haystack:
    """A text tokenized once, with the tokens that start a line (where needles go)."""

    def __init__(self, tokenizer, name: str, text: str | None = None):
        """`text`: a text of the user's own (`name` then names it), else the held-out text `name`."""
        text = HELDOUT_TEXTS[name]() if text is None else text
        self.name = name
        try:
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        except NotImplementedError:
            raise NHARetrofitError("the retrieval tasks need a fast tokenizer (with character offsets)") from None
        self.ids = encoded["input_ids"]
        offsets = encoded["offset_mapping"]
        # a character split over several byte-level tokens gives each of them its offsets: only the first starts it
        self.line_starts = [
            i for i, (start, end) in enumerate(offsets)
            if i > 0 and start > offsets[i - 1][0] and (text[start - 1] == "\n" or text[start:end].startswith("\n"))
        ]
        if not self.line_starts:
            raise NHARetrofitError(f"the haystack text {name!r} has no lines")

    def take(self, rng: random.Random, count: int) -> tuple[list[int], list[int]]:
        """`count` tokens from a random line start on (the text read again from its start if it ends first), and
        the offsets in them where a line starts (0 and `count` included)."""
        position = rng.choice(self.line_starts)
        ids, boundaries = [], [0]
        while len(ids) < count:
            piece = self.ids[position : position + count - len(ids)]
            first = bisect.bisect_left(self.line_starts, position)
            last = bisect.bisect_left(self.line_starts, position + len(piece))
            shift = len(ids) - position
            boundaries += [start + shift for start in self.line_starts[first:last] if start + shift > 0]
            ids += piece
            position = 0
        return ids, boundaries + [count]


def open_haystack(tokenizer, haystack: str | Path) -> Haystack:
    """The named held-out text, or a UTF-8 text file of the user's own (named by its file name)."""
    if str(haystack) in HELDOUT_TEXTS:
        return Haystack(tokenizer, str(haystack))
    path = Path(haystack)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise NHARetrofitError(f"--haystack {path} is neither a held-out text ({', '.join(HELDOUT_TEXTS)}) nor a "
                               f"readable UTF-8 text file ({type(error).__name__})") from None
    if text.count("\n") < 2:
        raise NHARetrofitError(f"--haystack {path} has fewer than 2 lines: needles go at line starts")
    return Haystack(tokenizer, path.name, text)


@dataclass
class Sample:
    """One prompt with its answer: `ids` ends with the `answer_length` tokens of the asked `value` (a number, or the
    answer's text), and the needle placed at the asked depth starts at token `needle_start`."""

    ids: list[int]
    answer_length: int
    needle_start: int
    value: int | str


def encode_question(tokenizer, task: RetrievalTask, key: str, value: int) -> tuple[list[int], int]:
    """The question followed by the answer, as one text's tokens, and how many of the last tokens hold the number."""
    text = task.question.format(key=key, value=value)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    number_start = text.rindex(str(value))
    answer_length = sum(1 for _, end in encoded["offset_mapping"] if end > number_start)
    return encoded["input_ids"], answer_length


def nearest(boundaries: list[int], target: float) -> int:
    """The boundary nearest to `target` in the ascending `boundaries`, the earlier one of two as near."""
    after = bisect.bisect_left(boundaries, target)
    return min(boundaries[max(after - 1, 0) : after + 1], key=lambda b: (abs(b - target), b))


def insert_needles(instruction: list[int], needles: list[list[int]], question: list[int], haystack: Haystack,
                   length: int, depth: float, rng: random.Random, what: str,
                   chains: tuple = ()) -> tuple[list[int], int]:
    """`length` tokens: the instruction, haystack text with the needles at line starts, the question. The first
    needle goes to the line start nearest to `depth` percent of the haystack, the others to random line starts;
    the needles of each chain (a list of indices) then take their places in chain order. Returns the ids and where
    the needle at `depth` starts."""
    room = length - len(instruction) - sum(map(len, needles)) - len(question)
    if room < 1:
        raise NHARetrofitError(f"length {length} is too short for {what}: its instruction, needles and question "
                               f"alone take {length - room} tokens")
    text, boundaries = haystack.take(rng, room)
    places = [nearest(boundaries, depth / 100 * room)] + [rng.choice(boundaries) for _ in needles[1:]]
    at_depth = places[0]
    for chain in chains:
        for index, place in zip(chain, sorted(places[i] for i in chain)):
            places[index] = place
    ids, needle_start, cursor = list(instruction), None, 0
    for index in sorted(range(len(needles)), key=lambda i: (places[i], i)):
        ids += text[cursor : places[index]]
        cursor = places[index]
        if needle_start is None and places[index] == at_depth:
            needle_start = len(ids)
        ids += needles[index]
    return ids + text[cursor:] + question, needle_start


def build_sample(tokenizer, haystack: Haystack, task: RetrievalTask, length: int, depth: float,
                 rng: random.Random) -> Sample:
    """A sample of exactly `length` tokens with the asked needle at `depth` percent of the haystack."""
    keys = rng.sample(KEY_WORDS, task.needles)
    values = [rng.randrange(10 ** (task.digits - 1), 10 ** task.digits) for _ in keys]
    asked = rng.randrange(task.needles)
    instruction = tokenizer(task.instruction)["input_ids"]  # with the special tokens a prompt starts with
    needles = [tokenizer(task.needle.format(key=k, value=v), add_special_tokens=False)["input_ids"]
               for k, v in zip(keys, values)]
    question, answer_length = encode_question(tokenizer, task, keys[asked], values[asked])
    ordered = [needles[asked]] + [needle for index, needle in enumerate(needles) if index != asked]
    ids, needle_start = insert_needles(instruction, ordered, question, haystack, length, depth, rng, task.name)
    return Sample(ids, answer_length, needle_start, values[asked])


def build_samples(tokenizer, haystack: Haystack, task: RetrievalTask, length: int, depth: float, count: int,
                  seed: int) -> list[Sample]:
    """`count` samples of one (task, length, depth) cell, the same for a given seed on any machine."""
    rng = random.Random(f"{seed}:{task.name}:{length}:{depth}")
    return [build_sample(tokenizer, haystack, task, length, depth, rng) for _ in range(count)]


@torch.no_grad()
def greedy_exact_matches(model, samples: list[Sample], device, kv_cache: str | None = None) -> list[bool]:
    """Whether greedy decoding after each sample's question would write its number: at every answer token, the
    most likely next token is that token. One forward of the batch; logits only for the answer's positions.

    `kv_cache` ("auto" or "float8_e4m3"; NHA models only): read the answer's positions from the cache a generation
    keeps instead, the prompt prefilled into an `NHAStaticCache` whose full layers store keys and values in that
    dtype, then one token at a time, so that what the cache stored is what the answer is predicted from."""
    ids = torch.tensor([sample.ids for sample in samples], dtype=torch.long, device=device)
    keep = max(sample.answer_length for sample in samples) + 1
    if kv_cache is not None and isinstance(model, NHAForCausalLMMixin):  # not the original beside it
        predicted = predictions_from_cache(model, ids, keep - 1, kv_cache_dtype(kv_cache))
    else:  # the last position's logits predict past the sample
        predicted = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[:, :-1].argmax(-1).tolist()
    return [row[len(row) - sample.answer_length :] == sample.ids[-sample.answer_length :]
            for row, sample in zip(predicted, samples)]


@torch.no_grad()
def predictions_from_cache(model, ids: torch.Tensor, count: int, kv_dtype) -> list[list[int]]:
    """The greedy next tokens of `ids` [B, L] at its last `count` tokens, each predicted from the tokens before it
    through an `NHAStaticCache` (full layers' keys and values in `kv_dtype`): a prefill up to the first of them,
    then one-token steps fed the true tokens."""
    batch, length = ids.shape
    start = length - count  # the prefill's last position predicts the token at `start`
    cache = nha_static_cache(model, batch, length, kv_dtype, cuda_graph=False)
    cache, output = prefill(model, ids[:, :start], cache)
    predicted = [output.logits[:, -1].argmax(-1)]
    for position in range(start, length - 1):
        positions = torch.full((batch, 1), position, dtype=torch.long, device=ids.device)
        output = one_token_step(model, ids[:, position : position + 1], positions, cache)
        predicted.append(output.logits[:, -1].argmax(-1))
    return torch.stack(predicted, dim=1).tolist()


def retrieval_cells(tokenizer, task_names, spec: RetrievalSpec) -> dict:
    """{(task, length, depth): samples} for every cell the tasks measure."""
    haystack = open_haystack(tokenizer, spec.haystack)
    return {
        (name, length, depth): build_samples(tokenizer, haystack, RETRIEVAL_TASKS[name], length, depth, spec.samples,
                                             spec.seed)
        for name in task_names for length in spec.lengths for depth in spec.depths
    }


def run_retrieval(variants, cells: dict, spec: RetrievalSpec, *, batch_size: int = 1, progress: bool = False) -> dict:
    """Accuracy per (length, depth) of every variant on each task of `cells`: {task: {lengths, depths, samples,
    haystack, seed, accuracy: {variant: [[per depth] per length]}}}."""
    from tqdm.auto import tqdm

    batches = -(-spec.samples // batch_size) * len(cells) * len(variants.names)
    hits = {}
    with tqdm(total=batches, desc="retrieval", unit="batch", disable=not progress) as bar:
        for variant in variants.names:
            with variants.use(variant) as model:
                for cell, samples in cells.items():
                    hits[variant, *cell] = []
                    for start in range(0, len(samples), batch_size):
                        hits[variant, *cell] += greedy_exact_matches(model, samples[start : start + batch_size],
                                                                     model.device)
                        bar.update()
    task_names = list(dict.fromkeys(name for name, _, _ in cells))
    return {
        name: {
            "lengths": list(spec.lengths), "depths": list(spec.depths), "samples": spec.samples,
            "haystack": Path(spec.haystack).name, "seed": spec.seed,
            "accuracy": {
                variant: [[sum(hits[variant, name, length, depth]) / spec.samples for depth in spec.depths]
                          for length in spec.lengths]
                for variant in variants.names
            },
        }
        for name in task_names
    }
