"""Hub ids missing from the cache are downloaded by the real huggingface_hub client from a local Hub
(tests/support/hub_server.py): only what conversion reads, at the asked revision with the given token, into the
Hugging Face cache; every failure is one line with nothing written; a dropped connection is resumed and a failed
run is completed by the next one."""

import hashlib
import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import cli
from hub_checkpoints import save_hub_checkpoint, use_local_hub
from hub_server import LocalHub, serve_tree
from nha_retrofit.checksums import CHECKSUMS
from nha_retrofit.conversion import convert
from nha_retrofit.plan import PlanSpec

READER, OTHER = "hf_reader_token", "hf_other_token"
NOT_FETCHED = {"README.md": b"# tiny\n", "original/consolidated.00.pth": b"not fetched", "pytorch_model.bin": b"x"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Local checkpoints the Hub serves: tiny (4 layers, 3 shards), tiny2 (2 layers), big (two shards > 10 MiB)."""
    root = tmp_path_factory.mktemp("hub-sources")
    return {
        "tiny": save_hub_checkpoint(root / "tiny", seed=11),
        "tiny2": save_hub_checkpoint(root / "tiny2", seed=12, num_hidden_layers=2),
        "big": save_hub_checkpoint(root / "big", seed=13, vocab_size=65536, max_shard_size="13MB"),
    }


@pytest.fixture
def hub(sources, monkeypatch, tmp_path):
    with LocalHub() as hub:
        hub.users.update({READER: "reader", OTHER: "other"})
        hub.add_repo("org/tiny", serve_tree(sources["tiny"], NOT_FETCHED))
        hub.add_repo("org/gated", serve_tree(sources["tiny"]), gated=True, readers=("reader",))
        hub.add_repo("org/gated", serve_tree(sources["tiny2"]), branch="v2")
        hub.add_repo("org/big", serve_tree(sources["big"]))
        hub.add_repo("org/pickles", {"config.json": (sources["tiny"] / "config.json").read_bytes(),
                                     "pytorch_model.bin": b"pickle"})
        hub.add_repo("org/no-config", {"README.md": b"# not a model\n"})
        gpt2 = dict(json.loads((sources["tiny"] / "config.json").read_text()), model_type="gpt2")
        hub.add_repo("org/gpt2", {**serve_tree(sources["tiny"]), "config.json": json.dumps(gpt2).encode()})
        use_local_hub(hub, monkeypatch, tmp_path / "hf")
        yield hub


def fetched(hub) -> list[str]:
    """The files the client downloaded (GET), in name order."""
    return sorted(re.sub(r"^/[^/]+/[^/]+/resolve/[^/]+/", "", r.path) for r in hub.file_requests("GET"))


def needed_files(folder: Path) -> set[str]:
    """What conversion reads: every file of the local checkpoint (config, generation config, index, shards,
    tokenizer), none of NOT_FETCHED."""
    return {p.name for p in folder.iterdir()}


def assert_same_conversion(out: Path, source: Path, tmp_path: Path, spec: PlanSpec):
    """`out` holds exactly what converting the local `source` with `spec` writes, but for the record of where it
    came from."""
    local = convert(source, tmp_path / "local-conversion", spec, log=lambda *_: None)
    names = {p.name for p in out.iterdir()}
    assert names == {p.name for p in local.iterdir()}
    for name in names - {"nha_conversion.json", CHECKSUMS}:
        assert (out / name).read_bytes() == (local / name).read_bytes(), name


def test_convert_downloads_only_what_conversion_reads(hub, sources, tmp_path):
    code, output = cli("convert", "--select", "even", "org/tiny", "-o", tmp_path / "out", "--full-layers", "1")
    assert code == 0, output
    assert fetched(hub) == sorted(needed_files(sources["tiny"]))  # each once; no README, original/ or pickle
    commit = hub.repos["org/tiny"].refs["main"]
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / commit
    record = json.loads((tmp_path / "out" / "nha_conversion.json").read_text())
    assert record["source"] == "org/tiny" and Path(record["source_path"]) == snapshot
    assert (tmp_path / "hf" / "hub" / "models--org--tiny" / "refs" / "main").read_text() == commit
    assert_same_conversion(tmp_path / "out", sources["tiny"], tmp_path, PlanSpec(select="even", full_layers=1))

    hub.requests.clear()  # the cached snapshot is complete: the Hub is not asked again
    assert cli("plan", "org/tiny")[0] == 0
    assert cli("convert", "--select", "even", "org/tiny", "-o", tmp_path / "again", "--full-layers", "1")[0] == 0
    assert hub.requests == []


def test_shard_altered_in_the_cache_is_refused_by_the_hubs_hash(hub, tmp_path):
    """4 KiB flipped inside a tensor of a downloaded shard: random values a local folder could not tell from
    weights, but the Hub gave each shard's SHA-256."""
    assert cli("convert", "org/tiny", "-o", tmp_path / "out", "--full-layers", "1")[0] == 0
    snapshot = next((tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots").iterdir())
    shard = snapshot / "model-00002-of-00003.safetensors"
    blob = shard.resolve()
    data = bytearray(blob.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = random.Random(0).randbytes(4096)
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    code, output = cli("convert", "org/tiny", "-o", tmp_path / "again", "--full-layers", "1")
    assert code == 1 and f"error: {shard} is corrupt: its SHA-256 differs from the one the Hub gave for it" in output
    assert not (tmp_path / "again").exists()


def test_plan_downloads_no_weights(hub):
    """`plan` (and a finetuning dry run, and the check before a conversion's download) fetch the config, tokenizer
    and generation files alone, when the full layers do not depend on the weights (`--select retrieval` probes
    them)."""
    code, output = cli("plan", "org/tiny", "--full-layers", "1", "--select", "even")
    assert code == 0 and "nha" in output.lower()
    assert "config.json" in fetched(hub) and not [name for name in fetched(hub) if "safetensors" in name]


def test_an_unsupported_family_is_refused_before_its_weights_are_fetched(hub, tmp_path):
    code, output = cli("convert", "--select", "even", "org/gpt2", "-o", tmp_path / "out", "--full-layers", "1")
    assert code == 1 and output.splitlines()[-1].startswith("error: unsupported architecture gpt2"), output
    assert not [name for name in fetched(hub) if "safetensors" in name] and not (tmp_path / "out").exists()


def test_revision_and_token(hub, sources, tmp_path):
    code, output = cli("convert", "--select", "even", "org/gated", "--revision", "v2", "--token", READER, "-o", tmp_path / "out",
                       "--full-layers", "1")
    assert code == 0, output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 2
    assert all(r.token == READER for r in hub.requests if "org/gated" in r.path)
    commit = hub.repos["org/gated"].refs["v2"]
    assert (tmp_path / "hf" / "hub" / "models--org--gated" / "refs" / "v2").read_text() == commit
    assert_same_conversion(tmp_path / "out", sources["tiny2"], tmp_path, PlanSpec(select="even", full_layers=1))


@pytest.mark.parametrize("args, token, message", [
    (["org/missing"], None, "no model 'org/missing' on the Hugging Face Hub and no local folder of that name"),
    (["org/gated"], None, "'org/gated' is gated: request access at {url}/org/gated, then log in with "
                          "`hf auth login` or pass --token"),
    (["org/gated"], OTHER, "'org/gated' is gated: request access at {url}/org/gated"),
    (["org/tiny", "--revision", "v9"], None, "'org/tiny' has no revision 'v9' on the Hub"),
    (["org/tiny", "--token", "hf_unknown"], None, "the Hub refused the token (--token, HF_TOKEN or `hf auth login`)"),
    (["org/pickles"], None, "'org/pickles' on the Hub has only pickle weights (.bin/.pt), which can run code when "
                            "loaded; no weights were downloaded: pass --allow-pickle"),
    (["org/no-config"], None, "'org/no-config' on the Hub has no config.json: it is not a transformers checkpoint"),
])
def test_failures_are_one_line(hub, monkeypatch, tmp_path, args, token, message):
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    code, output = cli("convert", "--select", "even", *args, "-o", tmp_path / "out")
    assert code == 1 and output == f"error: {output.removeprefix('error: ')}" and len(output.splitlines()) == 1
    assert message.format(url=hub.url) in output
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "hf").rglob("*.safetensors"))


def test_pickles_are_downloaded_when_allowed(hub, tmp_path):
    from nha_retrofit.conversion.resolve import resolve_model

    folder = resolve_model("org/pickles", allow_pickle=True)
    assert fetched(hub) == ["config.json", "pytorch_model.bin"]
    assert (folder / "pytorch_model.bin").read_bytes() == b"pickle"


def test_offline_is_one_line_without_network(hub, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    code, output = cli("convert", "--select", "even", "org/tiny", "-o", tmp_path / "out")
    assert code == 1 and len(output.splitlines()) == 1
    assert "model 'org/tiny' is not in the local Hugging Face cache, or only in part (looked in " in output
    assert f"{tmp_path / 'hf' / 'hub'}" in output and "HF_HUB_OFFLINE is set: unset it to download the model" in output
    assert hub.requests == [] and not (tmp_path / "out").exists()


def test_unreachable_hub_is_one_line(hub, monkeypatch, tmp_path):
    from huggingface_hub import constants

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", closed)
    code, output = cli("convert", "--select", "even", "org/tiny", "-o", tmp_path / "out")
    assert code == 1 and len(output.splitlines()) == 1 and "Traceback" not in output
    assert f"error: cannot list 'org/tiny' on the Hugging Face Hub at {closed}" in output
    assert not (tmp_path / "out").exists()


def big_shard(folder: Path) -> tuple[str, bytes]:
    path = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    assert path.stat().st_size > 10 * 2**20 + 2**19  # past huggingface_hub's 10 MiB write chunk
    return path.name, path.read_bytes()


def test_dropped_connection_is_resumed_with_a_range_request(hub, sources, tmp_path):
    name, data = big_shard(sources["big"])
    dropped_at = 10 * 2**20 + 2**19
    hub.interrupt(name, after_bytes=dropped_at)
    code, output = cli("convert", "--select", "even", "org/big", "-o", tmp_path / "out", "--full-layers", "1")
    assert code == 0, output
    first, second = [r.headers.get("range") for r in hub.file_requests() if r.path.endswith(name)]
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", second).group(1))
    assert first is None and 0 < resumed_at <= dropped_at  # the second request asks only for what is missing
    cached = tmp_path / "hf" / "hub" / "models--org--big" / "snapshots" / hub.repos["org/big"].refs["main"] / name
    assert hashlib.sha256(cached.read_bytes()).digest() == hashlib.sha256(data).digest()
    assert_same_conversion(tmp_path / "out", sources["big"], tmp_path, PlanSpec(select="even", full_layers=1))


def test_a_failed_download_is_completed_by_the_next_run(hub, sources, tmp_path):
    name, data = big_shard(sources["big"])
    hub.interrupt(name, after_bytes=10 * 2**20 + 2**19, then_status=503)
    code, output = cli("convert", "--select", "even", "org/big", "-o", tmp_path / "out", "--full-layers", "1")
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 1 and "Traceback" not in output and output.splitlines()[-1] == errors[0] and len(errors) == 1
    assert "error: downloading 'org/big' from" in errors[0] and "run the same command again to resume" in errors[0]
    assert not (tmp_path / "out").exists()

    first_run = set(fetched(hub))
    hub.requests.clear()
    code, output = cli("convert", "--select", "even", "org/big", "-o", tmp_path / "out", "--full-layers", "1")
    assert code == 0, output
    assert fetched(hub) == [name] and first_run == needed_files(sources["big"])  # finished files are not fetched again
    assert_same_conversion(tmp_path / "out", sources["big"], tmp_path, PlanSpec(select="even", full_layers=1))


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: 8-11 s
def test_the_command_in_a_fresh_process_follows_hf_endpoint_hf_home_and_hf_token(hub, sources, tmp_path):
    """The user's way: `nha-retrofit convert ID` with the environment variables huggingface_hub reads at import."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "fresh"), "HF_TOKEN": READER}
    for name in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    command = [sys.executable, "-m", "nha_retrofit.cli", "convert", "--select", "even", "org/gated", "--revision", "v2",
               "-o", str(tmp_path / "out"), "--full-layers", "1"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    snapshot = tmp_path / "fresh" / "hub" / "models--org--gated" / "snapshots" / hub.repos["org/gated"].refs["v2"]
    assert {p.name for p in snapshot.iterdir()} == needed_files(sources["tiny2"])
    assert all(r.token == READER for r in hub.requests if "org/gated" in r.path)
    assert_same_conversion(tmp_path / "out", sources["tiny2"], tmp_path, PlanSpec(select="even", full_layers=1))
