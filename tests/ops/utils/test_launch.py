"""`ops/utils/launch.py`, the kernels' fast launch path. On any machine with Triton (a stand-in kernel and compiled
kernel record the calls): which launches go through Triton's own path, and what a kept kernel's launcher receives. On a GPU:
the same kernels on the same inputs give the same bits as Triton's own path, a warm step makes no call into it at
all, inputs whose addresses break the 16-byte alignment Triton specializes on get a kernel of their own, and decode
steps (whose ints change every step) reuse their kernels."""

import pytest
import torch

pytest.importorskip("triton")

from triton.compiler.compiler import CompiledKernel  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from nha_oracle import make_inputs, padding_mask  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from nha_retrofit.ops.nha.chunk import nha_attention_triton, nha_chunked_triton  # noqa: E402
from nha_retrofit.ops.nha.fused_recurrent import nha_recurrent_step_triton  # noqa: E402
from nha_retrofit.ops.utils import launch as fast_launch  # noqa: E402
from operator_cases import NAMES  # noqa: E402


class Compiled(CompiledKernel):
    """A compiled kernel that records its launcher's calls."""

    function, packed_metadata, module = "function", "metadata", None

    def __init__(self):  # (not CompiledKernel's: nothing to load)
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class Param:
    def __init__(self, is_constexpr):
        self.is_constexpr = is_constexpr


class Kernel:
    """A JIT function stand-in: `kernel[grid](...)` records the call and returns a new compiled kernel."""

    arg_names = ["X", "n", "scale", "BLOCK"]

    def __init__(self, constexpr=("BLOCK",)):
        self.plain = []
        self.params = [Param(name in constexpr) for name in self.arg_names]

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.plain.append((grid, args, kwargs))
            return Compiled()
        return call


class SmallSharedMemory(Kernel):
    """A stand-in whose launches with more than `fits` pipelining stages overflow the shared memory (`resource`)."""

    def __init__(self, fits, resource="shared memory"):
        super().__init__()
        self.fits, self.resource, self.overflows = fits, resource, []

    def __getitem__(self, grid):
        call = super().__getitem__(grid)

        def fitting(*args, **kwargs):
            if kwargs["num_stages"] > self.fits:
                self.overflows.append(kwargs["num_stages"])
                raise OutOfResources(245760, 232448, self.resource)
            return call(*args, **kwargs)
        return fitting


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(fast_launch, "_raw_stream", lambda device: 1234)
    monkeypatch.setattr(fast_launch, "_compiled", {})
    monkeypatch.setattr(fast_launch, "_stages_that_fit", {})
    return fast_launch._compiled


def test_a_seen_signature_runs_the_kept_kernel_with_this_calls_arguments(cache):
    kernel = Kernel()
    first, second = torch.randn(64), torch.randn(64)
    fast_launch.launch(kernel, (3, 2), first, 7, 0.5, BLOCK=16, num_warps=4)
    assert len(kernel.plain) == 1 and len(cache) == 1
    fast_launch.launch(kernel, (3, 2), second, 7, 0.5, BLOCK=16, num_warps=4)
    assert len(kernel.plain) == 1
    (compiled, _), = cache.values()
    grid_and_stream, handles, hooks, params = (compiled.launches[0][:4], compiled.launches[0][4:6],
                                               compiled.launches[0][6:9], compiled.launches[0][9:])
    assert grid_and_stream == (3, 2, 1, 1234) and handles == ("function", "metadata") and hooks == (None,) * 3
    assert params[0] is second and params[1:] == (7, 0.5, 16)  # every parameter in order, the constexpr included


@pytest.mark.parametrize("change", ["int class", "constexpr", "option", "dtype", "alignment"])
def test_a_new_signature_goes_through_triton(cache, change):
    kernel = Kernel()
    x = torch.randn(65)
    base = dict(args=(x[:64], 7, 0.5), kwargs=dict(BLOCK=16, num_warps=4))
    fast_launch.launch(kernel, (1,), *base["args"], **base["kwargs"])
    args, kwargs = list(base["args"]), dict(base["kwargs"])
    if change == "int class":
        args[1] = 16  # divisible by 16, which 7 is not
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "option":
        kwargs["num_warps"] = 8
    elif change == "dtype":
        args[0] = x[:64].double()
    else:
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    fast_launch.launch(kernel, (1,), *args, **kwargs)
    assert len(kernel.plain) == 2 and len(cache) == 2


def test_triton_path_when_hooked_or_a_default_is_used(cache, monkeypatch):
    kernel = Kernel()
    x = torch.randn(64)
    for _ in range(2):
        fast_launch.launch(kernel, (1,), x, 7, 0.5)  # BLOCK left to its default: never kept
    assert len(kernel.plain) == 2 and not cache
    hook = fast_launch.triton.knobs.runtime.launch_enter_hook
    monkeypatch.setattr(hook, "calls", [print])
    for _ in range(2):
        fast_launch.launch(kernel, (1,), x, 7, 0.5, BLOCK=16)
    assert len(kernel.plain) == 4 and not cache


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "triton_path"])
def test_a_launch_over_the_shared_memory_takes_fewer_stages_once(cache, kept, monkeypatch):
    if not kept:  # a Triton without compiled-kernel objects: every launch through its own path
        monkeypatch.setattr(fast_launch, "CompiledKernel", None)
    kernel = SmallSharedMemory(fits=1)
    x = torch.randn(64)
    for _ in range(3):
        fast_launch.launch(kernel, (1,), x, 7, 0.5, BLOCK=16, num_stages=3)
    assert kernel.overflows == [3, 2]  # then remembered: no later launch tries 3 or 2 stages again
    assert [call[2]["num_stages"] for call in kernel.plain] == ([1] if kept else [1, 1, 1])
    fast_launch.launch(kernel, (1,), x, 7, 0.5, BLOCK=32, num_stages=2)  # other constexprs: tried anew
    assert kernel.overflows == [3, 2, 2] and kernel.plain[-1][2] == dict(BLOCK=32, num_stages=1)


@pytest.mark.parametrize("resource,stages", [("registers", 3), ("shared memory", 1)])
def test_other_resources_or_one_stage_still_fail(cache, resource, stages):
    kernel = SmallSharedMemory(fits=0, resource=resource)
    with pytest.raises(OutOfResources):
        fast_launch.launch(kernel, (1,), torch.randn(64), 7, 0.5, BLOCK=16, num_stages=stages)
    assert kernel.overflows == ([3] if resource == "registers" else [1])


def test_the_cache_starts_over_when_full(cache, monkeypatch):
    monkeypatch.setattr(fast_launch, "MAX_SIGNATURES", 2)
    kernel = Kernel()
    x = torch.randn(64)
    for block in (16, 32, 16, 64, 64, 16, 32):  # 64 finds the cache full: it starts over with 64 alone
        fast_launch.launch(kernel, (1,), x, 7, 0.5, BLOCK=block)
    assert [call[2]["BLOCK"] for call in kernel.plain] == [16, 32, 64, 16, 32]
    assert len(cache) == 1


def test_ints_of_one_class_and_floats_share_a_kernel_constexprs_do_not(cache):
    kernel = Kernel()
    x = torch.randn(64)
    for n, scale in ((7, 0.5), (9, 2.0), (2**20 + 3, -1.0)):  # int32, not 1, not divisible by 16; any float
        fast_launch.launch(kernel, (1,), x, n, scale, BLOCK=16)
    assert len(kernel.plain) == 1
    (compiled, _), = cache.values()
    assert [launch[10:12] for launch in compiled.launches] == [(9, 2.0), (2**20 + 3, -1.0)]
    positional = Kernel(constexpr=("n", "scale", "BLOCK"))  # constexprs passed by position: keyed by value
    for n, scale in ((7, 0.5), (9, 0.5), (9, 0.5), (9, 2.0)):
        fast_launch.launch(positional, (1,), x, n, scale, BLOCK=16)
    assert [call[1][1:3] for call in positional.plain] == [(7, 0.5), (9, 0.5), (9, 2.0)]


EDGES = [0, 1, 2, 3, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, -2**31, -2**31 - 1,
         -2**31 - 16, 2**32, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1, True, False, 0.5, 1.0, 16.0, None]


def test_the_key_is_at_least_as_fine_as_tritons_specialization(cache):
    """Two arguments with one key must get one specialization from the installed Triton (its C++ specializer, as
    `kernel[grid](...)` calls it for a runtime parameter)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    kernel = Kernel(constexpr=())
    key = lambda value: fast_launch._signature(kernel, 0, (value,), {})  # noqa: E731
    triton_key = lambda value: native_specialize_impl(BaseBackend, value, False, True, True)  # noqa: E731
    for a in EDGES:
        for b in EDGES:
            if key(a) == key(b):
                assert triton_key(a) == triton_key(b), (a, b)
    ints = [value for value in EDGES if type(value) is int]
    assert len({key(value) for value in ints}) == len({triton_key(value) for value in ints}) == 7  # and no finer


def test_host_cdiv_and_next_power_of_2_equal_tritons():
    for n in range(1, 3000):
        assert fast_launch.next_power_of_2(n) == fast_launch.triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64):
            assert fast_launch.cdiv(n, d) == fast_launch.triton.cdiv(n, d), (n, d)


gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a GPU")


def inputs(offset=0):
    """bf16 leaves on the GPU (T = 300, 8/2 heads, D = 64, M = 32), each placed `offset` elements into its buffer."""
    x = make_inputs(2, 300, 8, 2, 64, 32, dtype=torch.float32, seed=offset)
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
    o = nha_attention_triton(*tensors[:6], 40, scale, mask, tensors[6])
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


def triton_path(monkeypatch):
    """Every launch from here through Triton's own path (as on a Triton without compiled-kernel objects)."""
    monkeypatch.setattr(fast_launch, "CompiledKernel", None)


@gpu_only
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_fast_launch_gives_triton_launch_bits_and_skips_its_path_when_warm(offset, monkeypatch):
    leaves, scale = inputs(offset)
    if offset:
        assert leaves["q"].data_ptr() % 16 != 0
        step(*inputs(0), padding_mask(2, 300, "left").cuda(), torch.randn(2, 300, 8, 64, device="cuda").bfloat16())
    mask = padding_mask(2, 300, "left").cuda()
    do = torch.randn(2, 300, 8, 64, device="cuda").bfloat16()
    with monkeypatch.context() as plain:
        triton_path(plain)
        want = step(leaves, scale, mask, do)
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


@gpu_only
def test_decode_steps_reuse_their_kernels_and_give_triton_launch_bits(monkeypatch):
    """The mask's stride (an int argument) and its last column's address change every step; their classes (not 1,
    divisible by 16 or not; the address mod 16) repeat, so after 20 steps every step finds its kernel kept."""
    leaves, scale = inputs()
    mask = padding_mask(2, 300, "left").cuda()
    with monkeypatch.context() as plain:
        triton_path(plain)
        want = decode(leaves, scale, mask, 40, 200)
    calls = triton_launches(monkeypatch)
    got = decode(leaves, scale, mask, 40, 200, on_step=lambda step: calls.clear() if step == 20 else None)
    assert not calls, f"decode launches through Triton's path after 20 steps: {calls}"
    for step, (a, b) in enumerate(zip(got[0], want[0])):
        assert torch.equal(a, b), f"decode output differs from Triton's launch path at step {step}"
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b), "the decode state differs from Triton's launch path"
