"""The three plain-PyTorch NHA forms against a float64 brute-force oracle and against each other."""

from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F

from nha_oracle import make_inputs, nha_oracle, padding_mask
from nha_retrofit.ops import NHAState, nha_chunked, nha_recurrent_step, nha_reference
from nha_retrofit.ops.nha.gates import gate_log_alpha

OPERATOR_ARGS = ("q", "k", "v", "q_rope", "k_rope", "log_alpha")


def run_chunked(inputs, window, mask=None, **kwargs):
    out, _ = nha_chunked(**inputs, window=window, attention_mask=mask, **kwargs)
    return out


def run_recurrent(inputs, window, mask=None):
    """Token by token from an empty state."""
    state, outs = None, []
    for t in range(inputs["q"].shape[1]):
        step = {name: inputs[name][:, t : t + 1] for name in OPERATOR_ARGS}
        step_mask = None if mask is None else mask[:, t : t + 1]
        out, state = nha_recurrent_step(
            **step, window=window, scale=inputs["scale"], state=state,
            attention_mask=step_mask, slot_bias=inputs["slot_bias"],
        )
        outs.append(out)
    return torch.cat(outs, 1)


def assert_close(actual, expected, tol):
    assert torch.isfinite(actual).all()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol}"


@pytest.mark.parametrize("length", [1, 63, 65, 111])
@pytest.mark.parametrize("window", [0, 1, 3, 64, "T-1", "T", None])
def test_all_forms_match_oracle_over_windows(length, window):
    window = {"T-1": max(length - 1, 0), "T": length}.get(window, window)
    inputs = make_inputs(2, length, 4, 2, 8, 7, seed=1)
    mask = padding_mask(2, length, "left")
    expected = nha_oracle(**inputs, window=window, attention_mask=mask)
    assert_close(nha_reference(**inputs, window=window, attention_mask=mask), expected, 1e-10)
    assert_close(run_chunked(inputs, window, mask, chunk_size=16), expected, 1e-10)
    assert_close(run_recurrent(inputs, window, mask), expected, 1e-10)


@pytest.mark.parametrize("heads", [(9, 3), (4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("slots", [1, 7, 64])
@pytest.mark.parametrize("side", ["left", "right"])
def test_all_forms_match_oracle_over_gqa_slots_padding(heads, slots, side):
    inputs = make_inputs(3, 37, heads[0], heads[1], 6, slots, seed=2)
    mask = padding_mask(3, 37, side, seed=slots)
    expected = nha_oracle(**inputs, window=5, attention_mask=mask)
    assert_close(nha_reference(**inputs, window=5, attention_mask=mask), expected, 1e-10)
    assert_close(run_chunked(inputs, 5, mask, chunk_size=8), expected, 1e-10)
    assert_close(run_recurrent(inputs, 5, mask), expected, 1e-10)


def test_value_dim_may_differ_from_key_dim():
    inputs = make_inputs(2, 20, 4, 2, 8, 5, value_dim=3, seed=3)
    expected = nha_oracle(**inputs, window=4)
    assert_close(run_chunked(inputs, 4, chunk_size=8), expected, 1e-10)
    assert_close(run_recurrent(inputs, 4), expected, 1e-10)


@pytest.mark.parametrize("window", [None, 111, 500])
def test_full_window_is_causal_softmax_attention(window):
    inputs = make_inputs(2, 111, 9, 3, 16, 8, seed=4)
    mask = padding_mask(2, 111, "left")
    keys = inputs["k_rope"].repeat_interleave(3, 2).transpose(1, 2)
    values = inputs["v"].repeat_interleave(3, 2).transpose(1, 2)
    allowed = torch.ones(111, 111, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    expected = F.scaled_dot_product_attention(
        inputs["q_rope"].transpose(1, 2), keys, values, attn_mask=allowed, scale=inputs["scale"]
    ).transpose(1, 2) * mask[:, :, None, None]
    assert_close(nha_reference(**inputs, window=window, attention_mask=mask), expected, 1e-10)
    assert_close(run_chunked(inputs, window, mask), expected, 1e-10)


def test_window_zero_is_a_gated_slot_rnn():
    """w = 0: each token is absorbed before it is read; the output is a softmax read of the slots only."""
    inputs = make_inputs(1, 50, 2, 1, 8, 6, seed=5)
    bias = inputs["slot_bias"]
    slot_k = torch.zeros(6, 8, dtype=torch.float64)
    slot_v = torch.zeros(6, 8, dtype=torch.float64)
    expected = []
    for t in range(50):
        alpha = inputs["log_alpha"][0, t, 0].exp()[:, None]
        slot_k = alpha * slot_k + (1 - alpha) * inputs["k"][0, t, 0]
        slot_v = alpha * slot_v + (1 - alpha) * inputs["v"][0, t, 0]
        scores = inputs["scale"] * inputs["q"][0, t] @ slot_k.T + bias[:, None]  # [HQ, M]
        expected.append(scores.softmax(-1) @ slot_v)
    expected = torch.stack(expected)[None]
    assert_close(nha_reference(**inputs, window=0), expected, 1e-10)
    assert_close(run_chunked(inputs, 0), expected, 1e-10)


@pytest.mark.parametrize("window", [0, 3, 16, 40, None])
@pytest.mark.parametrize("split", [1, 17, 33])
def test_chunked_continues_from_carried_state(window, split):
    """Prefill a prefix, keep the state, feed the rest: identical to one pass (and to the recurrent form)."""
    inputs = make_inputs(2, 45, 4, 2, 8, 5, seed=6)
    mask = padding_mask(2, 45, "left")
    whole = run_chunked(inputs, window, mask, chunk_size=8)
    first = {n: inputs[n][:, :split] for n in OPERATOR_ARGS}
    rest = {n: inputs[n][:, split:] for n in OPERATOR_ARGS}
    common = dict(window=window, scale=inputs["scale"], slot_bias=inputs["slot_bias"], chunk_size=8)
    out1, state = nha_chunked(**first, attention_mask=mask[:, :split], output_final_state=True, **common)
    assert state.window_length == (split if window is None else min(window, split))
    out2, _ = nha_chunked(**rest, attention_mask=mask[:, split:], initial_state=state, **common)
    assert_close(torch.cat([out1, out2], 1), whole, 1e-10)
    # one recurrent step from the carried state agrees too
    step = {n: inputs[n][:, split : split + 1] for n in OPERATOR_ARGS}
    out3, _ = nha_recurrent_step(**step, window=window, scale=inputs["scale"], state=state,
                                 attention_mask=mask[:, split : split + 1], slot_bias=inputs["slot_bias"])
    assert_close(out3, whole[:, split : split + 1], 1e-10)


@pytest.mark.parametrize("window", [0, 1, 5, 16, pytest.param(64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("prompt", [1, 9, 23])
def test_decode_steps_update_the_state_in_place(window, prompt):
    """Prefill, then decode until the window ring has wrapped several times: every step writes into the same
    tensors (nothing reallocated after the first step gives the window its room), the outputs equal the oracle,
    and prefill continues from the ring (oldest entry mid-buffer) as from one pass."""
    length, extra = prompt + 3 * max(window, 1) + 4, 11
    inputs = make_inputs(3, length + extra, 9, 3, 8, 7, seed=7)
    mask = padding_mask(3, length + extra, "left", seed=prompt)
    expected = nha_oracle(**inputs, window=window, attention_mask=mask)
    common = dict(window=window, scale=inputs["scale"], slot_bias=inputs["slot_bias"])
    part = lambda a, b: {n: inputs[n][:, a:b] for n in OPERATOR_ARGS}  # noqa: E731
    _, state = nha_chunked(**part(0, prompt), attention_mask=mask[:, :prompt], output_final_state=True, **common)
    outs, pointers = [], []
    for t in range(prompt, length):
        out, state = nha_recurrent_step(**part(t, t + 1), state=state, attention_mask=mask[:, : t + 1], **common)
        outs.append(out)
        pointers.append([x.data_ptr() for x in state.tensors()])
    assert all(p == pointers[0] for p in pointers)
    assert state.window_length == window
    assert_close(torch.cat(outs, 1), expected[:, prompt:length], 1e-10)
    rest, _ = nha_chunked(**part(length, length + extra), attention_mask=mask, initial_state=state, **common)
    assert_close(rest, expected[:, length:], 1e-10)


def test_state_window_ring_reads_oldest_first():
    """`for_decoding` gives a short window its room as padding in front; `chronological` undoes a rotation; a
    window longer than the layer's is refused."""
    inputs = make_inputs(2, 6, 4, 2, 8, 5, seed=8)
    _, state = nha_chunked(**{n: inputs[n] for n in OPERATOR_ARGS}, window=8, scale=inputs["scale"],
                           output_final_state=True)
    roomy = state.for_decoding(8)
    assert roomy.window_length == 8 and not roomy.window_mask[:, :2].any()
    assert torch.equal(roomy.window_keys[:, 2:], state.window_keys)
    assert roomy.for_decoding(8) is roomy
    rotated = roomy.map(lambda x: x.roll(3, 1) if x.dim() > 1 and x.shape[1] == 8 else x)
    rotated.window_start = torch.full_like(roomy.window_start, 3)
    for name in ("window_keys", "window_values", "window_log_alpha", "window_mask"):
        assert torch.equal(getattr(rotated.chronological(), name), getattr(roomy, name))
    with pytest.raises(ValueError, match="more than the window"):
        state.for_decoding(5)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("window", [0, 5, None])
def test_prefill_state_holds_only_its_own_memory(batch, window):
    """A prefill's final state is a copy of its window, not a view of the prompt's keys, values and gates: a cached
    view would keep the whole prompt alive (in a batch of one every window slice is contiguous, so `contiguous()`
    alone does not copy it)."""
    inputs = make_inputs(batch, 111, 4, 2, 8, 5, seed=9)
    _, state = nha_chunked(**{n: inputs[n] for n in OPERATOR_ARGS}, window=window, scale=inputs["scale"],
                           output_final_state=True)
    for field in fields(state):
        tensor = getattr(state, field.name)
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), field.name


def test_batch_slices_states_concatenate_into_the_batch_state():
    """`NHAState.cat` of per-slice prefills equals the whole batch's state (how the kernels run huge batches)."""
    inputs = make_inputs(3, 30, 4, 2, 8, 5, seed=10)
    mask = padding_mask(3, 30, "left")
    common = dict(window=4, scale=inputs["scale"], slot_bias=inputs["slot_bias"], output_final_state=True)
    _, whole = nha_chunked(**{n: inputs[n] for n in OPERATOR_ARGS}, attention_mask=mask, **common)
    parts = [nha_chunked(**{n: inputs[n][rows] for n in OPERATOR_ARGS}, attention_mask=mask[rows], **common)[1]
             for rows in (slice(0, 2), slice(2, 3))]
    for joined, want in zip(NHAState.cat(parts).tensors(), whole.tensors()):
        assert joined.shape == want.shape
        assert_close(joined.double(), want.double(), 1e-12)


def test_recurrent_step_takes_gate_logits_and_normalizer():
    """The model's decode route: gate logits f and tau give the step of log(alpha) = logsigmoid(f) / tau."""
    inputs = make_inputs(2, 12, 4, 2, 8, 5, seed=11)
    logits = 4 * torch.randn(2, 12, 2, 5, dtype=torch.float64)
    common = dict(window=3, scale=inputs["scale"], slot_bias=inputs["slot_bias"])
    args = {n: inputs[n][:, :11] for n in OPERATOR_ARGS}
    _, state = nha_chunked(**dict(args, log_alpha=gate_log_alpha(logits[:, :11], 8.0)), output_final_state=True,
                           **common)
    token = {n: inputs[n][:, 11:] for n in OPERATOR_ARGS}
    fused, _ = nha_recurrent_step(**dict(token, log_alpha=logits[:, 11:]), state=state.map(torch.clone),
                                  gate_normalizer=8.0, **common)
    plain, _ = nha_recurrent_step(**dict(token, log_alpha=gate_log_alpha(logits[:, 11:], 8.0)), state=state,
                                  **common)
    assert torch.equal(fused, plain)


def test_left_padded_batch_equals_each_sequence_alone():
    inputs = make_inputs(3, 30, 4, 2, 8, 5, seed=12)
    mask = padding_mask(3, 30, "left")
    batched = run_chunked(inputs, 4, mask, chunk_size=8)
    for b in range(3):
        start = int((mask[b] == 0).sum())
        alone = {n: inputs[n][b : b + 1, start:] for n in OPERATOR_ARGS}
        single, _ = nha_chunked(**alone, window=4, scale=inputs["scale"], slot_bias=inputs["slot_bias"])
        assert_close(batched[b : b + 1, start:], single, 1e-10)
        assert (batched[b, :start] == 0).all()


def test_float32_chunked_is_close_to_float64_reference():
    inputs = make_inputs(2, 200, 9, 3, 64, 64, dtype=torch.float32, seed=13)
    expected = nha_reference(**{n: (x.double() if torch.is_tensor(x) else x) for n, x in inputs.items()}, window=64)
    out = run_chunked(inputs, 64)
    rel = ((out.double() - expected).norm() / expected.norm()).item()
    assert out.dtype == torch.float32 and rel < 1e-5


@pytest.mark.parametrize("chunk_size, length", [(1, 40), (2, 111), (4, 111), (3, 200)])
@pytest.mark.parametrize("window", [0, 3, None])
def test_chunked_over_many_chunk_groups_with_carried_state(chunk_size, length, window):
    """The slot-state scan runs over groups of 16 chunks: many groups, a ragged last group, a carried state and the
    gradients must all match the float64 reference."""
    inputs = make_inputs(2, length, 4, 2, 8, 7, seed=14)
    mask = padding_mask(2, length, "left")
    names = OPERATOR_ARGS + ("slot_bias",)
    split = length // 3
    dO = torch.randn(2, length, 4, 8, dtype=torch.float64)

    def both(fn, **kwargs):
        xs = [inputs[n].clone().requires_grad_() for n in names]
        out = fn(*xs[:6], window=window, scale=inputs["scale"], attention_mask=mask, slot_bias=xs[6], **kwargs)
        grads = torch.autograd.grad(out, xs, dO, allow_unused=True)  # window 0: the RoPE'd inputs are unused
        return [out, *(torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads))]

    def two_parts(*xs, attention_mask, **kwargs):
        first, state = nha_chunked(*[x[:, :split] for x in xs[:6]], attention_mask=attention_mask[:, :split],
                                   output_final_state=True, chunk_size=chunk_size, **kwargs)
        second, _ = nha_chunked(*[x[:, split:] for x in xs[:6]], attention_mask=attention_mask[:, split:],
                                initial_state=state, chunk_size=chunk_size, **kwargs)
        return torch.cat([first, second], 1)

    expected = both(nha_reference)
    for got, want in zip(both(two_parts), expected):
        assert_close(got, want, 1e-9)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_float32_chunked_stays_exact_under_strong_decay(chunk_size):
    """Gates that nearly reset the slots every token (log alpha ~ -6, hundreds over a chunk) must not overflow the
    chunked form's intra-chunk decays, forward or backward."""
    inputs = make_inputs(2, 150, 4, 2, 16, 16, dtype=torch.float32, decay=8.0, seed=15)
    assert (inputs["log_alpha"][0, :-64].sum(0) < -150).all()
    names = OPERATOR_ARGS + ("slot_bias",)
    dO = torch.randn(2, 150, 4, 16)
    mask = padding_mask(2, 150, "left")

    def out_and_grads(fn, dtype, **kwargs):
        xs = [inputs[n].to(dtype).requires_grad_() for n in names]
        out = fn(*xs[:6], window=3, scale=inputs["scale"], attention_mask=mask, slot_bias=xs[6], **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return [out, *torch.autograd.grad(out, xs, dO.to(dtype))]

    expected = out_and_grads(nha_reference, torch.float64)
    for name, got, want in zip(("out",) + names, out_and_grads(nha_chunked, torch.float32, chunk_size=chunk_size),
                               expected):
        assert torch.isfinite(got).all(), name
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-4, name


@pytest.mark.parametrize("window", [0, 2, 5, None])
def test_gradients_match_float64_gradcheck(window):
    inputs = make_inputs(2, 7, 4, 2, 3, 3, seed=16)
    mask = padding_mask(2, 7, "right")
    names = OPERATOR_ARGS + ("slot_bias",)
    tensors = tuple(inputs[n].clone().requires_grad_() for n in names)

    def chunked(*xs):
        return nha_chunked(*xs[:6], window=window, scale=inputs["scale"], attention_mask=mask,
                           slot_bias=xs[6], chunk_size=4)[0]

    def reference(*xs):
        return nha_reference(*xs[:6], window=window, scale=inputs["scale"], attention_mask=mask, slot_bias=xs[6])

    assert torch.autograd.gradcheck(chunked, tensors, fast_mode=True)
    assert torch.autograd.gradcheck(reference, tensors, fast_mode=True)
