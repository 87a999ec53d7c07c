"""The chained chunk scans (`chunk_scan.py`) under the Triton CPU interpreter and its out-of-bounds checker, against
`naive_chunk_scan` and against the one-pass scan kernels (`slot_states`, `reverse_scan` with `scan_segment` None),
each for one state array and for two sharing their decays (the key and the value states in one launch). (The
interpreter runs one program at a time, in ticket order: the waiting between segments runs on the GPU only.)

Fresh random fp32 inputs; chunk counts 1..33 with segments of 1, 2, 3, 5 and more than all chunks (blocks padded to
a power of two); 4 of the 16 slots per program, 40 columns (padded to 64, masked); forward scans in place
from zero and from a carried state, reverse scans; the segment-local states of a forward without a backward
(`local_slot_states`, its update walk over all 16 slots per program or blocks of 8) rebuilt from their carries, and
the whole states by two such walks (`walked_slot_states`).
Every output element is NaN-poisoned first. The scans share their tickets and flags from one launch to the next, so
each must leave them at zero.

Usage: TRITON_INTERPRET=1 PYTHONPATH=. python tests/kernels/interp_chunk_scan.py   (prints OK and exits 0)
"""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from interp_bounds import bounds_checked  # noqa: E402
from interp_support import rel  # noqa: E402


def check(name, got, want, tol=1e-5):
    err = rel(got, want)
    assert torch.isfinite(got).all() and err <= tol, f"{name}: relative error {err:.2e}"
    print(f"{name}: {err:.1e}")


def main():
    from nha_retrofit.kernels import chunk_fwd, config, slot_bwd, workspace
    from nha_retrofit.kernels.chunk_scan import naive_chunk_scan, chained_chunk_scan

    chunk_fwd.POISON = True
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    BH, M, X = 3, 16, 40
    for n in (1, 4, 7, 33):
        dec = torch.rand(BH, n, M, generator=gen) * 0.9 + 0.05
        b = torch.randn(BH, n, M, X, generator=gen)
        x0 = torch.randn(BH, M, X, generator=gen)
        for segment in (1, 2, 5, 64):
            with bounds_checked():
                state = torch.cat([torch.full((BH, 1, M, X), float("nan")), b], 1)  # chunk c at row c + 1
                chained_chunk_scan(state, dec, state, segment, 4, x0=x0)
                back = torch.full_like(b, float("nan"))
                chained_chunk_scan(b, dec, back, segment, 4, reverse=True)
                start = torch.full_like(b, float("nan"))  # from zero, not in place
                chained_chunk_scan(b, dec, start, segment, 4)
            label = f"n={n} K={segment}"
            assert not workspace.counters(b.device, 1).any(), f"{label}: the scans left tickets or flags set"
            check(f"forward {label}", state[:, 1:], naive_chunk_scan(b, dec, x0))
            check(f"reverse {label}", back, naive_chunk_scan(b, dec, reverse=True))
            check(f"forward from zero {label}", start, naive_chunk_scan(b, dec))

    # the wiring in slot_states / reverse_scan against the one-pass kernels (scan_segment None), for one input and
    # for two in one launch set (each half against the single-input result)
    B, T, H, D, W = 2, 300, 2, 64, 5
    chunk = 64
    nch = -(-T // chunk)
    xs = (torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen))
    log_alpha = -torch.rand(B, T, H, M, generator=gen) * 0.03  # chunk decays ~0.4: carries matter
    mask = torch.ones(B, T, dtype=torch.int32)
    mask[1, :37] = 0
    initial = torch.randn(2, B, H, M, D, generator=gen)
    cont = torch.randn(2, B, H, nch, M, D, generator=gen)
    dec = torch.rand(B, H, nch, M, generator=gen)
    want = {}
    for segment in (None, 1, 2, 3):
        config.CONFIG["scan_segment"] = segment
        with bounds_checked():
            got, pairs = {}, {}
            for s in (0, 1):
                got["slot_states", s] = chunk_fwd.slot_states(xs[s:s + 1], log_alpha, mask, W, nch, chunk=chunk)[0]
                got["slot_states from a state", s] = chunk_fwd.slot_states(xs[s:s + 1], log_alpha, mask, W, nch,
                                                                           initial[s:s + 1], chunk=chunk)[0]
                got["reverse_scan", s] = slot_bwd.reverse_scan(cont[s], dec)
            pairs["slot_states"] = chunk_fwd.slot_states(xs, log_alpha, mask, W, nch, chunk=chunk)
            pairs["slot_states from a state"] = chunk_fwd.slot_states(xs, log_alpha, mask, W, nch, initial, chunk=chunk)
            pairs["reverse_scan"] = slot_bwd.reverse_scan(cont, dec)
        for (what, s), single in got.items():
            check(f"two at once: {what} [{s}] K={segment}", pairs[what][s], single, tol=1e-6)
        if segment is None:
            want = got
            continue
        for key in got:
            check(f"{key[0]} [{key[1]}] K={segment}", got[key], want[key])

    # the segment-local form (`local_slot_states`): local + dcum * carry gives every state, the last carry the final
    # one; segments of 1, 2 and 3 chunks and one longer than all; carries scanned in one and in several programs; the
    # update walk over all slots per program and over blocks of 8
    for state_segment, slot_block in ((1, None), (2, 8), (3, None), (8, 8)):
        config.CONFIG["segment_update_slots"] = slot_block
        for scan_segment in (1, 16):
            config.CONFIG["scan_segment"] = scan_segment
            for start, name in ((None, "slot_states"), (initial, "slot_states from a state")):
                with bounds_checked():
                    local, carries, dcum = chunk_fwd.local_slot_states(xs, log_alpha, mask, W, nch, start,
                                                                       chunk=chunk, segment=state_segment)
                full = torch.stack([want[name, 0], want[name, 1]])  # [2, B, H, nch + 1, M, D]
                rebuilt = local[:, :, :, :nch] + dcum[..., None] * carries[:, :, :, torch.arange(nch) // state_segment]
                label = f"local {name} K={state_segment}, carries K={scan_segment}, slot blocks {slot_block}"
                check(f"{label}: states", rebuilt, full[:, :, :, :nch])
                check(f"{label}: final", carries[:, :, :, -1], full[:, :, :, nch])

    # the whole states by two walks (`walked_slot_states`): every state, the final one and the chunk decays, with
    # and without the walk's one-step-ahead loads
    config.CONFIG["segment_update_slots"] = None
    config.CONFIG["scan_segment"] = 16
    decays = chunk_fwd.slot_states(xs, log_alpha, mask, W, nch, chunk=chunk, return_decay=True)[1]
    for state_segment, prefetch in ((1, False), (2, True), (3, False), (3, True), (8, True)):
        config.CONFIG["segment_prefetch"] = prefetch
        for start, name in ((None, "slot_states"), (initial, "slot_states from a state")):
            with bounds_checked():
                states, dec = chunk_fwd.walked_slot_states(xs, log_alpha, mask, W, nch, start, chunk=chunk,
                                                           segment=state_segment)
            label = f"walked {name} K={state_segment}, prefetch {prefetch}"
            check(f"{label}: states", states, torch.stack([want[name, 0], want[name, 1]]))
            check(f"{label}: decays", dec, decays)
    print("OK")


if __name__ == "__main__":
    main()
