"""Conversion: exactness against the original, the self-contained checkpoint, gate initialisation, bad input."""

import json
import shutil

import pytest
import torch
from transformers import LlamaForCausalLM

from cli_helpers import cli
from fresh_process import run_without_nha_retrofit
from nha_retrofit.conversion import convert
from nha_retrofit.modeling.load import load_nha_checkpoint
from nha_retrofit.plan import PlanSpec
from nha_retrofit.modeling.remote_code import REMOTE_CODE_FILES


def test_all_full_converted_tiny_model_equals_original(tiny_llama_folder, tmp_path):
    out = convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(select="even", full_layers=1, window=3, slots=5), log=lambda *_: None)
    original = LlamaForCausalLM.from_pretrained(tiny_llama_folder).eval()
    nha = load_nha_checkpoint(out)
    assert nha.config.nha_windows == [3, None, 3, 3]
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hybrid = nha(ids).logits
        nha.set_windows([None] * 4)
        assert (nha(ids).logits - original(ids).logits).abs().max() <= 1e-5
    assert (hybrid - original(ids).logits).abs().max() > 1e-4  # the plan does change the model


def test_smollm2_all_full_equals_original_and_generates(smollm2_nha):
    source, folder = smollm2_nha
    original = LlamaForCausalLM.from_pretrained(source).eval()
    nha = load_nha_checkpoint(folder)
    assert nha.config.nha_windows.count(None) == 4 and set(nha.config.nha_windows) == {None, 64}
    ids = torch.randint(0, 49152, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        nha.set_windows([None] * 30)
        assert (nha(ids).logits - original(ids).logits).abs().max() <= 1e-5


@pytest.mark.slow  # the gate-bias test below loads a biased checkpoint this way in the default tier
def test_checkpoint_loads_and_generates_where_nha_retrofit_is_absent(tiny_llama_folder, tmp_path):
    """Fresh process, `import nha_retrofit` made impossible: only transformers + torch + the shipped files."""
    out = convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(select="even", full_layers=2, window=4, slots=6), log=lambda *_: None)
    nha = load_nha_checkpoint(out)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = nha(ids).logits
    name, diff, length = run_without_nha_retrofit(out, ids, expected, tmp_path, prompt_tokens=10, new_tokens=5,
                                                  pad_token_id=0)
    assert name == "NHALlamaForCausalLM" and diff <= 1e-6 and length == 15


def test_save_and_reload_gives_identical_logits(tiny_llama_folder, tmp_path):
    out = convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(select="even", full_layers=1, window=2, slots=3), log=lambda *_: None)
    first = load_nha_checkpoint(out)
    first.save_pretrained(tmp_path / "again")
    second = load_nha_checkpoint(tmp_path / "again")
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)


@pytest.mark.parametrize("slots", [8, 5, 19])  # head_dim is 8: equal, fewer, more (cyclic)
def test_gate_projection_starts_from_key_projection(tiny_llama_folder, tmp_path, slots):
    out = convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(select="even", full_layers=0, slots=slots), log=lambda *_: None)
    attention = load_nha_checkpoint(out).model.layers[1].self_attn
    keys = attention.k_proj.weight.view(2, 8, -1)
    gates = attention.g_proj.weight.view(2, slots, -1)
    for i in range(slots):
        assert torch.equal(gates[:, i], keys[:, i % 8])
    assert torch.equal(attention.slot_bias, torch.full((6,), -4.0))


def test_gate_bias_lengthens_the_slot_memory_and_travels_with_the_checkpoint(tiny_llama_folder, tmp_path):
    """--gate-bias-init b: every layer's g_proj gets the bias b beside the same weights, so each gate logit moves by
    b and alpha = sigmoid(g + b) ** (1 / tau) comes nearer 1; the in-memory build is the written checkpoint, and
    the checkpoint runs where nha_retrofit is absent. With None there is no bias, as in checkpoints made before."""
    from nha_retrofit.conversion.converter import build_nha_model
    from nha_retrofit.ops.nha.gates import gate_log_alpha
    from nha_retrofit.plan import build_plan

    spec = PlanSpec(select="even", full_layers=1, window=3, slots=5, gate_bias_init=None)
    biased_spec = PlanSpec(select="even", full_layers=1, window=3, slots=5, gate_bias_init=3.0)
    plain = load_nha_checkpoint(convert(tiny_llama_folder, tmp_path / "plain", spec, log=lambda *_: None))
    out = convert(tiny_llama_folder, tmp_path / "biased", biased_spec, log=lambda *_: None)
    biased = load_nha_checkpoint(out)
    assert biased.config.nha_gate_bias_init == 3.0 and plain.config.nha_gate_bias_init is None
    hidden = torch.randn(2, 7, plain.config.hidden_size, generator=torch.Generator().manual_seed(2))
    for layer in range(4):
        with_bias, without = biased.model.layers[layer].self_attn, plain.model.layers[layer].self_attn
        assert torch.equal(with_bias.g_proj.bias, torch.full((2 * 5,), 3.0)) and without.g_proj.bias is None
        with torch.no_grad():
            torch.testing.assert_close(with_bias.gate_logits(hidden), without.gate_logits(hidden) + 3.0)
            alpha = [gate_log_alpha(a.gate_logits(hidden), a.gate_normalizer).exp() for a in (with_bias, without)]
        assert (alpha[0] > alpha[1]).all()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    in_memory = build_nha_model(tiny_llama_folder, build_plan(4, biased_spec))
    with torch.no_grad():
        expected = biased(ids).logits
        assert torch.equal(in_memory(ids).logits, expected)
        assert (expected - plain(ids).logits).abs().max() > 1e-4  # the bias does change the hybrid
    name, diff, length = run_without_nha_retrofit(out, ids, expected, tmp_path, prompt_tokens=10, new_tokens=5,
                                                  pad_token_id=0)
    assert name == "NHALlamaForCausalLM" and diff <= 1e-6 and length == 15


def test_conversion_record_and_remote_code_files(tiny_llama_folder, tmp_path):
    out = convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(full_layer_ids=[0, 3]), log=lambda *_: None)
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_nha.NHALlamaConfig", "AutoModelForCausalLM": "modeling_nha.NHALlamaForCausalLM",
    }
    assert config["nha_windows"] == [None, 256, 256, None] and config["nha_num_slots"] == 64
    assert sorted(path.name for path in out.glob("*.py")) == sorted(REMOTE_CODE_FILES)
    assert "from .chunk_torch import nha_chunked" in (out / "dispatch.py").read_text()
    record = json.loads((out / "nha_conversion.json").read_text())
    assert record["plan"]["windows"] == [None, 256, 256, None]


def test_cli_convert_works_and_prints_the_plan(tiny_llama_folder, tmp_path):
    code, output = cli("convert", tiny_llama_folder, "--output", tmp_path / "out", "--full-layers", "2",
                       "--select", "even")
    assert code == 0 and "full attention at [0, 2]" in output
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such-model"], "cannot resolve model 'no-such-model'"),
        (["{tiny}", "--full-layers", "-1"], "--full-layers -1"),
        (["{tiny}", "--full-layers", "5"], "--full-layers 5"),
        (["{tiny}", "--full-layer-ids", "1,1"], "listed more than once"),
        (["{tiny}", "--full-layer-ids", "0,4"], "--full-layer-ids 4: out of range"),
        (["{tiny}", "--full-layers", "2", "--full-layer-ids", "0,3"], "--full-layers and --full-layer-ids: give one"),
        (["{tiny}", "--window", "-3"], "--window -3"),
        (["{tiny}", "--slots", "0"], "--slots 0"),
        (["{gpt2}"], "unsupported architecture gpt2"),
        (["{nha}"], "already an NHA checkpoint"),
        (["{tiny}", "--existing"], "already exists; pass --overwrite"),
    ],
)
def test_cli_bad_input_is_one_line_and_writes_nothing(tiny_llama_folder, tmp_path, args, message):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    nha = convert(tiny_llama_folder, tmp_path / "nha-model", PlanSpec(select="even", full_layers=1), log=lambda *_: None)
    output = tmp_path / "out"
    if "--existing" in args:
        args = [a for a in args if a != "--existing"]
        output.mkdir()
        (output / "keep.txt").write_text("mine")
    args = [a.format(tiny=tiny_llama_folder, gpt2=gpt2, nha=nha) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, text = cli("convert", *args, "--output", output)
    assert code == 1
    assert text.startswith("error: ") and message in text and len(text.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if output.exists():
        assert [p.name for p in output.iterdir()] == ["keep.txt"]


def test_failed_conversion_leaves_nothing_behind(tiny_llama_folder, tmp_path, monkeypatch):
    import nha_retrofit.conversion.converter as converter

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(converter, "write_sharded", broken)
    with pytest.raises(RuntimeError):
        convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(select="even", full_layers=1), log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]


def test_overwrite_replaces_an_existing_checkpoint(tiny_llama_folder, tmp_path):
    convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(select="even", full_layers=1), log=lambda *_: None)
    convert(tiny_llama_folder, tmp_path / "nha", PlanSpec(select="even", full_layers=2), overwrite=True, log=lambda *_: None)
    assert json.loads((tmp_path / "nha" / "config.json").read_text())["nha_windows"].count(None) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nha", "tiny-llama"]


def test_convert_a_hub_id_from_the_local_hf_cache(tiny_llama_folder, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--meta-llama--Meta-Llama-3-8B" / "snapshots" / ("ab" * 20)
    snapshot.parent.mkdir(parents=True)
    shutil.copytree(tiny_llama_folder, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    code, output = cli("convert", "meta-llama/Meta-Llama-3-8B", "--output", tmp_path / "out", "--full-layers", "1",
                       "--select", "even")
    assert code == 0, output
    assert json.loads((tmp_path / "out" / "nha_conversion.json").read_text())["source"] == "meta-llama/Meta-Llama-3-8B"
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # a model not cached, and no Hub to download it from
    code, output = cli("convert", "meta-llama/Meta-Llama-3-70B", "--output", tmp_path / "out2")
    assert code == 1 and "HF_HUB_OFFLINE is set" in output and len(output.splitlines()) == 1
    assert not (tmp_path / "out2").exists()

