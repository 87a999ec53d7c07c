"""The window-only baseline: with its slot reads off, an NHA layer is exactly sliding-window attention over its window,
in every PyTorch form of the operator (a slot bias of -inf gives the slots no softmax mass and no NaN) and in the
model, checked against sliding-window attention computed independently."""

import pytest
import torch

from nha_oracle import make_inputs, padding_mask
from nha_retrofit.ops import nha_chunked, nha_recurrent_step, nha_reference
from tiny_models import tiny_nha_pair

NO_SLOTS = float("-inf")


def sliding_window_attention(q_rope, k_rope, v, window, scale, mask):
    """Softmax attention of query t over keys t-window+1..t that are not padding (GQA: each KV head serves a group of
    query heads); a padding query outputs zeros."""
    groups = q_rope.shape[2] // k_rope.shape[2]
    keys, values = k_rope.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    logits = scale * torch.einsum("bthd,bjhd->bhtj", q_rope, keys)
    t = torch.arange(q_rope.shape[1])
    band = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    visible = band[None, None] & mask.bool()[:, None, None, :]
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhtj,bjhd->bthd", probs, values) * mask[:, :, None, None]


@pytest.mark.parametrize("window", [1, 9])
@pytest.mark.parametrize("side", ["left", "right"])
def test_every_pytorch_form_without_slot_reads_is_sliding_window_attention(window, side):
    batch, length = 3, 37
    x = make_inputs(batch, length, 6, 2, 8, 5, decay=8.0, seed=window)  # GQA 3:1, gates that fill the slots fast
    args = [x[name] for name in ("q", "k", "v", "q_rope", "k_rope", "log_alpha")]
    mask = padding_mask(batch, length, side)
    expected = sliding_window_attention(x["q_rope"], x["k_rope"], x["v"], window, x["scale"], mask)
    no_slots = torch.full_like(x["slot_bias"], NO_SLOTS)

    dense = nha_reference(*args, window, x["scale"], mask, no_slots)
    chunked, _ = nha_chunked(*args, window, x["scale"], mask, no_slots, chunk_size=8)
    split = 20  # a prefill of 20 tokens, then one token at a time on its state
    _, state = nha_chunked(*[a[:, :split] for a in args], window, x["scale"], mask[:, :split], no_slots,
                           output_final_state=True)
    steps = []
    for t in range(split, length):
        out, state = nha_recurrent_step(*[a[:, t : t + 1] for a in args], window, x["scale"], state=state,
                                        attention_mask=mask[:, : t + 1], slot_bias=no_slots)
        steps.append(out)
    decoded = torch.cat(steps, 1)
    for got in (dense, chunked):
        assert not got.isnan().any() and (got - expected).abs().max() < 1e-12
    assert not decoded.isnan().any() and (decoded - expected[:, split:]).abs().max() < 1e-12
    with_slots = nha_reference(*args, window, x["scale"], mask, x["slot_bias"])
    assert (with_slots - expected).abs().max() > 1e-2  # the slots do contribute when read


def test_model_without_slot_reads_is_the_original_under_a_sliding_window_mask():
    """The original family model (transformers' attention) given a banded causal mask is the independent reference."""
    window, length = 5, 37
    original, nha = tiny_nha_pair([window] * 4, slots=5, seed=3)
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(1))
    t = torch.arange(length)
    band = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    banded_mask = torch.zeros(length, length).masked_fill(~band, float("-inf")).expand(2, 1, length, length)
    with torch.no_grad():
        expected = original(ids, attention_mask=banded_mask).logits
        planned = nha(ids).logits
        with nha.slot_reads_disabled() as window_only:
            assert window_only is nha
            got = nha(ids).logits
        assert (got - expected).abs().max() < 1e-5
        assert (planned - expected).abs().max() > 1e-2
        assert torch.equal(nha(ids).logits, planned)  # slot reads are back on leaving


def test_window_only_decoding_continues_its_prefill():
    """One-token steps on the NHA cache give the logits of the whole sequence in one pass, slot reads off."""
    _, nha = tiny_nha_pair([None, 5, 3, 5], slots=5, seed=4)
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), nha.slot_reads_disabled():
        whole = nha(ids, use_cache=False).logits
        out = nha(ids[:, :20], use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1]]
        for t in range(20, 29):
            out = nha(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits[:, -1])
    assert (torch.stack(steps, 1) - whole[:, 19:29]).abs().max() < 1e-4
