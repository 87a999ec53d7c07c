"""Synthetic long-range exercises mixed into training blocks.

Ordinary text rarely makes a model look thousands of tokens back for one exact fact, and that is what the full
layers and the slots must keep doing after conversion. A share of the training blocks (`data.synthetic.share`)
becomes an exercise built on the block's own text: a few record lines are written at random line starts in its first
part, and the block ends by asking some of them back (the record's key, then its value again), or by quoting an
earlier line of the block from its first words. Values are numbers, hex strings, made-up words and words of the
block's own text. Every token keeps its ordinary next-token loss and the teacher's KL, so the recall is learnt from
the answers' tokens and the rest of the block still trains language modelling.

The wording, keys and values here are the training side's own: the retrieval suite (`eval/needles.py`)
must share no template with them (a test checks it), so the suite measures retrieval, not these formats.
Exercises are deterministic given the data seed and the block's index in the stream, hence exact on resume.
"""

from __future__ import annotations

import random
import re

import torch

# (record line, question that asks it back): `{key}` and `{value}` are filled in; the question ends with the value
RECORD_FORMATS = (
    ("\n[ledger] slot {key} -> {value}\n", "\n[ledger] recall slot {key} -> {value}\n"),
    ("\nItem {key} was shelved in bin {value}.\n", "\nWhich bin holds item {key}? Bin {value}.\n"),
    ("\n# cfg: {key}={value}\n", "\n# cfg lookup {key} returns {value}\n"),
    ("\n({key} is filed as {value})\n", "\nFiled as, for {key}: {value}\n"),
)
LINE_QUOTE = ("\nThe line starting with \"{head}\" continues:", " {tail}\n")
SYLLABLES = ("ka", "ro", "mi", "tu", "zen", "lo", "vex", "qua", "dri", "po", "sul", "ne", "bri", "tor", "xi", "fa")


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))


def _key(rng: random.Random) -> str:
    return f"{_pseudo_word(rng).upper()}-{rng.randint(10, 999)}"


def _value(rng: random.Random, words: list[str]) -> str:
    """A number, a hex string, a made-up word, or one of `words` (the block's own): a value that is an ordinary word
    of the text around it can only be told apart by where it stands, which is what a word needle asks of a model."""
    kind = rng.randrange(4)
    if kind == 0:
        return str(rng.randrange(10 ** rng.randint(3, 7), 10 ** 8))
    if kind == 1:
        return "".join(rng.choice("0123456789abcdef") for _ in range(rng.randint(6, 12)))
    if kind == 2 or not words:
        return _pseudo_word(rng)
    return rng.choice(words)


class RecallExercises:
    """Turns a share of training blocks into recall exercises over their own text (see the module docstring)."""

    def __init__(self, tokenizer, share: float, records: int, seed: int):
        self.tokenizer, self.share, self.records, self.seed = tokenizer, share, records, seed
        newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        self.newline = newline[-1] if newline else None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def apply(self, block: torch.Tensor, index: int) -> torch.Tensor:
        """`block` (one row of token ids, of any length), turned into an exercise when the index's draw says so."""
        rng = random.Random(f"{self.seed}:{index}")
        if rng.random() >= self.share:
            return block
        ids, seq_len = block.tolist(), len(block)
        words = sorted(set(re.findall(r"\b[a-z]{4,12}\b", self.tokenizer.decode(ids[: seq_len // 2]))))
        records, questions = [], []
        for _ in range(self.records):
            record, question = rng.choice(RECORD_FORMATS)
            key, value = _key(rng), _value(rng, words)
            records.append(self._encode(record.format(key=key, value=value)))
            questions.append(self._encode(question.format(key=key, value=value)))
        rng.shuffle(questions)
        questions = questions[: rng.randint(1, len(questions))]
        quote = self._line_quote(ids[: seq_len // 2], rng)  # a line from the half that is always kept
        if quote:
            questions.insert(rng.randrange(len(questions) + 1), quote)
        # the text kept before the questions: every record inserted into it must survive the cut
        body = seq_len - sum(map(len, records)) - sum(map(len, questions))
        if body < seq_len // 2:
            return block
        tail = [t for q in questions for t in q]
        # records go at line starts (after a line break), so that no line of the block, quoted or not, is cut
        starts = [i + 1 for i in range(body - 1) if ids[i] == self.newline] or list(range(body))
        for position, tokens in sorted(((rng.choice(starts), r) for r in records), key=lambda p: -p[0]):
            ids[position:position] = tokens
        room = seq_len - len(tail)
        return torch.tensor(ids[:room] + tail, dtype=block.dtype)

    def _line_quote(self, ids: list[int], rng: random.Random) -> list[int] | None:
        """An earlier line of the block asked back from its first words, when the block has a usable line."""
        if self.newline is None:
            return None
        starts = [i + 1 for i, t in enumerate(ids[:-40]) if t == self.newline]
        rng.shuffle(starts)
        for start in starts[:8]:
            end = next((i for i in range(start, min(start + 40, len(ids))) if ids[i] == self.newline), None)
            if end is None or end - start < 10:
                continue
            line = self.tokenizer.decode(ids[start:end]).strip()
            words = line.split()
            if len(words) < 6:
                continue
            head, rest = " ".join(words[:4]), " ".join(words[4:])
            return self._encode(LINE_QUOTE[0].format(head=head) + LINE_QUOTE[1].format(tail=rest))
        return None


class MixedBlocks:
    """A block source (`data.py`) whose blocks pass through `RecallExercises`; the same interface, and its state
    adds the count of blocks drawn (the exercises' index)."""

    def __init__(self, blocks, exercises: RecallExercises):
        self.blocks, self.exercises, self.drawn = blocks, exercises, 0

    def __getattr__(self, name):
        return getattr(self.blocks, name)

    def describe(self) -> str:
        return (f"{self.blocks.describe()}; {self.exercises.share:.0%} of blocks carry {self.exercises.records} "
                "recall records")

    def next_blocks(self, count: int, long: bool = False) -> torch.Tensor:
        rows = self.blocks.next_blocks(count, long)
        mixed = torch.stack([self.exercises.apply(row, self.drawn + i) for i, row in enumerate(rows)])
        self.drawn += count
        return mixed

    def state_dict(self) -> dict:
        return {**self.blocks.state_dict(), "synthetic_drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.drawn = int(state.pop("synthetic_drawn", 0))
        self.blocks.load_state_dict(state)
