"""The retrieval suite's fixed texts, as data: per group, the haystack texts, the key and value words, and each
task's templates (instruction, needle, question). The `heldout` group shares no template phrase, word or haystack
with the `tuning` group, so that it can be kept out of every training and tuning decision.

Placeholders: `{key}` (a key word, an id or a variable name), `{value}` (the value a needle holds), `{source}` (the
variable a variable-tracking link copies), and `{answer}`, which ends every question: the scored text. A needle
starts and ends with a line break, so it sits on its own line at a line start of the haystack.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    """One phrasing of a task. `link`: variable tracking's copy statement (`{key}` takes `{source}`'s value)."""

    instruction: str
    needle: str
    question: str
    link: str = ""


@dataclass(frozen=True)
class NeedleGroup:
    """What one group's samples are made of."""

    haystacks: tuple[str, ...]  # held-out texts (`texts.py`)
    keys: tuple[str, ...]
    words: tuple[str, ...]  # the values of the word task
    templates: dict  # {task: (Template, ...)}


_MAGIC_NUMBER = Template(
    instruction="Some special magic numbers are hidden within the following text. Make sure to memorize them. "
                "I will quiz you about the numbers afterwards.\n",
    needle="\nOne of the special magic numbers for {key} is: {value}.\n",
    question="\nWhat is the special magic number for {key} mentioned in the provided text? "
             "The special magic number for {key} mentioned in the provided text is {answer}",
)
_BELONGS_NUMBER = Template(
    instruction="Numbers tied to certain names are scattered through this document. Keep each of them in mind.\n",
    needle="\nThe number that belongs to {key} is {value}.\n",
    question="\nWhich number did the document assign to {key}? It assigned to {key} the number {answer}",
)

TUNING = NeedleGroup(
    haystacks=("python-docs", "python-stdlib"),
    keys=("apple", "river", "candle", "mountain", "violin", "harbor", "pepper", "lantern", "meadow", "falcon",
          "copper", "orchid", "glacier", "anchor", "saffron", "compass", "thunder", "willow", "marble", "beacon"),
    words=("banana", "cobalt", "dolphin", "eclipse", "granite", "hammock", "iceberg", "jasmine", "kettle", "lobster",
           "magnet", "nutmeg", "oyster", "pickle", "quiver", "rocket", "sandal", "tulip", "umbrella", "walrus"),
    templates={
        "passkey": (
            Template(
                instruction="There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
                            "I will quiz you about the pass key.\n",
                needle="\nThe pass key is {value}. Remember it. {value} is the pass key.\n",
                question="\nWhat is the pass key? The pass key is {answer}",
            ),
            Template(
                instruction="A pass key is buried somewhere below. Find it and keep it in mind.\n",
                needle="\nRemember this pass key: {value}. The pass key is {value}.\n",
                question="\nWhich pass key was given above? The pass key given above is {answer}",
            ),
        ),
        "niah_number": (_MAGIC_NUMBER, _BELONGS_NUMBER),
        "niah_word": (
            Template(
                instruction="Code words for some names are hidden in the following text. Memorize them.\n",
                needle="\nThe code word for {key} is {value}.\n",
                question="\nWhat did the text give as the code word of {key}? The code word of {key} is {answer}",
            ),
            Template(
                instruction="Some names are paired with a word somewhere in this document. Remember the pairs.\n",
                needle="\nRemember that {key} goes with the word {value}.\n",
                question="\nWhich word goes with {key} in the document above? The word paired with {key} is "
                         "{answer}",
            ),
        ),
        "niah_id": (
            Template(
                instruction="Identifiers of some names are hidden in the following text. Memorize them.\n",
                needle="\nThe identifier of {key} is {value}.\n",
                question="\nWhat identifier did the text give {key}? The identifier of {key} is {answer}",
            ),
            Template(
                instruction="The document below contains records with ids. Remember every record.\n",
                needle="\nRecord for {key}: id {value}.\n",
                question="\nWhich id does the record for {key} carry? The record for {key} carries the id {answer}",
            ),
        ),
        "multikey": (_MAGIC_NUMBER, _BELONGS_NUMBER),
        "multivalue": (
            Template(
                instruction="Some special magic numbers are hidden within the following text. Make sure to "
                            "memorize them. I will quiz you about the numbers afterwards.\n",
                needle="\nOne of the special magic numbers for {key} is: {value}.\n",
                question="\nWhat are all the special magic numbers for {key}, in the order they appear in the "
                         "provided text? The special magic numbers for {key} are {answer}",
            ),
        ),
        "kv": (
            Template(
                instruction="JSON key-value pairs are spread through the following text. Extract the value of "
                            "the key asked for.\n",
                needle='\n{{"{key}": "{value}"}}\n',
                question='\nWhat is the value of the key "{key}" in the JSON pairs above? The value of "{key}" is '
                         '{answer}',
            ),
        ),
        "vartrack": (
            Template(
                instruction="Memorize the variable assignments hidden in the following text. I will ask about them "
                            "afterwards.\n",
                needle="\nVAR {key} = {value}\n",
                link="\nVAR {key} = VAR {source}\n",
                question="\nFind all variables that are assigned the value {value} in the text above, directly or "
                         "through other variables. Answer: the variables are {answer}",
            ),
        ),
    },
)
_LUCKY_FIGURE = Template(
    instruction="Amid the verses below, certain names receive a lucky figure. Keep track of each.\n",
    needle="\nLet it be known: {key} was granted the lucky figure {value}.\n",
    question="\nWhat lucky figure was {key} granted? Granted to {key} was the lucky figure {answer}",
)

HELDOUT = NeedleGroup(
    haystacks=("shakespeare",),
    keys=("turquoise", "pelican", "sundial", "bramble", "quokka", "lilac", "obsidian", "parsnip", "tambourine",
          "mistral", "badger", "nectar", "juniper", "kestrel", "mango", "velvet", "cinnabar", "hazel", "puffin",
          "sorrel"),
    words=("acorn", "biscuit", "chimney", "dagger", "feather", "goblet", "harp", "ivory", "jigsaw", "kayak",
           "ladder", "mitten", "needle", "oboe", "parrot", "quill", "raven", "saddle", "thimble", "yarn"),
    templates={
        "passkey": (
            Template(
                instruction="Within this passage lies a secret access code. Watch for it closely.\n",
                needle="\nHear this: the access code is {value}. Mark well, {value} opens the gate.\n",
                question="\nTell me, what opens the gate? The access code reads {answer}",
            ),
        ),
        "niah_number": (_LUCKY_FIGURE,),
        "niah_word": (
            Template(
                instruction="A few names carry a watchword hidden among these lines. Commit them to memory.\n",
                needle="\nFor {key}, the watchword shall be {value}.\n",
                question="\nWhat watchword was set down for {key}? Its watchword was {answer}",
            ),
        ),
        "niah_id": (
            Template(
                instruction="Ledger entries with serial marks are tucked among these lines. Note every mark.\n",
                needle="\nLedger entry {key} bears the serial mark {value}.\n",
                question="\nWhich serial mark did ledger entry {key} bear? Entry {key} bore serial mark {answer}",
            ),
        ),
        "multikey": (_LUCKY_FIGURE,),
        "multivalue": (
            Template(
                instruction="Several tallies for one name are scattered across this passage. Gather them all.\n",
                needle="\nAdd to the tally of {key}: {value}.\n",
                question="\nList every tally of {key}, first to last as written. Tallies of {key}: {answer}",
            ),
        ),
        "kv": (
            Template(
                instruction="Lookup rows, each mapping a label to a token, lie among these lines. Find the one "
                            "requested.\n",
                needle="\nrow <{key}> maps to <{value}>\n",
                question="\nIn those rows, <{key}> maps to which token? Row <{key}> maps to {answer}",
            ),
        ),
        "vartrack": (
            Template(
                instruction="Through this passage, registers get loaded and copied. Follow each one.\n",
                needle="\nload register {key} with {value}\n",
                link="\ncopy register {source} into register {key}\n",
                question="\nWhich registers end up holding {value}, loaded or copied? Registers holding it: "
                         "{answer}",
            ),
        ),
    },
)

GROUPS = {"tuning": TUNING, "heldout": HELDOUT}
SUITE_TASKS = ("passkey", "niah_number", "niah_word", "niah_id", "multikey", "multivalue", "kv", "vartrack")


def fixed_texts(group: NeedleGroup) -> list[str]:
    """Every text a group's samples take from this module: templates, keys, words, haystack names."""
    templates = {template for task in group.templates.values() for template in task}
    return [text for template in templates
            for text in (template.instruction, template.needle, template.question, template.link) if text] + [
        *group.keys, *group.words, *group.haystacks]


def word_ngrams(texts, n: int = 3) -> set[tuple[str, ...]]:
    """The runs of `n` consecutive words (lower-cased, a placeholder counting as a word) in each of `texts`: what
    two sets of templates must not share to be phrased apart."""
    grams = set()
    for text in texts:
        words = re.findall(r"\{\w+\}|[a-z0-9]+", text.lower())
        grams |= {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}
    return grams
