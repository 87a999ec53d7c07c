"""`ops/nha/dispatch.py`, the one place that picks the Triton kernels or the PyTorch forms."""

import pytest
import torch

from nha_oracle import make_inputs, padding_mask
from operator_cases import NAMES, rel

from nha_retrofit.ops import nha_attention, nha_chunked
from nha_retrofit.ops.nha import dispatch


@pytest.mark.parametrize("value, scope", [(None, "all"), ("", "all"), ("decode", "decode"), ("all", "all"),
                                          ("1", "all"), ("0", "0"), ("none", "0"), (" ALL ", "all")])
def test_kernel_scope_from_the_environment(monkeypatch, value, scope):
    if value is None:
        monkeypatch.delenv("NHA_RETROFIT_KERNELS", raising=False)
    else:
        monkeypatch.setenv("NHA_RETROFIT_KERNELS", value)
    assert dispatch.kernel_scope() == scope


def test_unknown_kernel_scope_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("NHA_RETROFIT_KERNELS", "fast")
    with pytest.raises(ValueError, match="NHA_RETROFIT_KERNELS='fast': expected decode, all or 0"):
        dispatch.kernel_scope()


def shaped(D=64, DV=None, M=32, heads=(8, 2), dtype=torch.bfloat16, v_dtype=None):
    HQ, H = heads
    return (torch.empty(1, 3, HQ, D, dtype=dtype), torch.empty(1, 3, H, D, dtype=dtype),
            torch.empty(1, 3, H, DV or D, dtype=v_dtype or dtype), torch.empty(1, 3, H, M))


@pytest.mark.parametrize("kwargs,supported", [
    (dict(), True), (dict(D=128, M=128), True), (dict(M=16, heads=(9, 3), dtype=torch.float32), True),
    (dict(dtype=torch.float16, heads=(4, 4)), True),
    (dict(D=32), False), (dict(D=256), False), (dict(D=64, DV=128), False), (dict(M=8), False), (dict(M=48), False),
    (dict(M=256), False), (dict(heads=(6, 4)), False), (dict(dtype=torch.float64), False),
    (dict(v_dtype=torch.float32), False),
])
def test_the_kernels_take_the_shapes_their_tests_cover(kwargs, supported):
    assert dispatch.shapes_supported(*shaped(**kwargs)) is supported


@pytest.mark.parametrize("rope_dtypes,supported", [
    ((torch.bfloat16, torch.bfloat16), True), ((torch.float32, torch.bfloat16), False),
    ((torch.bfloat16, torch.float32), False),
])
def test_rotated_queries_and_keys_share_the_dtype_of_q(rope_dtypes, supported):
    """Mixed dtypes (fp32 rotations of bf16 projections, as autocast leaves them) are not what the kernels' tests
    cover: they take the PyTorch forms."""
    q, k, v, log_alpha = shaped()
    q_rope, k_rope = (torch.empty(t.shape, dtype=dtype) for t, dtype in zip((q, k), rope_dtypes))
    assert dispatch.shapes_supported(q, k, v, log_alpha, q_rope, k_rope) is supported


def test_off_cuda_every_call_takes_the_pytorch_forms():
    """CPU tensors: `nha_attention` is the chunked PyTorch form, differentiable."""
    x = make_inputs(2, 40, 8, 2, 64, 32, dtype=torch.float32, seed=2)
    mask = padding_mask(2, 40, "left")
    args = [x[n].requires_grad_() for n in NAMES]
    out = nha_attention(*args[:6], 5, x["scale"], mask, args[6])
    want, _ = nha_chunked(*args[:6], 5, x["scale"], mask, args[6])
    assert torch.equal(out, want)
    out.sum().backward()
    assert all(a.grad is not None for a in args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels run on CUDA")
def test_model_prefill_and_decode_through_the_kernels_match_pytorch(monkeypatch):
    """A small NHA Llama (fp32, head dim 64, windows 5 / full / 64 / 0) on CUDA, left-padded batch: prefill, then 100
    decode steps with the NHA cache through the Triton kernels (prefill and the in-place decode step) give the logits
    of the plain-PyTorch path on the same weights."""
    from tiny_models import left_padded_ids, tiny_nha_pair

    _, model = tiny_nha_pair([5, None, 64, 0], slots=16, hidden_size=384, num_attention_heads=6,
                             num_key_value_heads=2, intermediate_size=256)
    model = model.cuda()
    prompt, steps = 70, 100
    prompt_ids, prompt_mask = left_padded_ids([prompt, 41, 9], prompt)
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat([prompt_ids, torch.randint(3, 128, (3, steps), generator=gen)], 1).cuda()
    mask = torch.cat([prompt_mask, torch.ones(3, steps, dtype=torch.long)], 1).cuda()
    calls = []
    for name in ("nha_chunked_triton", "nha_decode_step"):
        original = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _f=original, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])

    def run(scope):
        monkeypatch.setenv("NHA_RETROFIT_KERNELS", scope)
        with torch.no_grad():
            out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], use_cache=True)
            logits, cache = [out.logits], getattr(out, "cache", None) or out.past_key_values
            for t in range(prompt, prompt + steps):
                out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True)
                logits.append(out.logits)
        return torch.cat(logits, 1)

    kernels = run("all")
    assert {"nha_chunked_triton", "nha_decode_step"} <= set(calls), "the kernels did not run"
    calls.clear()
    pytorch = run("0")
    assert not calls
    real = mask.bool()
    assert torch.isfinite(kernels).all()
    assert rel(kernels[real], pytorch[real]) <= 1e-4, rel(kernels[real], pytorch[real])
