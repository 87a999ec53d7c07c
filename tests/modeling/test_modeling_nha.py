"""The NHA model inside transformers: exactness, cache and generation, padding, window changes."""

import pytest
import torch

from nha_retrofit.modeling.nha_cache import NHACache, NHACacheLayer
from tiny_models import left_padded_ids, tiny_nha_pair


def cache_of(output):
    return getattr(output, "cache", None) or output.past_key_values


@pytest.mark.parametrize("attention_bias", [False, True])
def test_all_full_windows_reproduce_the_original(attention_bias):
    original, nha = tiny_nha_pair([None] * 4, attention_bias=attention_bias)
    ids = torch.randint(3, 128, (2, 65))
    with torch.no_grad():
        assert (original(ids).logits - nha(ids).logits).abs().max() <= 1e-5


def test_windows_at_least_the_length_equal_the_original_through_the_nha_operator():
    """An NHA layer whose window covers the whole sequence never absorbs: its slots stay empty and masked."""
    original, nha = tiny_nha_pair([70, 65, 200, None])
    ids = torch.randint(3, 128, (2, 65))
    with torch.no_grad():
        assert (original(ids).logits - nha(ids).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("windows", [[0, 0, 0, 0], [1, None, 1, 1], [5, 5, None, 5], [64, None, 64, 64], [None] * 4])
def test_prefill_then_decode_equals_one_forward(windows):
    _, nha = tiny_nha_pair(windows)
    ids = torch.randint(3, 128, (2, 90))
    with torch.no_grad():
        full = nha(ids, use_cache=False).logits
        out = nha(ids[:, :70], use_cache=True)
        pieces, cache = [out.logits], cache_of(out)
        for t in range(70, 90):
            out = nha(ids[:, t : t + 1], cache=cache, use_cache=True)
            pieces.append(out.logits)
    assert isinstance(cache, NHACache)
    assert (torch.cat(pieces, 1) - full).abs().max() <= 1e-5


def test_prefill_in_pieces_equals_one_forward():
    _, nha = tiny_nha_pair([3, None, 7, 0])
    ids = torch.randint(3, 128, (1, 60))
    with torch.no_grad():
        full = nha(ids, use_cache=False).logits
        first = nha(ids[:, :25], use_cache=True)
        second = nha(ids[:, 25:], cache=cache_of(first), use_cache=True)
    assert (torch.cat([first.logits, second.logits], 1) - full).abs().max() <= 1e-5


def test_left_padded_batch_equals_each_sequence_alone():
    _, nha = tiny_nha_pair([4, None, 2, 0])
    lengths = [30, 17, 5]
    ids, mask = left_padded_ids(lengths, 30)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        batched = nha(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        for b, n in enumerate(lengths):
            alone = nha(ids[b : b + 1, 30 - n :], use_cache=False).logits
            assert (batched[b, 30 - n :] - alone[0]).abs().max() <= 1e-5


def test_left_padded_generate_equals_each_sequence_alone():
    _, nha = tiny_nha_pair([4, None, 2, 0], slot_bias_init=0.0)
    nha.generation_config.eos_token_id = None  # always generate the full 10 tokens
    lengths = [12, 7]
    ids, mask = left_padded_ids(lengths, 12, seed=3)
    batched = nha.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    for b, n in enumerate(lengths):
        alone = nha.generate(ids[b : b + 1, 12 - n :], max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[b, 12:], alone[0, n:])


def test_sampling_with_several_sequences_per_prompt():
    _, nha = tiny_nha_pair([4, None, 2, 0])
    ids = torch.randint(3, 128, (2, 9))
    torch.manual_seed(0)
    out = nha.generate(ids, max_new_tokens=6, do_sample=True, top_k=20, num_return_sequences=3, pad_token_id=0)
    assert out.shape == (6, 15)


def test_nha_state_does_not_grow_with_the_sequence():
    _, nha = tiny_nha_pair([8, None, 8, 0])
    sizes = []
    for length in (16, 64, 256):
        with torch.no_grad():
            cache = cache_of(nha(torch.randint(3, 128, (1, length)), use_cache=True))
        sizes.append([layer.state_bytes() for layer in cache.layers if isinstance(layer, NHACacheLayer)])
    assert sizes[0] == sizes[1] == sizes[2] and all(s > 0 for s in sizes[0])


def test_set_windows_changes_behaviour_and_config(tmp_path):
    original, nha = tiny_nha_pair([4, 4, 4, 4])
    ids = torch.randint(3, 128, (1, 40))
    with torch.no_grad():
        hybrid = nha(ids).logits
        nha.set_windows([None] * 4)
        assert (nha(ids).logits - original(ids).logits).abs().max() <= 1e-5
    assert (hybrid - original(ids).logits).abs().max() > 1e-3
    with pytest.raises(ValueError, match="entries"):
        nha.set_windows([4, 4])
    with pytest.raises(ValueError, match="nha_windows\\[1\\]"):
        nha.set_windows([4, -1, 4, 4])
    assert nha.config.nha_windows == [None] * 4
    nha.set_windows([2, None, 0, 9])
    nha.save_pretrained(tmp_path)
    assert type(nha).from_pretrained(tmp_path).config.nha_windows == [2, None, 0, 9]


def test_gradients_reach_gates_and_slot_bias():
    _, nha = tiny_nha_pair([3, None, 3, 0])
    nha.train()
    ids = torch.randint(3, 128, (2, 33))
    nha(ids, labels=ids, use_cache=False).loss.backward()
    attention = nha.model.layers[0].self_attn
    assert attention.g_proj.weight.grad.abs().sum() > 0 and attention.slot_bias.grad.abs().sum() > 0
    assert nha.model.layers[1].self_attn.g_proj.weight.grad is None  # a full layer does not use its gate


def test_attention_transfer_loss_is_the_mse_to_the_full_attention_output():
    original, nha = tiny_nha_pair([3, None, 3, 3])
    ids = torch.randint(3, 128, (2, 40))
    attention = nha.model.layers[0].self_attn
    inputs = {}
    attention.register_forward_pre_hook(lambda module, args, kwargs: inputs.update(kwargs), with_kwargs=True)
    attention.attention_transfer = True
    nha.train()
    nha(ids, use_cache=False)
    loss = attention.transfer_loss
    assert loss.requires_grad and loss > 0
    with torch.no_grad():
        target, _ = original.model.layers[0].self_attn(**{k: v for k, v in inputs.items() if k != "nha_padding_mask"})
        mine, _ = attention(**inputs)
    assert torch.allclose(loss, (mine - target).pow(2).mean(), atol=1e-6)
    loss.backward()
    assert attention.g_proj.weight.grad.abs().sum() > 0
    nha.set_windows([None] * 4)
    with torch.no_grad():
        nha(ids, use_cache=False)
    # a full layer computes nothing to transfer
    assert nha.model.layers[1].self_attn.transfer_loss is None


def test_operator_gets_one_dtype_under_autocast_with_fp32_qk_norms(tmp_path, monkeypatch):
    """Training keeps norms in fp32 and autocasts the projections: Qwen3's q_norm/k_norm then give fp32 q and k
    beside a bf16 v. The operator must see one dtype (the autocast one, as SDPA does), or the Triton kernels are
    skipped for the PyTorch form."""
    from nha_retrofit.conversion.converter import build_nha_model
    from nha_retrofit.modeling import modeling_nha
    from nha_retrofit.plan import PlanSpec, build_plan
    from tiny_models import tiny_family_model

    tiny_family_model("qwen3_moe").save_pretrained(tmp_path / "source")
    model = build_nha_model(tmp_path / "source", build_plan(6, PlanSpec(select="even", full_layers=1, window=4, slots=16)))
    seen = []

    def recording(q, k, v, q_rope, k_rope, *args):
        seen.append({t.dtype for t in (q, k, v, q_rope, k_rope)})
        return operator(q, k, v, q_rope, k_rope, *args)

    operator = modeling_nha.nha_operator
    monkeypatch.setattr(modeling_nha, "nha_operator", recording)
    ids = torch.randint(3, 1000, (2, 24))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids).logits
    assert len(seen) == 5 and all(dtypes == {torch.bfloat16} for dtypes in seen)
    with torch.no_grad():  # outside autocast, fp32 throughout: the same model within bf16's error
        assert (model(ids).logits - logits.float()).abs().max() <= 0.1 * logits.float().abs().max()
