"""The Triton decode step (`ops/nha/fused_recurrent.py`) against the PyTorch step and the chunked forms.

On CUDA and, without it, under Triton's CPU interpreter (bounds-checked, buffers poisoned: `operator_cases`).
"""

import copy

import pytest
import torch

from nha_oracle import make_inputs, padding_mask
from operator_cases import DEVICE, INTERPRETED, NAMES, TOL, cast, kernel_checks, operator_inputs, rel

pytest.importorskip("triton")

from nha_retrofit.ops import nha_chunked, nha_recurrent_step  # noqa: E402
from nha_retrofit.ops.nha.chunk import nha_chunked_triton  # noqa: E402
from nha_retrofit.ops.nha.fused_recurrent import nha_recurrent_step_triton  # noqa: E402
from nha_retrofit.ops.nha.gates import gate_log_alpha  # noqa: E402

OPERATOR = NAMES[:6]
TAU = 8.0
# (window, query heads, kv heads, slots, prompt, masked, gate logits): windows 0 (absorbed at once), 1, 5, 64 (one
# 64-entry block), 70 (two) and 150 (three, the last partial); half the cases give the step the gate logits f (wide:
# |f| up to ~15) and tau instead of log(alpha), and a bf16 slot bias, as the model does
STEP_CASES = [(0, 9, 3, 16, 7, True, True), (1, 4, 4, 32, 3, True, False), (5, 16, 2, 16, 9, False, True),
              (64, 9, 3, 32, 20, True, False), (70, 4, 4, 16, 2, True, True), (150, 16, 2, 16, 40, True, False)]
QUICK_WINDOWS = (0, 5)  # the cases of the default test tier; the others are in the slow tier


def rotated(state, start):
    """The same decoding state with its window ring turned so that it starts at entry `start` (the ring's order is
    the state's business: `chronological()` gives the same window)."""
    ring = state.window_length
    turned = state.map(lambda x: x.roll(start, 1) if x.dim() > 1 and x.shape[1] == ring else x)
    turned.window_start = torch.full_like(state.window_start, start)
    for name in ("window_keys", "window_values", "window_log_alpha", "window_mask"):
        assert torch.equal(getattr(turned.chronological(), name), getattr(state.chronological(), name))
    return turned


@pytest.mark.parametrize("case", [c if c[0] in QUICK_WINDOWS else pytest.param(c, marks=pytest.mark.slow)
                                  for c in STEP_CASES], ids=lambda c: "w{}_g{}-{}_M{}_prompt{}_{}_{}".format(
    *c[:5], "masked" if c[5] else "nomask", "logits" if c[6] else "log_alpha"))
def test_decode_steps_match_the_pytorch_step_in_place(case):
    """Token by token until the window ring has wrapped, from a prefilled state: every output, the slots, the window
    entries (oldest first), the ring start and the filled flags equal the PyTorch step's; the state tensors stay the
    same ones from the first step on."""
    window, q_heads, kv_heads, slots, prompt, masked, gate = case
    # past a full turn of the ring; under the interpreter a few steps across the ring's end from a rotated state
    steps = 6 if INTERPRETED else max(window, 1) + 23
    x = make_inputs(3, prompt + steps, q_heads, kv_heads, 64, slots, dtype=torch.float32, seed=window)
    x = {n: v.to(DEVICE) if torch.is_tensor(v) else v for n, v in x.items()}
    mask = padding_mask(3, prompt + steps, "left", seed=window).to(DEVICE) if masked else None
    common = dict(window=window, scale=x["scale"], slot_bias=x["slot_bias"])
    gate_logits = 5 * torch.randn(x["log_alpha"].shape, generator=torch.Generator().manual_seed(window)).to(DEVICE)
    if gate:  # the steps take the logits and tau; the prefill the gate's log(alpha) of the same logits
        x["log_alpha"] = gate_log_alpha(gate_logits, TAU)
        common["slot_bias"] = common["slot_bias"].bfloat16()
    _, state = nha_chunked(*[x[n][:, :prompt] for n in OPERATOR], attention_mask=None if mask is None
                           else mask[:, :prompt], output_final_state=True, **common)
    if INTERPRETED and window > 2:
        state = rotated(state.for_decoding(window), window - 2)
    mine, ref = copy.deepcopy(state), copy.deepcopy(state)
    worst, pointers = 0.0, None
    for t in range(prompt, prompt + steps):
        token = [x[n][:, t : t + 1] for n in OPERATOR]
        step_mask = None if mask is None else mask[:, : t + 1]
        if gate:
            token[-1] = gate_logits[:, t : t + 1]
        step = dict(common, attention_mask=step_mask, gate_normalizer=TAU if gate else None)
        with kernel_checks(torch.float32):
            got, mine = nha_recurrent_step_triton(*token, state=mine, **step)
        want, ref = nha_recurrent_step(*[x[n][:, t : t + 1] for n in OPERATOR], state=ref,
                                       **dict(step, gate_normalizer=None))
        ordered, ref_ordered = mine.chronological(), ref.chronological()
        errors = [rel(got, want), rel(mine.slot_keys, ref.slot_keys), rel(mine.slot_values, ref.slot_values)]
        errors += [rel(getattr(ordered, n), getattr(ref_ordered, n))
                   for n in ("window_keys", "window_keys_rope", "window_values", "window_log_alpha")
                   if getattr(ref, n).numel()]
        assert torch.equal(ordered.window_mask, ref_ordered.window_mask), t
        assert torch.equal(mine.window_start, ref.window_start), t
        assert torch.equal(mine.slots_filled, ref.slots_filled), t
        worst = max(worst, *errors)
        pointers = pointers or [p.data_ptr() for p in mine.tensors()]
        assert pointers == [p.data_ptr() for p in mine.tensors()], "the state was reallocated"
    assert worst <= 1e-5, worst


# (window, slots, heads, dtype) of a prefill through the chunk kernel, then decode steps against the whole sequence
PREFILL_DECODE_CASES = [(64, 64, (16, 4), torch.bfloat16), (5, 16, (9, 3), torch.float32),
                        (0, 32, (4, 4), torch.bfloat16), (130, 64, (8, 2), torch.bfloat16)]
if not INTERPRETED:
    PREFILL_DECODE_CASES += [(64, 64, (32, 8), torch.bfloat16), (64, 64, (9, 3), torch.float16),
                             (64, 16, (9, 3), torch.bfloat16), (3, 32, (16, 2), torch.bfloat16),
                             (2048, 32, (9, 3), torch.float32)]


@pytest.mark.slow
@pytest.mark.parametrize("window,slots,heads,dtype", PREFILL_DECODE_CASES,
                         ids=lambda c: str(c) if not isinstance(c, tuple) else f"{c[0]}-{c[1]}")
def test_prefill_then_decode_steps_match_the_chunked_forms(window, slots, heads, dtype):
    HQ, H = heads
    prompt, steps, batch, D = (77, 200, 2, 64) if not INTERPRETED else (41, 12, 2, 64)
    T = prompt + steps
    inputs = operator_inputs(T, HQ, H, D, slots, dtype, batch, seed=slots)
    mask = padding_mask(batch, T, "left").to(DEVICE)
    args = [cast(inputs, n) for n in OPERATOR]
    bias = inputs["slot_bias"]
    with torch.no_grad(), kernel_checks(dtype):
        full, _ = nha_chunked_triton(*args, window, inputs["scale"], mask, bias)
        _, state = nha_chunked_triton(*[a[:, :prompt] for a in args], window, inputs["scale"], mask[:, :prompt], bias,
                                      output_final_state=True)
        outs, pointers = [], set()
        for t in range(prompt, T):
            o, state = nha_recurrent_step_triton(*[a[:, t : t + 1] for a in args], window, inputs["scale"], state,
                                                 mask[:, : t + 1], bias)
            outs.append(o)
            pointers.add(tuple(x.data_ptr() for x in state.tensors()))
    decoded = torch.cat(outs, 1)
    with torch.no_grad():
        ref, ref_state = nha_chunked(*[a.double() for a in args], window, inputs["scale"], mask, bias.double(),
                                     output_final_state=True)
    tol = TOL[dtype]
    assert torch.isfinite(decoded).all()
    assert rel(decoded, full[:, prompt:]) <= tol, rel(decoded, full[:, prompt:])
    assert rel(decoded, ref[:, prompt:]) <= tol
    assert rel(full, ref) <= tol
    if ref_state.slot_keys.norm() > 0:
        assert rel(state.slot_keys, ref_state.slot_keys) <= tol
        assert rel(state.slot_values, ref_state.slot_values) <= tol
    assert torch.equal(state.slots_filled, ref_state.slots_filled)
    # the ring holds the whole window (padding in front while the sequence is shorter), oldest first here
    kept = ref_state.window_length
    assert state.window_length == window
    ordered = state.chronological()
    newest = lambda x: x[:, x.shape[1] - kept :]  # noqa: E731
    assert not ordered.window_mask[:, : state.window_length - kept].any()
    assert torch.equal(newest(ordered.window_mask), ref_state.window_mask)
    if window:  # the window's tokens are copies of the inputs: exact
        assert torch.equal(newest(ordered.window_keys_rope).double(), ref_state.window_keys_rope)
        assert torch.equal(newest(ordered.window_log_alpha).double(), ref_state.window_log_alpha)
    assert len(pointers) == 1  # in place: the same tensors from the first step on


@pytest.mark.skipif(INTERPRETED, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("window", [64, 130])  # one window block; three, merged through the completion counters
def test_decode_steps_replay_from_a_cuda_graph(window):
    """28 layers' decode steps capture in one CUDA graph (the state is updated in place, nothing is allocated but the
    outputs and partials); 100 replays on new tokens equal 100 eager steps from the same state."""
    layers, steps, HQ, H, D, M, dtype = 28, 100, 32, 8, 128, 64, torch.bfloat16
    prompt = 150
    inputs = operator_inputs(prompt + steps, HQ, H, D, M, dtype, 1, seed=window)
    args = [cast(inputs, n) for n in OPERATOR]
    mask = torch.ones(1, prompt + steps, dtype=torch.long, device="cuda")
    with torch.no_grad():
        _, prefilled = nha_chunked_triton(*[a[:, :prompt] for a in args], window, inputs["scale"], mask[:, :prompt],
                                          inputs["slot_bias"], output_final_state=True)
        prefilled = prefilled.for_decoding(window)
    copies = lambda: [prefilled.map(torch.clone) for _ in range(layers)]  # noqa: E731
    token = [a[:, prompt : prompt + 1].clone() for a in args]  # the graph's static input

    def step(states):
        return [nha_recurrent_step_triton(*token, window, inputs["scale"], st, mask[:, : prompt + 1],
                                          inputs["slot_bias"])[0] for st in states]

    with torch.no_grad():
        graphed, eager = copies(), copies()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile outside the capture, on throwaway states
            step(copies())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(graphed)
        for t in range(prompt, prompt + steps):
            for static, a in zip(token, args):
                static.copy_(a[:, t : t + 1])
            graph.replay()
            replayed = torch.stack(captured).clone()
            want = step(eager)
            assert torch.equal(replayed, torch.stack(want)), f"step {t}: the replay differs from the eager step"
    for mine, ref in zip(graphed, eager):
        assert all(torch.equal(a, b) for a, b in zip(mine.tensors(), ref.tensors()))
