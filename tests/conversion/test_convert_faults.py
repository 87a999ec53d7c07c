"""`convert` under damage and interference: corrupt weights, a config that disagrees with its shards, a second run
finishing the same output first, a full disk, temporary folders of killed runs. Each is one line (exit 1) with
nothing written; the output records a SHA-256 per file that loading checks."""

import errno
import json
import os
import random
import socket
import subprocess
import sys

import pytest
from safetensors import SafetensorError

from cli_helpers import cli
from nha_retrofit.checksums import CHECKSUMS, sha256_of
from nha_retrofit.conversion import converter, convert, shards
from nha_retrofit.conversion.resolve import resolve_model
from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.modeling.load import load_nha_checkpoint
from nha_retrofit.plan import PlanSpec

quiet = dict(log=lambda *_: None)


def flip_inside_a_tensor(path, count=4096, seed=0):
    """Overwrite `count` bytes in the middle of the largest tensor of a safetensors file with random bytes."""
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_length])
    start, end = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda o: o[1] - o[0])
    count = min(count, end - start)
    at = 8 + header_length + start + (end - start - count) // 2
    data = bytearray(path.read_bytes())
    data[at : at + count] = random.Random(seed).randbytes(count)
    path.write_bytes(bytes(data))


def error_line(code, output) -> str:
    """The one `error:` line of a failed command (beside the lines it logged), and no traceback."""
    assert code == 1 and "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    return errors[0]


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_output_records_each_file_and_loading_checks_it(tiny_llama_folder, tmp_path):
    out = convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(full_layers=1, window=2, slots=3), **quiet)
    recorded = json.loads((out / CHECKSUMS).read_text())
    assert set(recorded) == {p.name for p in out.iterdir()} - {CHECKSUMS}
    assert all(sha256_of(out / name) == digest for name, digest in recorded.items())
    load_nha_checkpoint(out)
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    flip_inside_a_tensor(shard)
    with pytest.raises(NHARetrofitError, match=rf"{shard.name} is corrupt: its SHA-256 differs from the one recorded "
                                               rf"when it was written \(if you changed it on purpose, delete "
                                               rf".*{CHECKSUMS} to stop checking\)"):
        load_nha_checkpoint(out)
    (out / CHECKSUMS).unlink()
    load_nha_checkpoint(out)


def test_local_source_with_corrupt_bytes_is_refused(tiny_llama_folder, tmp_path):
    """A local folder carries no hashes: the NaN and infinities that random bytes read as are caught."""
    flip_inside_a_tensor(tiny_llama_folder / "model.safetensors")
    output = error_line(*cli("convert", tiny_llama_folder, "-o", tmp_path / "nha", "--full-layers", "1"))
    assert "model.safetensors is corrupt: tensor lm_head.weight holds non-finite values" in output
    assert not (tmp_path / "nha").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("layers", [3, 5])
def test_config_that_disagrees_with_the_shards_is_refused(tiny_llama_folder, tmp_path, layers):
    config = json.loads((tiny_llama_folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    (tiny_llama_folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    output = error_line(*cli("convert", tiny_llama_folder, "-o", tmp_path / "nha", "--full-layers", "1"))
    detail = ("it holds model.layers.3.input_layernorm.weight, which that model does not have (0 missing, 13 "
              "unexpected)" if layers == 3 else "it lacks model.layers.4.input_layernorm.weight (13 missing, 0 unexpected)")
    assert f"does not match its config: config.json gives {layers} layers; {detail}" in output
    assert not (tmp_path / "nha").exists()


def test_second_of_two_runs_to_one_output_fails_and_keeps_the_first(tiny_llama_folder, tmp_path, monkeypatch):
    out = tmp_path / "nha"
    first = convert(tiny_llama_folder, tmp_path / "first", PlanSpec(full_layers=1), **quiet)
    real = converter.write_remote_code

    def other_run_finishes(folder, model_class):  # the other run renames its output while this one writes
        real(folder, model_class)
        first.rename(out)

    monkeypatch.setattr(converter, "write_remote_code", other_run_finishes)
    output = error_line(*cli("convert", tiny_llama_folder, "-o", out, "--full-layers", "2"))
    assert f"output {out} appeared while this run was writing it (another run?); it is kept" in output
    assert json.loads((out / "config.json").read_text())["nha_windows"].count(None) == 1  # the first run's
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("where, error", [
    ("copy", OSError(errno.ENOSPC, "No space left on device")),
    ("save_file", SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")),
])
def test_full_disk_is_one_line_and_leaves_nothing(tiny_llama_folder, tmp_path, monkeypatch, where, error):
    def full(source_or_tensors, dest, **kwargs):
        dest.write_bytes(b"partial")
        raise error

    monkeypatch.setattr(*(shards.shutil, "copyfile") if where == "copy" else (shards, "save_file"), full)
    output = error_line(*cli("convert", tiny_llama_folder, "-o", tmp_path / "nha", "--full-layers", "1"))
    assert output == f"error: cannot write {tmp_path / 'nha'}: No space left on device; nothing was written"
    assert not (tmp_path / "nha").exists() and leftovers(tmp_path) == []


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_temporary_folders_of_killed_runs_are_removed(tiny_llama_folder, tmp_path):
    host = socket.gethostname()
    killed = tmp_path / f".nha.tmp-{host}-{dead_pid()}-x1"
    live = tmp_path / f".nha.tmp-{host}-{os.getpid()}-x2"  # a run still going: kept
    other_host = tmp_path / f".nha.tmp-elsewhere-{dead_pid()}-x3"  # another machine's: its processes are unknown
    for folder in (killed, live, other_host):
        folder.mkdir()
        (folder / "model-00001-of-00002.safetensors").write_bytes(bytes(2_000_000))
    said = []
    convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(full_layers=1), log=said.append)
    assert f"removed {killed} (2 MB), left by a run that was killed" in said
    assert not killed.exists() and live.exists() and other_host.exists()


def test_embedded_model_cache_removes_temporary_folders_of_killed_runs(tmp_path, capsys):
    """A later run that finds the model cached still removes what a killed first run left."""
    cached = tmp_path / "models" / "smollm2-135m"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    (cached / "model.safetensors").write_bytes(b"cached")
    killed = tmp_path / "models" / f".smollm2-135m.tmp-{socket.gethostname()}-{dead_pid()}-x1"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(bytes(3_000_000))
    assert resolve_model("smollm2-135m", cache_dir=tmp_path) == cached
    assert not killed.exists()
    assert f"removed {killed} (3 MB), left by a run that was killed" in capsys.readouterr().err
