"""Training data: documents -> tokens -> packed seq_len blocks, with a held-out split and an exact, resumable position.

Two sources, one interface (`next_blocks(n)`, `state_dict()`, `load_state_dict()`, `eval_blocks`):
- local files (`data.files`): text files (any extension but .json/.jsonl/.parquet; one file = one document; a
  `.gz` suffix is read through gzip, as Debian ships its documentation),
  JSON lines and parquet (one row = one document, `data.text_field`). Documents are tokenized once, shuffled
  with `data.seed`, joined with EOS separators; the end of that stream is the held-out split, the rest is cut into
  blocks that are visited in a fresh seeded permutation every epoch. The position is a block counter.
- a Hub dataset (`data.dataset`: a Hub id, or a local dataset folder), streamed through `datasets` with a seeded shuffle buffer: the first
  `eval_blocks` blocks are held out, training continues from there. The position is (epoch, documents read,
  tokens carried over), and resuming skips the documents already read.
JSON lines and parquet go through `datasets` when it is installed (plain `json` otherwise: parquet needs it).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from pathlib import Path

import torch

from ..errors import NHARetrofitError
from .recipe import DataSection
from .synthetic import MixedBlocks, RecallExercises

STRUCTURED = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_GLOB_CHARS = set("*?[")


def real_path(path: str, folders: dict[str, str]) -> str:
    """`os.path.realpath(path)`, resolving each folder once through `folders`: the GPU recipe's exclusions match
    60,000 standard-library files, and resolving every component of each took 10 s."""
    head, name = os.path.split(os.path.abspath(path))
    if head not in folders:
        folders[head] = os.path.realpath(head)
    full = os.path.join(folders[head], name)
    return os.path.realpath(full) if os.path.islink(full) else full


def resolve_files(spec: DataSection) -> list[Path]:
    """The files `data.files` names, minus `data.exclude`, in a stable order; errors name the missing pattern."""
    folders: dict[str, str] = {}
    excluded = {real_path(p, folders) for pattern in spec.exclude for p in glob.glob(pattern, recursive=True)}
    files, seen = [], set()
    for pattern in spec.files:
        if _GLOB_CHARS & set(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise NHARetrofitError(f"recipe key data.files: {pattern} matches no files")
        else:
            if not Path(pattern).exists():
                raise NHARetrofitError(f"recipe key data.files: {pattern} not found")
            matches = [pattern]
        for match in matches:
            path = Path(match)
            if path.is_dir():
                raise NHARetrofitError(f"recipe key data.files: {match} is a folder; use a glob such as {match}/*.txt")
            if real_path(match, folders) not in excluded and path not in seen:
                files.append(path)
                seen.add(path)
    if not files:
        raise NHARetrofitError("recipe key data.files: every file is excluded by data.exclude; nothing to train on")
    return files


def _structured_rows(paths: list[Path], kind: str, text_field: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        try:
            table = datasets.load_dataset(kind, data_files=[str(p) for p in paths], split="train")
        except Exception as error:  # datasets raises many types for unreadable files
            raise NHARetrofitError(f"cannot read {paths[0].suffix} data files: {str(error).splitlines()[0]}") from None
        if text_field not in table.column_names:
            raise NHARetrofitError(
                f"recipe key data.text_field: {text_field!r} is not a column of {paths[0]} "
                f"(columns: {', '.join(table.column_names)})"
            )
        return [t for t in table[text_field] if isinstance(t, str)]
    if kind == "parquet":
        raise NHARetrofitError("parquet data files need the `datasets` package: pip install datasets")
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for n, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise NHARetrofitError(f"{path}:{n}: not a JSON line") from None
                if not isinstance(row, dict) or text_field not in row:
                    raise NHARetrofitError(f"recipe key data.text_field: {path}:{n} has no {text_field!r} field")
                rows.append(row[text_field])
    return rows


def read_text_file(path: Path) -> str:
    try:
        if path.suffix.lower() == ".gz":
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as handle:
                return handle.read()
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:  # gzip.BadGzipFile is an OSError without strerror
        raise NHARetrofitError(f"cannot read data file {path}: {error.strerror or error}") from None


def read_documents(files: list[Path], text_field: str) -> list[str]:
    """One document per text file, one per JSON line / parquet row; grouped by kind, order kept within a kind."""
    documents, groups = [], {}
    for path in files:
        kind = STRUCTURED.get(path.suffix.lower())
        if kind is None:
            documents.append(read_text_file(path))
        else:
            groups.setdefault(kind, []).append(path)
    for kind, paths in groups.items():
        documents.extend(_structured_rows(paths, kind, text_field))
    return [d for d in documents if d.strip()]


def tokenize_documents(tokenizer, documents, eos_id: int, batch: int = 64, progress: bool = False):
    """Token ids of each document followed by EOS (the document separator); `progress`: a bar per document batch."""
    from tqdm.auto import tqdm

    with tqdm(total=len(documents), desc="tokenizing", unit="doc", disable=not progress, leave=False) as bar:
        for start in range(0, len(documents), batch):
            chunk = documents[start : start + batch]
            for ids in tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]:
                if ids:
                    yield list(ids) + [eos_id]
            bar.update(len(chunk))


def eos_token_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise NHARetrofitError("the model's tokenizer has no EOS token to separate packed documents")
    return int(tokenizer.eos_token_id)


class LocalBlocks:
    """Packed blocks of local files, held entirely in memory (int32)."""

    streamed = False

    def __init__(self, spec: DataSection, tokenizer, progress: bool = False):
        self.seq_len = spec.seq_len
        self.seed = spec.seed
        self.files = resolve_files(spec)
        documents = read_documents(self.files, spec.text_field)
        if not documents:
            raise NHARetrofitError(f"the dataset is empty: {len(self.files)} file(s) hold no text")
        order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(spec.seed)).tolist()
        eos = eos_token_id(tokenizer)
        documents = [documents[i] for i in order]
        stream = [t for ids in tokenize_documents(tokenizer, documents, eos, progress=progress) for t in ids]
        self.documents = len(documents)
        self.total_tokens = len(stream)
        held = spec.eval_blocks * spec.seq_len
        n_train = (len(stream) - held) // spec.seq_len
        if n_train < 1:
            raise NHARetrofitError(
                f"the dataset is too small: {len(stream)} tokens, but data.eval_blocks={spec.eval_blocks} held-out "
                f"blocks plus one training block of data.seq_len={spec.seq_len} need {held + spec.seq_len}"
            )
        factor = spec.long_factor
        if n_train < factor:
            raise NHARetrofitError(
                f"the dataset is too small for data.long.seq_len={spec.long.seq_len}: {n_train * spec.seq_len} "
                "training tokens"
            )
        tokens = torch.tensor(stream, dtype=torch.int32)
        self.train = tokens[: n_train * spec.seq_len].view(n_train, spec.seq_len)
        # long blocks: `factor` consecutive blocks of the stream, so each is contiguous text
        self.long_train = self.train[: n_train // factor * factor].reshape(-1, factor * spec.seq_len)
        self.eval_blocks = tokens[len(stream) - held :].view(spec.eval_blocks, spec.seq_len).long()
        self.position = self.long_position = 0
        self._order_key, self._order = None, None

    @property
    def train_tokens(self) -> int:
        return self.train.numel()

    def describe(self) -> str:
        return (
            f"{len(self.files)} files, {self.documents} documents, {self.total_tokens:,} tokens: "
            f"{self.train.shape[0]:,} training blocks of {self.seq_len} + {self.eval_blocks.shape[0]} held out"
            + (f" (the length curriculum: {self.long_train.shape[0]:,} of {self.long_train.shape[1]})"
               if self.long_train.shape[1] > self.seq_len else "")
        )

    def _permutation(self, epoch: int, long: bool):
        """The shuffled order of one epoch over the blocks (or the long blocks), the same on every process."""
        if self._order_key != (epoch, long):
            seed = self.seed * 1_000_003 + epoch + 1
            gen = torch.Generator().manual_seed(seed + (1 << 40) if long else seed)
            rows = self.long_train if long else self.train
            self._order_key, self._order = (epoch, long), torch.randperm(rows.shape[0], generator=gen)
        return self._order

    def next_blocks(self, count: int, long: bool = False) -> torch.Tensor:
        """The next `count` blocks of seq_len tokens, or of data.long.seq_len tokens with `long`."""
        rows = self.long_train if long else self.train
        start = self.long_position if long else self.position
        n = rows.shape[0]
        picks = [self._permutation(g // n, long)[g % n] for g in range(start, start + count)]
        if long:
            self.long_position += count
        else:
            self.position += count
        return rows[torch.stack(picks)].long()

    def state_dict(self) -> dict:
        return {"position": self.position, "long_position": self.long_position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.long_position = int(state.get("long_position", 0))


class StreamedBlocks:
    """Packed blocks of a streamed Hub dataset (a seeded shuffle buffer; resumable by skipping read documents)."""

    streamed = True
    train_tokens = None

    def __init__(self, spec: DataSection, tokenizer):
        try:
            import datasets
        except ImportError:
            raise NHARetrofitError("data.dataset (a Hub dataset) needs the `datasets` package: pip install datasets")
        self.spec, self.tokenizer, self.eos = spec, tokenizer, eos_token_id(tokenizer)
        try:
            self.dataset = datasets.load_dataset(
                spec.dataset, spec.dataset_config, split=spec.split, streaming=True
            ).shuffle(seed=spec.seed, buffer_size=spec.shuffle_buffer)
        except Exception as error:  # offline, unknown name, gated: datasets raises many types
            raise NHARetrofitError(
                f"cannot open dataset {spec.dataset!r} (split {spec.split!r}): {str(error).splitlines()[0]}"
            ) from None
        self.epoch, self.docs, self.carry = 0, 0, []
        self._iterator = None
        eval_rows = self._take(spec.eval_blocks) if spec.eval_blocks else []
        self.eval_blocks = torch.tensor(eval_rows, dtype=torch.long).view(spec.eval_blocks, spec.seq_len)
        self.eval_state = self.state_dict()

    def describe(self) -> str:
        return f"Hub dataset {self.spec.dataset} (streamed, shuffle buffer {self.spec.shuffle_buffer}), " \
               f"{self.spec.eval_blocks} held-out blocks of {self.spec.seq_len}"

    def _documents(self):
        self.dataset.set_epoch(self.epoch)
        stream = self.dataset.skip(self.docs) if self.docs else self.dataset
        for row in stream:
            self.docs += 1
            text = row.get(self.spec.text_field)
            if text is None:
                raise NHARetrofitError(
                    f"recipe key data.text_field: {self.spec.text_field!r} is not a field of {self.spec.dataset} "
                    f"(fields: {', '.join(row)})"
                )
            yield text

    def _take(self, count: int) -> list[list[int]]:
        need = count * self.spec.seq_len
        restarted = False
        while len(self.carry) < need:
            if self._iterator is None:
                self._iterator = self._documents()
            try:
                text = next(self._iterator)
            except StopIteration:
                if restarted:
                    raise NHARetrofitError(f"the dataset {self.spec.dataset} is empty") from None
                self.epoch, self.docs, self._iterator, restarted = self.epoch + 1, 0, None, True
                continue
            ids = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            if ids:
                self.carry.extend(list(ids) + [self.eos])
                restarted = False
        blocks, self.carry = self.carry[:need], self.carry[need:]
        return [blocks[i : i + self.spec.seq_len] for i in range(0, need, self.spec.seq_len)]

    def next_blocks(self, count: int, long: bool = False) -> torch.Tensor:
        """The next `count` blocks of seq_len tokens, or of data.long.seq_len tokens (consecutive blocks) with
        `long`."""
        factor = self.spec.long_factor if long else 1
        return torch.tensor(self._take(count * factor), dtype=torch.long).view(count, factor * self.spec.seq_len)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "docs": self.docs, "carry": list(self.carry)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.docs, self.carry = int(state["epoch"]), int(state["docs"]), list(state["carry"])
        self._iterator = None


def load_blocks(spec: DataSection, tokenizer, progress: bool = False):
    """The training and held-out blocks; `progress`: a bar while local files are tokenized (streamed data is
    tokenized as training reads it)."""
    # a Hub id, or a local dataset folder: streamed either way
    blocks = StreamedBlocks(spec, tokenizer) if spec.dataset else LocalBlocks(spec, tokenizer, progress)
    if spec.synthetic.share > 0:
        exercises = RecallExercises(tokenizer, spec.synthetic.share, spec.synthetic.records, spec.seed)
        blocks = MixedBlocks(blocks, exercises)
    return blocks
