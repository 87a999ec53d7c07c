"""`fast_launch` against Triton's own launch path (GPU only; skipped on CPU-only machines): the same kernels on the
same inputs give the same bits, a warm step makes no call into Triton's launch path at all, inputs whose addresses
break the 16-byte alignment Triton specializes on get a kernel of their own, and decode steps (whose ints change
every step) reuse their kernels."""

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("the Triton kernels need a CUDA device", allow_module_level=True)

from nha_oracle import make_inputs, padding_mask  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from nha_retrofit.kernels import (  # noqa: E402
    config,
    fast_launch,
    nha_attention,
    nha_chunked_triton,
    nha_recurrent_step_triton,
)

NAMES = ("q", "k", "v", "q_rope", "k_rope", "log_alpha", "slot_bias")


def inputs(offset=0):
    """bf16 leaves on the GPU (T = 300, 8/2 heads, D = 64, M = 32), each placed `offset` elements into its buffer."""
    x = make_inputs(2, 300, 8, 2, 64, 32, dtype=torch.float32)
    leaves = {}
    for name in NAMES:
        buffer = torch.empty(x[name].numel() + offset, dtype=torch.bfloat16, device="cuda")
        leaf = buffer[offset:].view(x[name].shape)
        leaf.copy_(x[name])
        leaves[name] = leaf.requires_grad_()
    return leaves, x["scale"]


def step(leaves, scale, mask, do):
    """Output and gradients of one forward + backward (window 40, left padding)."""
    tensors = [leaves[name] for name in NAMES]
    o = nha_attention(*tensors[:6], 40, scale, mask, tensors[6])
    return [o.detach(), *torch.autograd.grad(o, tensors, do)]


def triton_launches(monkeypatch):
    """A list that records every call into Triton's own launch path from here on."""
    calls = []
    run = JITFunction.run

    def counted(self, *args, **kwargs):
        calls.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    return calls


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_fast_launch_gives_triton_launch_bits_and_skips_its_path_when_warm(offset, monkeypatch):
    leaves, scale = inputs(offset)
    if offset:
        assert leaves["q"].data_ptr() % 16 != 0
        step(*inputs(0), padding_mask(2, 300, "left").cuda(), torch.randn(2, 300, 8, 64, device="cuda").bfloat16())
    mask = padding_mask(2, 300, "left").cuda()
    do = torch.randn(2, 300, 8, 64, device="cuda").bfloat16()
    monkeypatch.setitem(config.CONFIG, "fast_launch", False)
    want = step(leaves, scale, mask, do)
    monkeypatch.setitem(config.CONFIG, "fast_launch", True)
    step(leaves, scale, mask, do)  # first sight of these signatures: through Triton, kept
    calls = triton_launches(monkeypatch)
    got = step(leaves, scale, mask, do)
    assert not calls, f"launches that went through Triton's path on a warm step: {calls}"
    for name, a, b in zip(("o",) + NAMES, got, want):
        assert torch.equal(a, b), f"{name} differs from Triton's launch path (offset {offset})"
    assert fast_launch._compiled


def decode(leaves, scale, mask, steps, start, on_step=lambda step: None):
    """`steps` decode steps after a prefill of `start` tokens (window 40), each given a new mask one column longer
    (as generation's cache builds it: its stride grows): the outputs, and the final state."""
    args = [leaves[name].detach() for name in NAMES[:6]]
    with torch.no_grad():
        _, state = nha_chunked_triton(*[a[:, :start] for a in args], 40, scale, mask[:, :start], leaves["slot_bias"],
                                      output_final_state=True)
        outs = []
        for t in range(start, start + steps):
            on_step(t - start)
            o, state = nha_recurrent_step_triton(*[a[:, t : t + 1] for a in args], 40, scale, state,
                                                 mask[:, : t + 1].contiguous(), leaves["slot_bias"])
            outs.append(o)
    return outs, [x.clone() for x in state.tensors()]


def test_decode_steps_reuse_their_kernels_and_give_triton_launch_bits(monkeypatch):
    """The mask's stride (an int argument) and its last column's address change every step; their classes (not 1,
    divisible by 16 or not; the address mod 16) repeat, so after 20 steps every step finds its kernel kept."""
    leaves, scale = inputs()
    mask = padding_mask(2, 300, "left").cuda()
    monkeypatch.setitem(config.CONFIG, "fast_launch", False)
    want = decode(leaves, scale, mask, 40, 200)
    monkeypatch.setitem(config.CONFIG, "fast_launch", True)
    calls = triton_launches(monkeypatch)
    got = decode(leaves, scale, mask, 40, 200, on_step=lambda step: calls.clear() if step == 20 else None)
    assert not calls, f"decode launches through Triton's path after 20 steps: {calls}"
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        assert torch.equal(a, b), f"decode output differs from Triton's launch path at step {step}"
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b), "the decode state differs from Triton's launch path"
