"""Shard-wise conversion on the files: layouts, the design card's Hub ids, pickles, damaged checkpoints."""

import json

import pytest
import torch

from cli_helpers import cli
from nha_retrofit.modeling.load import load_nha_checkpoint
from tiny_models import tiny_family_model, tiny_llama


def all_full_logits(folder, ids):
    model = load_nha_checkpoint(folder)
    model.set_windows([None] * model.config.num_hidden_layers)
    with torch.no_grad():
        return model(ids).logits


def test_multi_shard_checkpoint_gets_one_more_shard(tmp_path):
    original = tiny_llama(seed=2)
    original.save_pretrained(tmp_path / "src", max_shard_size="100KB")
    n_source = len(list((tmp_path / "src").glob("*.safetensors")))
    assert n_source > 2
    code, output = cli("convert", tmp_path / "src", "-o", tmp_path / "out", "--full-layers", "1")
    assert code == 0, output
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert shards == [f"model-{i:05d}-of-{n_source + 1:05d}.safetensors" for i in range(1, n_source + 2)]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.3.self_attn.g_proj.weight"] == shards[-1]
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (all_full_logits(tmp_path / "out", ids) - original(ids).logits).abs().max() <= 1e-5


def test_tied_embeddings_stay_tied(smollm2_nha):
    _, folder = smollm2_nha
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index
    model = load_nha_checkpoint(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(
    "repo_id, family", [("meta-llama/Meta-Llama-3-8B", "llama3"), ("Qwen/Qwen2.5-7B", "qwen2.5"),
                        ("Qwen/Qwen3-30B-A3B", "qwen3_moe")],
)
def test_design_card_commands_from_the_local_hf_cache(tmp_path, monkeypatch, repo_id, family):
    """`nha-retrofit convert <real id> --full-layers 4` with a small checkpoint cached under that id."""
    repo = tmp_path / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("c0ffee" * 6 + "abcd")
    tiny_family_model(family).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    code, output = cli("convert", repo_id, "--full-layers", "4", "-o", tmp_path / "out")
    assert code == 0, output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["nha_windows"].count(None) == 4


def save_pickle_checkpoint(folder):
    model = tiny_llama(seed=4)
    folder.mkdir()
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return model


def test_pickle_weights_are_refused_unless_allowed(tmp_path):
    original = save_pickle_checkpoint(tmp_path / "src")
    code, output = cli("convert", tmp_path / "src", "-o", tmp_path / "out", "--full-layers", "1")
    assert code == 1 and "only pickle weights" in output and "--allow-pickle" in output
    assert not (tmp_path / "out").exists()
    code, output = cli("convert", tmp_path / "src", "-o", tmp_path / "out", "--allow-pickle", "--full-layers", "1")
    assert code == 0, output
    assert not list((tmp_path / "out").glob("*.bin")) and not list((tmp_path / "out").glob("*.pt"))
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (all_full_logits(tmp_path / "out", ids) - original(ids).logits).abs().max() <= 1e-5


def test_unsafe_pickle_is_refused_even_when_allowed(tmp_path):
    save_pickle_checkpoint(tmp_path / "src")

    class Sneaky:
        def __reduce__(self):
            return (print, ("this would run",))

    torch.save({"weights": Sneaky()}, tmp_path / "src" / "pytorch_model.bin")
    code, output = cli("convert", tmp_path / "src", "-o", tmp_path / "out", "--allow-pickle")
    assert code == 1 and "weights_only=True" in output and not (tmp_path / "out").exists()


def damage(folder, how):
    if how == "missing shard":
        next(folder.glob("model-*.safetensors")).unlink()
    elif how == "truncated shard":
        shard = next(folder.glob("model-*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "index names absent tensor":
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"]["model.layers.0.self_attn.k_proj.weight"] = index["weight_map"]["model.norm.weight"]
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "config lacks heads":
        config = json.loads((folder / "config.json").read_text())
        del config["num_attention_heads"]
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "unsupported architecture":
        config = json.loads((folder / "config.json").read_text())
        config["model_type"] = "mistral"
        (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing shard", "is missing from"),
        ("truncated shard", "is truncated"),
        ("index names absent tensor", "does not hold it"),
        ("config lacks heads", "lacks the required field num_attention_heads"),
        ("unsupported architecture", "supported: llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3_moe"),
    ],
)
def test_damaged_checkpoints_fail_with_one_line_and_write_nothing(tmp_path, how, message):
    tiny_llama(seed=5).save_pretrained(tmp_path / "src", max_shard_size="100KB")
    damage(tmp_path / "src", how)
    code, output = cli("convert", tmp_path / "src", "-o", tmp_path / "out")
    assert code == 1 and output.startswith("error: ") and message in output and len(output.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--windows", "3,full,2"], "--windows has 3 entries; the model has 4 layers"),
        (["--windows", "3,full,x,2"], "--windows entry 2 is 'x'"),
        (["--windows", "3,full,-2,2"], "--windows entry 2 is -2"),
        (["--select", "middle", "--full-layers", "2"], "--select middle"),
        (["--gate-init", "zeros"], "--gate-init zeros"),
        (["--gate-normalizer", "0"], "--gate-normalizer 0"),
    ],
)
def test_plan_errors_name_the_offending_value(tiny_llama_folder, tmp_path, args, message):
    verbs = [["convert", tiny_llama_folder, "-o", tmp_path / "out"]]
    if "--gate-init" not in args:  # gate init is a conversion choice, not a plan option
        verbs.append(["plan", tiny_llama_folder])
    for verb in verbs:
        code, output = cli(*verb, *args)
        assert code == 1 and message in output and len(output.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_plan_selections_and_explicit_windows(tiny_llama_folder, tmp_path):
    code, output = cli("plan", tiny_llama_folder, "--select", "last", "--full-layers", "2")
    assert code == 0 and "full attention at [2, 3]" in output and "| 3 | full |" in output
    code, output = cli("plan", tiny_llama_folder, "--select", "first", "--full-layers", "1")
    assert "full attention at [0]" in output
    code, output = cli("convert", tiny_llama_folder, "-o", tmp_path / "out", "--windows", "0,full,7,FULL", "--slots", "3")
    assert code == 0, output
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["nha_windows"] == [0, None, 7, None] and config["nha_num_slots"] == 3


def test_random_gate_init(tiny_llama_folder, tmp_path):
    code, _ = cli("convert", tiny_llama_folder, "-o", tmp_path / "out", "--gate-init", "random", "--slots", "8")
    assert code == 0
    attention = load_nha_checkpoint(tmp_path / "out").model.layers[0].self_attn
    assert not torch.equal(attention.g_proj.weight, attention.k_proj.weight)
    assert 0.01 < attention.g_proj.weight.std() < 0.03


@pytest.mark.parametrize("umask", [0o022, 0o027])
@pytest.mark.parametrize("pickled", [False, True])
def test_every_written_file_honours_the_umask(tmp_path, umask, pickled):
    """safetensors writes through a private temporary file: the new shards were left 0600 while the rest was 0644."""
    import os

    if pickled:
        save_pickle_checkpoint(tmp_path / "src")
    else:
        tiny_llama(seed=4).save_pretrained(tmp_path / "src")
    previous = os.umask(umask)
    try:
        code, output = cli("convert", tmp_path / "src", "-o", tmp_path / "out", "--allow-pickle", "--full-layers", "1")
    finally:
        os.umask(previous)
    assert code == 0, output
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "out").iterdir()}
    assert len(modes) > 10 and set(modes.values()) == {0o666 & ~umask}, modes
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
