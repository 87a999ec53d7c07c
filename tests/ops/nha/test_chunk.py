"""The Triton chunked NHA operator (`ops/nha/chunk.py`: training forward and backward, prefill) against float64.

On CUDA the full grid of shapes runs; without it the same tests run under Triton's CPU interpreter at small sizes,
bounds-checked, bf16 with the GPU's roundings (`operator_cases.kernel_checks`). Every case covers the shipped path
of its shape: GQA from 1 to 8 query heads per kv head, head dims 64 and 128, 16 to 128 slots, windows from 0 to
beyond the sequence, left, right and no padding, gates from weak to resetting, fp32, bf16 and fp16, and the segment
walks of long sequences (at short segments under the interpreter: `operator_cases.short_segments`).
"""

import pytest
import torch

from nha_oracle import padding_mask
from operator_cases import (DEVICE, INTERPRETED, NAMES, TOL, assert_within_tolerance, case_id, cast, kernel_checks,
                            kernel_grads, kernel_settings, operator_inputs, reference, rel, short_segments,
                            training_errors)

pytest.importorskip("triton")

from nha_retrofit.ops import nha_chunked  # noqa: E402
from nha_retrofit.ops.nha import chunk  # noqa: E402
from nha_retrofit.ops.nha.chunk import nha_attention_triton, nha_chunked_triton  # noqa: E402
from nha_retrofit.ops.nha.kernels import chunk_fwd  # noqa: E402
from nha_retrofit.ops.nha.kernels.chunk_inputs import Prepared  # noqa: E402
from nha_retrofit.ops.nha.kernels.settings import HOPPER  # noqa: E402
from nha_retrofit.ops.utils.launch import constant  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SHORT = short_segments(HOPPER)


def slow(*values):
    """A case of the slow test tier (under the interpreter the default tier keeps a few small cases that launch every
    kernel)."""
    return pytest.param(*values, marks=pytest.mark.slow)


# (T, HQ, H, D, M, window, dtype, batch, decay, inputs, padding side, settings)
if INTERPRETED:
    TRAINING_CASES = [
        slow((1, 4, 4, 64, 16, 0, FP32, 2, 1.0, "random", "left", HOPPER)),
        slow((100, 6, 2, 64, 32, 5, FP32, 2, 8.0, "random", "left", HOPPER)),  # direct blocks, 3xTF32 below 64 slots
        slow((130, 8, 1, 128, 64, 40, FP32, 1, 2.0, "random", "left", HOPPER)),  # factored and direct blocks mixed
        slow((90, 4, 1, 64, 128, 30, FP32, 1, 1.0, "random", "none", HOPPER)),  # 128 slots: the two key kernels
        slow((70, 1, 1, 128, 128, 64, FP32, 2, 1.0, "random", "left", HOPPER)),  # half-empty row blocks, 2-chunk shift
        (50, 4, 2, 64, 32, 64, FP32, 2, 1.0, "random", "left", HOPPER),  # window >= T: no slots
        slow((100, 4, 2, 64, 64, 0, FP32, 2, 1.0, "random", "right", HOPPER)),  # no window: delta by a pass
        (63, 9, 3, 64, 16, 1, BF16, 2, 1.0, "random", "left", HOPPER),
        (90, 3, 1, 64, 32, 5, BF16, 1, 8.0, "real_like", "right", HOPPER),
        slow((130, 8, 2, 128, 64, 40, BF16, 1, 2.0, "real_like", "none", HOPPER)),
        slow((90, 6, 2, 64, 64, 5, FP16, 2, 1.0, "random", "left", HOPPER)),
        slow((170, 4, 2, 64, 64, 20, FP32, 2, 2.0, "random", "left", SHORT)),  # the segment walks of long sequences
        slow((150, 8, 2, 128, 64, 5, BF16, 1, 1.0, "real_like", "right", SHORT)),
    ]
else:
    TRAINING_CASES = [
        (T, HQ, H, D, M, w, dtype, b, 1.0, "random", "left", HOPPER) for T, HQ, H, D, M, w, dtype, b in [
            (1, 4, 4, 64, 16, 0, BF16, 2), (63, 9, 3, 64, 32, 1, BF16, 2), (111, 32, 8, 128, 64, 32, BF16, 2),
            (1000, 4, 4, 128, 128, 64, BF16, 2), (1000, 9, 3, 64, 64, 65, BF16, 2),
            (4097, 32, 8, 128, 64, 512, BF16, 1), (4097, 4, 4, 64, 16, 2048, BF16, 2),
            (111, 32, 8, 64, 128, None, BF16, 2), (63, 4, 4, 128, 32, 64, FP32, 2), (1000, 9, 3, 64, 16, 0, FP32, 2),
            (111, 9, 3, 128, 64, 2048, BF16, 2), (4097, 32, 8, 128, 64, 64, BF16, 2),
            (63, 9, 3, 64, 16, 1, BF16, 2), (200, 8, 2, 64, 32, 3, BF16, 2),  # narrow slot tiles at 3-4 heads
            (111, 32, 8, 128, 64, 32, FP16, 2), (1000, 9, 3, 64, 64, 65, FP16, 2),
            # a sweep of short sequences over slots, heads per kv head (1..8), head dims and windows
            (63, 16, 2, 64, 16, 1, BF16, 1), (63, 16, 2, 64, 64, 1, BF16, 1), (300, 16, 2, 64, 64, 65, BF16, 2),
            (130, 8, 1, 64, 64, 3, BF16, 2), (130, 16, 2, 128, 64, 17, BF16, 2), (200, 7, 1, 64, 64, 5, BF16, 2),
            (200, 9, 3, 64, 64, 64, BF16, 2), (130, 12, 4, 128, 128, 17, BF16, 2), (130, 4, 4, 64, 128, 1, BF16, 2),
            (300, 2, 1, 64, 64, 0, BF16, 2), (130, 6, 2, 128, 64, 2048, BF16, 2), (400, 32, 8, 128, 64, 64, BF16, 1),
            (300, 9, 3, 64, 16, 65, BF16, 2), (130, 24, 8, 64, 16, 0, BF16, 2), (130, 12, 4, 128, 32, 17, BF16, 2),
            (9000, 8, 2, 64, 64, 64, BF16, 1),  # long enough for the segment walks (256+ chunks)
        ]
    ] + [
        (1000, 9, 3, 64, 64, 65, BF16, 2, 8.0, "random", "left", HOPPER),  # gates that reset the slots
        (4097, 32, 8, 128, 64, 64, BF16, 2, 8.0, "random", "left", HOPPER),
        (4097, 32, 8, 128, 64, 64, BF16, 2, 2.0, "random", "right", HOPPER),  # factored and direct blocks mixed
        (2048, 9, 3, 64, 64, 64, BF16, 2, 1.0, "real_like", "left", HOPPER),  # SmolLM2-135M's NHA layers
        (1000, 32, 8, 128, 64, 64, BF16, 1, 1.0, "real_like", "none", HOPPER),  # Llama-3-8B attention shapes
        (300, 9, 3, 64, 64, 64, FP32, 2, 1.0, "real_like", "left", HOPPER),
        (1000, 9, 3, 64, 32, 5, BF16, 2, 2.0, "random", "left", SHORT),  # the walks at short segments
    ]


def _training_id(c):
    return case_id(*c[:8], f"decay{c[8]:g}", c[9], c[10], "short" if c[11] is SHORT else "")


@pytest.mark.parametrize("case", TRAINING_CASES, ids=_training_id)
def test_forward_backward_matches_float64(case):
    T, HQ, H, D, M, window, dtype, batch, decay, kind, side, settings = case
    inputs = operator_inputs(T, HQ, H, D, M, dtype, batch, decay, kind == "real_like", seed=T + M)
    mask = None if side == "none" else padding_mask(batch, T, side).to(DEVICE)
    with kernel_settings(settings):
        errors = training_errors(inputs, window, mask)
    assert_within_tolerance(errors, dtype, case_id(*case[:8]))


# (T, HQ, H, D, M, window, dtype, batch), the forward without gradients: long sequences keep their states
# segment-local (the fused kernel adds each segment's carry) and return the final state
FORWARD_CASES = [(300, 9, 3, 64, 32, 5, FP32, 2), (200, 4, 4, 128, 64, 0, BF16, 1), (250, 8, 2, 64, 64, 64, BF16, 2)]
if not INTERPRETED:
    FORWARD_CASES += [(4097, 32, 8, 128, 64, 64, BF16, 2), (2500, 9, 3, 64, 32, 5, FP32, 2),
                      (3000, 4, 4, 128, 64, 0, BF16, 1), (40000, 8, 2, 128, 64, 64, BF16, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("settings", [HOPPER, SHORT], ids=["shipped", "short_segments"])
@pytest.mark.parametrize("case", FORWARD_CASES, ids=[case_id(*c) for c in FORWARD_CASES])
def test_forward_without_gradients_and_its_final_state_match_float64(case, settings):
    T, HQ, H, D, M, window, dtype, batch = case
    inputs = operator_inputs(T, HQ, H, D, M, dtype, batch, seed=T)
    mask = padding_mask(batch, T, "left").to(DEVICE)
    args = [cast(inputs, n) for n in NAMES[:6]]
    with torch.no_grad(), kernel_settings(settings), kernel_checks(dtype):
        out, state = nha_chunked_triton(*args, window, inputs["scale"], mask, inputs["slot_bias"],
                                        output_final_state=True)
    with torch.no_grad():
        ref, ref_state = nha_chunked(*[a.double() for a in args], window, inputs["scale"], mask,
                                     inputs["slot_bias"].double(), chunk_size=64, output_final_state=True)
    errors = {"o": rel(out, ref), "slot_keys": rel(state.slot_keys, ref_state.slot_keys),
              "slot_values": rel(state.slot_values, ref_state.slot_values)}
    assert max(errors.values()) <= TOL[dtype], errors


def two_part_prefill(window, decay=1.0):
    """A 300-token prefill split at 129 (160 at 69 under the interpreter; the second part from the first's state),
    and the float64 PyTorch form on the whole sequence: (output, final state, reference output, reference state)."""
    T, split, batch = (160, 69, 2) if INTERPRETED else (300, 129, 2)
    inputs = operator_inputs(T, 9, 3, 64, 32, BF16, batch, decay=decay, seed=int(decay))
    mask = padding_mask(batch, T, "left").to(DEVICE)
    args = [cast(inputs, n) for n in NAMES[:6]]
    with torch.no_grad(), kernel_checks(BF16):
        first, state = nha_chunked_triton(*[a[:, :split] for a in args], window, inputs["scale"], mask[:, :split],
                                          inputs["slot_bias"], output_final_state=True)
        second, state = nha_chunked_triton(*[a[:, split:] for a in args], window, inputs["scale"], mask,
                                           inputs["slot_bias"], initial_state=state, output_final_state=True)
    with torch.no_grad():
        ref, ref_state = nha_chunked(*[a.double() for a in args], window, inputs["scale"], mask,
                                     inputs["slot_bias"].double(), output_final_state=True)
    return torch.cat([first, second], 1), state, ref, ref_state


@pytest.mark.parametrize("window,decay", [slow(3, 1.0), slow(64, 1.0), (None, 1.0), slow(3, 8.0)]
                         + ([] if INTERPRETED else [(64, 8.0)]))
def test_prefill_in_two_parts_continues_the_carried_state(window, decay):
    out, state, ref, ref_state = two_part_prefill(window, decay)
    assert rel(out, ref) <= TOL[BF16], rel(out, ref)
    if ref_state.slot_keys.norm() > 0:
        assert rel(state.slot_keys, ref_state.slot_keys) <= TOL[BF16]
        assert rel(state.slot_values, ref_state.slot_values) <= TOL[BF16]


@pytest.mark.parametrize("window", [slow(64), None])
def test_prefill_state_holds_only_its_own_memory(window):
    """The prefill state is a copy of its window and final slots (batch of one: every slice of the prompt's tensors is
    contiguous), so a cache of it does not keep the prompt's keys, values, gates and states alive."""
    inputs = operator_inputs(300, 8, 2, 64, 32, BF16, 1, seed=3)
    with torch.no_grad():
        _, state = nha_chunked_triton(*[cast(inputs, n) for n in NAMES[:6]], window, inputs["scale"], None,
                                      inputs["slot_bias"], output_final_state=True)
    for tensor in state.tensors():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_int8_residual_gives_back_the_fp32_output(dtype):
    """A training forward on bf16/fp16 inputs stores o and its int8 rounding residual: together they are the fp32
    output, far closer to float64 than o alone (`residual.py`), which is what the backward's delta needs."""
    T, HQ, H, D, M, window = 200, 9, 3, 64, 32, 40
    inputs = operator_inputs(T, HQ, H, D, M, dtype, 2, seed=11)
    mask = padding_mask(2, T, "left").to(DEVICE)
    args = [cast(inputs, n) for n in NAMES]
    prep = Prepared(*args[:6], window, mask, args[6], training=True)
    with torch.no_grad(), kernel_checks(dtype):
        o, _, _, residual = chunk_fwd.forward(prep, inputs["scale"], True)
    shift = 8 if dtype == BF16 else 5
    full = (o.float().view(torch.int32) + (residual.to(torch.int32) << shift)).view(torch.float32)
    want, _ = reference(inputs, window, mask)
    assert residual.dtype == torch.int8 and residual.abs().max() > 0
    assert rel(full, want) <= rel(o, want) / 20, (rel(full, want), rel(o, want))


@pytest.mark.slow
def test_batch_slices_equal_one_call(monkeypatch):
    """Beyond the kernels' int32 offsets a call runs in batch slices: with the limit lowered to one sequence per
    slice, training (output, every gradient) equals one call; the slot bias's bf16 gradient is summed per slice and
    rounded to bf16 before the slices add up: two roundings of 2^-8 relative at most."""
    T, HQ, H, D, M, window, batch = 40, 8, 2, 64, 32, 20, 3
    inputs = operator_inputs(T, HQ, H, D, M, BF16, batch, seed=5)
    mask = padding_mask(batch, T, "left").to(DEVICE)
    whole = kernel_grads(inputs, window, mask)
    monkeypatch.setattr(chunk, "OFFSET_LIMIT", T * HQ * max(D, M) + 1)
    assert len(chunk.batch_slices(cast(inputs, "q"), cast(inputs, "v"), inputs["log_alpha"])) == batch
    sliced = kernel_grads(inputs, window, mask)
    for name, got, want in zip(("o",) + NAMES, (sliced[0], *sliced[1]), (whole[0], *whole[1])):
        assert rel(got, want) <= (2 * 2**-8 if name == "slot_bias" else 1e-6), (name, rel(got, want))


def test_constant_fills_share_a_buffer_and_grow():
    """`launch.constant`: views of one cached buffer per (value, dtype, device) with the value everywhere; a larger
    request grows the buffer and keeps the old one alive (a captured graph may still read it)."""
    device = torch.device(DEVICE, torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    small = constant((3, 5), 7, torch.int32, device)
    again = constant((15,), 7, torch.int32, device)
    assert small.shape == (3, 5) and bool((small == 7).all()) and small.data_ptr() == again.data_ptr()
    big = constant((2, 3 * small.untyped_storage().nbytes()), 7, torch.int32, device)
    assert big.is_contiguous() and bool((big == 7).all()) and big.data_ptr() != small.data_ptr()
    assert bool((small == 7).all())  # the outgrown buffer is still valid
    assert constant((4,), 0.0, torch.float32, device).sum().item() == 0.0


gpu_only = pytest.mark.skipif(INTERPRETED, reason="CUDA graphs, streams and device memory need a GPU")


@gpu_only
@pytest.mark.parametrize("case", ["mask_and_bias", "neither", "second_stream"])
def test_training_step_replays_from_a_cuda_graph(monkeypatch, case):
    """Forward + backward capture in one CUDA graph (no host synchronization, no data-dependent host work: the
    remedy for host-bound short sequences); a replay on new input values equals the eager step bit for bit. Without
    a mask and a slot bias the kernels read cached constant fills. With "second_stream" the window's key kernel runs
    on the second stream, which the first backward on a device makes: here inside the capture."""
    import dataclasses

    masked = case == "mask_and_bias"
    if case == "second_stream":
        overlap = dataclasses.replace(HOPPER.window_backward, overlap_tokens=1)
        monkeypatch.setattr(chunk, "_SIDE_STREAMS", {})
        settings = dataclasses.replace(HOPPER, window_backward=overlap)
    else:
        settings = HOPPER
    T, HQ, H, D, M, window = 300, 8, 2, 64, 64, 40
    first = operator_inputs(T, HQ, H, D, M, BF16, 2, seed=1)
    names = NAMES if masked else NAMES[:6]
    x = {n: cast(first, n).detach().requires_grad_(True) for n in names}  # the graph's static inputs
    do = first["dO"].clone()
    mask = padding_mask(2, T, "left").cuda() if masked else None

    def step():
        out = nha_attention_triton(*[x[n] for n in NAMES[:6]], window, first["scale"], mask, x.get("slot_bias"))
        return (out, *torch.autograd.grad(out, [x[n] for n in names], do))

    with kernel_settings(settings):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
            step()
        torch.cuda.current_stream().wait_stream(side)
        monkeypatch.setattr(chunk, "_SIDE_STREAMS", {})  # (a second stream is made anew where one is used)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        second = operator_inputs(T, HQ, H, D, M, BF16, 2, seed=2)
        with torch.no_grad():
            for n in names:
                x[n].copy_(cast(second, n))
            do.copy_(second["dO"])
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in captured]
        eager = step()
    for name, got, want in zip(("o",) + names, replayed, eager):
        assert torch.equal(got, want), f"{name}: the graph replay differs from the eager step"


@gpu_only
def test_gradient_checkpointing_frees_what_the_backward_reads():
    """Under non-reentrant activation checkpointing the operator holds nothing after the forward (every tensor its
    backward reads, the forward's slot states included, goes through save_for_backward, whose hooks the checkpoint
    owns), and the recomputing backward's gradients equal the plain ones bit for bit."""
    T, HQ, H, D, M, window = 2048, 8, 2, 64, 64, 64
    inputs = operator_inputs(T, HQ, H, D, M, BF16, 1, seed=4)
    leaves = [cast(inputs, n).detach().requires_grad_(True) for n in NAMES]

    def layer(*xs):  # the operator's inputs are made inside the region, as a layer's projections are
        q, k, v, q_rope, k_rope, log_alpha, bias = (x * 1 for x in xs)
        return nha_attention_triton(q, k, v, q_rope, k_rope, log_alpha, window, inputs["scale"], None, bias)

    plain = torch.autograd.grad(layer(*leaves), leaves, inputs["dO"])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = torch.utils.checkpoint.checkpoint(layer, *leaves, use_reentrant=False)
    held = torch.cuda.memory_allocated() - before
    out_bytes = out.numel() * out.element_size()
    assert held < 1.5 * out_bytes, f"the checkpointed forward holds {held} bytes beyond its {out_bytes}-byte output"
    for name, got, want in zip(NAMES, torch.autograd.grad(out, leaves, inputs["dO"]), plain):
        assert torch.equal(got, want), f"{name}: the checkpointed gradient differs"


@gpu_only
def test_batch_beyond_int32_offsets_runs_in_slices():
    """5 sequences of 128K tokens at the Llama-3-8B shape hold 2.7e9 elements per q-sized tensor, past the kernels'
    int32 offsets (batch index x batch stride): the call runs in batch slices (3 + 2), and the last sequence's output
    equals its own call's (unsliced, its offsets would reach 2^31)."""
    B, T, HQ, H, D, M, window = 5, 2**17, 32, 8, 128, 64, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *shape: torch.randn(*shape, device="cuda", generator=g, dtype=BF16)  # noqa: E731
    args = [r(B, T, HQ, D), r(B, T, H, D), r(B, T, H, D), r(B, T, HQ, D), r(B, T, H, D),
            torch.nn.functional.logsigmoid(r(B, T, H, M).float()) / 8]
    assert [(s.start, s.stop) for s in chunk.batch_slices(args[0], args[2], args[5])] == [(0, 3), (3, 6)]
    with torch.no_grad():
        out = nha_attention_triton(*args, window, D**-0.5)
        alone = nha_attention_triton(*[a[4:] for a in args], window, D**-0.5)
        first = nha_attention_triton(*[a[:1] for a in args], window, D**-0.5)
    assert torch.isfinite(out).all()
    assert torch.equal(out[4:], alone) and torch.equal(out[:1], first)
