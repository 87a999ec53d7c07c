"""Data: local text / JSON lines / parquet, packing with EOS separators, held-out split, exact resumable position,
and the streamed path (a local dataset folder streamed through `datasets`)."""

import gzip
import json

import pytest
import torch

from ft_helpers import EOS, byte_tokenizer
from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.finetune.data import LocalBlocks, StreamedBlocks, load_blocks
from nha_retrofit.finetune.recipe import DataSection


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def test_text_jsonl_parquet_packed_with_separators(tmp_path, tokenizer):
    pytest.importorskip("datasets")
    import pandas as pd

    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"content": f"row {i} " * 10}) for i in range(5)))
    pd.DataFrame({"content": ["parquet text " * 15, "more " * 30]}).to_parquet(tmp_path / "c.parquet")
    spec = DataSection(files=[str(tmp_path / "*")], text_field="content", seq_len=16, eval_blocks=2)
    data = LocalBlocks(spec, tokenizer)
    assert data.documents == 8
    chars = 240 + sum(len(f"row {i} " * 10) for i in range(5)) + 195 + 150
    assert data.total_tokens == chars + 8  # bytes + one EOS per document
    assert data.eval_blocks.shape == (2, 16) and int((data.train == EOS).sum()) + int((data.eval_blocks == EOS).sum()) <= 8
    first = data.next_blocks(3)
    assert first.shape == (3, 16) and first.dtype == torch.long


def test_gzip_text_files_read_like_plain_ones(tmp_path, tokenizer):
    text = "gzip\u00e9d reST prose, as Debian ships its documentation. " * 7
    (tmp_path / "plain.rst").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "packed.rst.gz", "wt", encoding="utf-8") as handle:
        handle.write(text)
    spec = DataSection(files=[str(tmp_path / "*")], seq_len=8, eval_blocks=1, seed=3)
    data = LocalBlocks(spec, tokenizer)
    assert data.documents == 2 and data.total_tokens == 2 * (len(text.encode()) + 1)
    (tmp_path / "broken.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(NHARetrofitError, match=r"cannot read data file .*broken.txt.gz"):
        LocalBlocks(spec, tokenizer)


def test_missing_text_field(tmp_path, tokenizer):
    pytest.importorskip("datasets")
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(NHARetrofitError, match=r"data.text_field: 'text' is not a column .*columns: body"):
        LocalBlocks(DataSection(files=[str(tmp_path / "b.jsonl")], seq_len=4, eval_blocks=0), tokenizer)


def test_exclude_and_deterministic_resume(tmp_path, tokenizer):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(f"document {i} " * 40)
    spec = DataSection(files=[str(tmp_path / "*.txt")], exclude=[str(tmp_path / "4.txt")], seq_len=8, eval_blocks=3)
    a = LocalBlocks(spec, tokenizer)
    assert len(a.files) == 4 and all(f.name != "4.txt" for f in a.files)
    epoch = a.train.shape[0]
    blocks = [a.next_blocks(5) for _ in range(epoch // 5 + 3)]  # crosses into a second epoch (new permutation)
    b = LocalBlocks(spec, tokenizer)
    b.next_blocks(10)
    state = b.state_dict()
    c = LocalBlocks(spec, tokenizer)
    c.load_state_dict(state)
    assert torch.equal(torch.cat(blocks)[10:], torch.cat([c.next_blocks(5) for _ in range(len(blocks) - 2)]))
    assert torch.equal(a.eval_blocks, c.eval_blocks)


def test_long_blocks_are_consecutive_text_in_an_order_of_their_own(tmp_path, tokenizer):
    """data.long: a long block is `factor` consecutive blocks of the packed stream; drawing them leaves the ordinary
    blocks' order untouched, and both positions resume exactly."""
    for i in range(6):
        (tmp_path / f"{i}.txt").write_text(" ".join(f"w{i}.{j}" for j in range(90)))
    base = DataSection(files=[str(tmp_path / "*.txt")], seq_len=16, eval_blocks=2)
    spec = base.model_copy(update={"long": base.long.model_copy(update={"seq_len": 48})})
    plain, data = LocalBlocks(base, tokenizer), LocalBlocks(spec, tokenizer)
    stream = data.train.reshape(-1)
    longs = data.next_blocks(7, long=True)
    assert longs.shape == (7, 48) and longs.dtype == torch.long
    for row in longs:  # 48 tokens of the stream, from a multiple of 3 blocks
        assert any(torch.equal(stream[s : s + 48].long(), row) for s in range(0, len(stream) - 47, 48))
    assert len({tuple(r.tolist()) for r in longs}) == 7
    assert data.describe().endswith(f"(the length curriculum: {data.train.shape[0] // 3} of 48)")
    assert "curriculum" not in plain.describe()
    assert torch.equal(data.next_blocks(5), plain.next_blocks(5))
    state = data.state_dict()
    again = LocalBlocks(spec, tokenizer)
    again.load_state_dict(state)
    assert torch.equal(again.next_blocks(3, long=True), data.next_blocks(3, long=True))
    assert torch.equal(again.next_blocks(2), data.next_blocks(2))
    tiny = base.model_copy(update={"long": base.long.model_copy(update={"seq_len": 16 * 10_000})})
    with pytest.raises(NHARetrofitError, match="the dataset is too small for data.long.seq_len=160000"):
        LocalBlocks(tiny, tokenizer)


def test_streamed_dataset_folder_resumes_exactly(tmp_path, tokenizer):
    pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": f"stream doc {i} " * (i % 5 + 1)}) for i in range(60)))
    spec = DataSection(dataset=str(folder), seq_len=16, eval_blocks=2, shuffle_buffer=8)
    a = load_blocks(spec, tokenizer)
    assert isinstance(a, StreamedBlocks) and a.eval_blocks.shape == (2, 16)
    expected = [a.next_blocks(3) for _ in range(12)]  # more than one pass: epochs restart the stream
    b = StreamedBlocks(spec, tokenizer)
    b.next_blocks(3)
    b.next_blocks(3)
    c = StreamedBlocks(spec, tokenizer)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert torch.equal(torch.cat(expected[2:]), torch.cat([c.next_blocks(3) for _ in range(10)]))
    assert torch.equal(a.eval_blocks, c.eval_blocks)
    long = StreamedBlocks(spec.model_copy(update={"long": spec.long.model_copy(update={"seq_len": 32})}), tokenizer)
    joined = long.next_blocks(3, long=True)
    assert joined.shape == (3, 32) and torch.equal(joined.reshape(6, 16), torch.cat(expected[:2]))


def test_unknown_dataset_is_one_line(tokenizer, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read at import: patch the constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(NHARetrofitError, match="cannot open dataset 'nobody/no-such-dataset'"):
        StreamedBlocks(DataSection(dataset="nobody/no-such-dataset", seq_len=8), tokenizer)


def test_tokenizing_shows_progress_and_gives_the_same_ids(capsys):
    """Tokenizing the CPU demo's 204 files took 5-13 s on the CPU VM without a line: it now shows a bar."""
    from nha_retrofit.finetune.data import tokenize_documents

    tokenizer = byte_tokenizer()
    documents = [f"document {i}: " + "text " * i for i in range(1, 150)]
    quiet = list(tokenize_documents(tokenizer, documents, eos_id=2))
    assert capsys.readouterr().err == ""
    shown = list(tokenize_documents(tokenizer, documents, eos_id=2, progress=True))
    assert shown == quiet and len(quiet) == 149 and all(ids[-1] == 2 for ids in quiet)
    assert "tokenizing:   0%| " in capsys.readouterr().err


def test_exclusions_see_through_links(tmp_path, tokenizer):
    """A file excluded by one path stays out when `files` reach it through a linked folder or a linked file."""
    real = tmp_path / "real"
    real.mkdir()
    for name in ("keep.txt", "drop.txt", "other.txt"):
        (real / name).write_text(f"{name} " * 50)
    (tmp_path / "linked").symlink_to(real, target_is_directory=True)
    (tmp_path / "alias.txt").symlink_to(real / "other.txt")
    spec = DataSection(files=[str(tmp_path / "linked" / "*.txt"), str(tmp_path / "alias.txt")],
                       exclude=[str(real / "drop.txt"), str(real / "other.txt")], seq_len=8, eval_blocks=1)
    assert [f.name for f in LocalBlocks(spec, tokenizer).files] == ["keep.txt"]
