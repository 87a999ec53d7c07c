"""The slot states before each chunk (`ops/nha/kernels/chunk_states.py`) against the token-by-token recurrence, on
CUDA or under the CPU interpreter (bounds-checked, buffers poisoned): the chunk update with a chained scan (short
sequences), the two walks over segments (a training forward's whole states) and the segment-local form (a forward
without a backward), from zero and from a carried state."""

import pytest
import torch

from nha_oracle import make_inputs, padding_mask
from operator_cases import DEVICE, kernel_checks, kernel_settings, rel, short_segments

pytest.importorskip("triton")

from nha_retrofit.ops.nha.kernels.chunk_inputs import Prepared  # noqa: E402
from nha_retrofit.ops.nha.kernels.chunk_states import kv_states, local_kv_states  # noqa: E402
from nha_retrofit.ops.nha.kernels.settings import HOPPER, state_segment  # noqa: E402

SHORT = short_segments(HOPPER)


def recurrence(x, log_alpha, mask, window, chunk, chunks, initial):
    """The state before each stream chunk and the final one, [B, H, chunks + 1, M, D] float64: token j is absorbed
    at stream position j + window (S = alpha_j S + (1 - alpha_j) x_j, real tokens only, none of the last `window`)."""
    B, T, H, D = x.shape
    state = initial.double().clone()
    states = [state.clone()]
    for c in range(chunks):
        for u in range(c * chunk, (c + 1) * chunk):
            j = u - window
            if 0 <= j < T - window:
                alpha = torch.exp(log_alpha[:, j].double())  # [B, H, M]
                real = mask[:, j].bool()[:, None, None, None]
                absorbed = alpha[..., None] * state + (1 - alpha)[..., None] * x[:, j].double()[:, :, None, :]
                state = torch.where(real, absorbed, state)
        states.append(state.clone())
    return torch.stack(states, 2)


@pytest.mark.parametrize("settings", [HOPPER, SHORT], ids=["chunk_update_and_scan", "segment_walks"])
@pytest.mark.parametrize("carried", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["from_zero", "carried"])
@pytest.mark.parametrize("training", [True, False], ids=["whole", "segment_local"])
def test_slot_states_match_the_recurrence(settings, carried, training):
    B, T, HQ, H, D, M, window = 2, 300, 4, 2, 64, 16, 5
    x = make_inputs(B, T, HQ, H, D, M, dtype=torch.float32, seed=7, decay=0.05)  # long memory: carries matter
    x = {n: v.to(DEVICE) if torch.is_tensor(v) else v for n, v in x.items()}
    mask = padding_mask(B, T, "left").to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    initial = [torch.randn(B, H, M, D, generator=gen).to(DEVICE) for _ in range(2)] if carried else [None, None]
    with kernel_settings(settings):
        p = Prepared(x["q"], x["k"], x["v"], x["q_rope"], x["k_rope"], x["log_alpha"], window, mask, None,
                     training=training)
        segment = state_segment(p.nch, p.settings)
        if settings is SHORT:
            assert segment is not None and segment < p.nch, "the case must walk several segments"
        else:
            assert segment is None
        with kernel_checks(torch.float32):
            if training or segment is None:
                keys, values, dec = kv_states(p, *initial)
            else:
                local_k, local_v, carry_k, carry_v, dcum = local_kv_states(p, segment, *initial)
    zero = torch.zeros(B, H, M, D, device=DEVICE)
    for name, inputs, start in (("keys", x["k"], initial[0]), ("values", x["v"], initial[1])):
        want = recurrence(inputs.cpu(), x["log_alpha"].cpu(), mask.cpu(), window, p.cs, p.nch,
                          (zero if start is None else start).cpu())
        if training or segment is None:
            got = (keys if name == "keys" else values).cpu()
        else:  # the state before chunk c is local[c] + dcum[c] * carry[c // segment]; the last carry the final one
            local, carry = (local_k, carry_k) if name == "keys" else (local_v, carry_v)
            before = local[:, :, : p.nch] + dcum[..., None] * carry[:, :, torch.arange(p.nch) // segment]
            got = torch.cat([before, carry[:, :, -1:]], 2).cpu()
        assert torch.isfinite(got).all()
        assert rel(got, want) <= 1e-5, (name, rel(got, want))
    if training or segment is None:  # the chunk decays the backward's reverse scan takes
        gates = torch.where(mask.bool()[:, :, None, None], x["log_alpha"], 0.0).cpu().double()
        stream = torch.cat([torch.zeros(B, window, H, M, dtype=torch.float64), gates[:, : T - window],
                            torch.zeros(B, p.nch * p.cs - T, H, M, dtype=torch.float64)], 1)
        want = stream.view(B, p.nch, p.cs, H, M).sum(2).exp().permute(0, 2, 1, 3)
        assert rel(dec.cpu(), want) <= 1e-5
