"""The NHA operator in chunks on the Triton kernels: `nha_attention_triton` (differentiable: the autograd function
over the fused forward and the window and slot backward) and `nha_chunked_triton` (prefill, with a carried state)."""

import torch

from .kernels import chunk_fwd
from .kernels.chunk_bwd_slots import slot_backward_triton
from .kernels.chunk_bwd_window import window_delta, window_dkv, window_dq
from .kernels.chunk_inputs import Prepared
from .state import NHAState


# The kernels form element offsets as a batch index times a batch stride in int32: a call whose largest
# [B, T, heads, dim] tensor reaches this many elements runs in batch slices (its sequences are independent).
OFFSET_LIMIT = 2**31


def batch_slices(q, v, log_alpha):
    """Slices of the batch whose [b, T, HQ, max(D, Dv, M)] tensors (q, o, the slot backward's row weights) stay
    below OFFSET_LIMIT elements: one slice, the whole batch, unless B x T is very large."""
    batch, length, q_heads = q.shape[:3]
    per_sequence = max(1, length * q_heads * max(q.shape[-1], v.shape[-1], log_alpha.shape[-1]))
    step = max(1, (OFFSET_LIMIT - 1) // per_sequence)
    return [slice(start, start + step) for start in range(0, batch, step)]


def _part(x, rows):
    return None if x is None else x[rows]


def _backward_can_run(*inputs):
    """Whether a backward can follow: grad mode on and an input that requires a gradient. (Decided before the
    autograd function runs: its forward runs with gradients off, and its needs_input_grad ignores the grad mode, so
    a model's slot_bias parameter under torch.no_grad() would count there.)"""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)


_SIDE_STREAMS = {}  # CUDA device index -> the second stream the window backward's key kernel may run on


def _window_dkv_beside(p, do, lse, delta, scale):
    """`window_dkv` for a backward whose delta is already whole: from `overlap_tokens` tokens on a second CUDA stream,
    beside the slot backward that follows (shorter steps are host-bound: the fork and join cost more than they
    save). Returns (dk_rope, dv, join): join() makes the current stream wait for them (a no-op where they were formed
    on it)."""
    if not (do.is_cuda and p.B * p.T >= p.settings.window_backward.overlap_tokens):
        return (*window_dkv(p, do, lse, delta, scale), lambda: None)
    main = torch.cuda.current_stream(do.device)
    side = _SIDE_STREAMS.get(do.device.index)
    if side is None:
        side = _SIDE_STREAMS[do.device.index] = torch.cuda.Stream(do.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        dkr, dv = window_dkv(p, do, lse, delta, scale)

    def join():  # the outputs are then used, and freed, on the current stream
        main.wait_stream(side)
        dkr.record_stream(main)
        dv.record_stream(main)

    return dkr, dv, join


class _NHAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_rope, k_rope, log_alpha, slot_bias, window, scale, attention_mask, training):
        prep = Prepared(q, k, v, q_rope, k_rope, log_alpha, window, attention_mask, slot_bias, training)
        o, lse, states, residual = chunk_fwd.forward(prep, scale, prep.has_slots)
        # with slots and a window the output is exact (o and its residual: `kernels/residual.py`), so the backward's delta
        # is rowsum(dO * O), formed by the window dq kernel; else a delta pass over the window and the slot share
        exact = training and prep.has_slots and prep.W > 0
        keep = states if training and states is not None else ()
        # every tensor the backward reads goes through save_for_backward (none on ctx attributes), so gradient
        # checkpointing (its saved-tensor hooks) frees them after the forward and recomputes them
        ctx.save_for_backward(lse, o if exact else None, residual, *prep.tensors(), *keep)
        ctx.prep = prep.with_tensors((None,) * len(prep.TENSORS))
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        lse, o, residual, *saved = ctx.saved_tensors
        n = len(ctx.prep.TENSORS)
        p, scale = ctx.prep.with_tensors(saved[:n]), ctx.scale
        states = tuple(saved[n:]) or None
        do = do.contiguous()
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float32, device=do.device)  # noqa: E731
        bias_grad = ctx.needs_input_grad[6]
        if o is not None:  # delta is whole after the window dq kernel: the window's key kernel needs nothing of the
            # slot backward, which sums the two halves' dv
            delta = torch.empty(p.B, p.T, p.HQ, dtype=torch.float32, device=do.device)
            dqr = window_dq(p, do, lse, delta, scale, (o, residual))
            dkr, dv_w, join = _window_dkv_beside(p, do, lse, delta, scale)
            dq, dk, dv, dla, dbias = slot_backward_triton(p, do, lse, delta, scale, states, bias_grad, True, dv_w,
                                                          join)
        else:
            delta = window_delta(p, do, lse, scale)
            if p.has_slots:  # (and no window)
                dq, dk, dv, dla, dbias = slot_backward_triton(p, do, lse, delta, scale, states, bias_grad)
                dqr, dkr = zeros(p.B, p.T, p.HQ, p.D), zeros(p.B, p.T, p.H, p.D)
            else:  # every position sees its whole past through the window
                dq, dk, dv = zeros(p.B, p.T, p.HQ, p.D), zeros(p.B, p.T, p.H, p.D), zeros(p.B, p.T, p.H, p.DV)
                dla, dbias = zeros(p.B, p.T, p.H, p.M), zeros(p.HQ) if bias_grad else None
                dqr = window_dq(p, do, lse, delta, scale)
                dkr, dv_w = window_dkv(p, do, lse, delta, scale)
                dv = dv_w.to(p.v.dtype)
        cast = lambda g, like: g.to(like.dtype)  # noqa: E731 (a no-op for what the kernels store in the inputs' dtypes)
        return (
            cast(dq, p.q), cast(dk, p.k), cast(dv, p.v), cast(dqr, p.q_rope), cast(dkr, p.k_rope),
            cast(dla, p.log_alpha), dbias, None, None, None, None,
        )


def nha_attention_triton(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask=None, slot_bias=None):
    """Same contract as `nha_reference`; differentiable in q, k, v, q_rope, k_rope, log_alpha, slot_bias."""
    slices = batch_slices(q, v, log_alpha)
    if len(slices) > 1:  # beyond the kernels' int32 offsets (OFFSET_LIMIT): one call per batch slice
        return torch.cat([nha_attention_triton(*(x[rows] for x in (q, k, v, q_rope, k_rope, log_alpha)), window, scale,
                                        _part(attention_mask, rows), slot_bias) for rows in slices])
    training = _backward_can_run(q, k, v, q_rope, k_rope, log_alpha, slot_bias)
    return _NHAFunction.apply(q, k, v, q_rope, k_rope, log_alpha, slot_bias, window, scale, attention_mask, training)


def _stream(q, k, v, q_rope, k_rope, log_alpha, mask, state):
    """The inputs of a prefill after `state`: its window tokens (oldest first) prepended as keys without queries
    (zero queries, cut from the output); the mask [B, prefix + T] bool, ones where `mask` is None."""
    state = state.chronological()  # a decoded state keeps its window as a ring
    batch, new_len, prefix = q.shape[0], q.shape[1], state.window_length
    if mask is None:
        mask = torch.ones(batch, new_len, dtype=torch.bool, device=q.device)
    cat = lambda old, new: torch.cat([old.to(new.dtype), new], 1)  # noqa: E731
    zq = lambda x: torch.cat([x.new_zeros(batch, prefix, *x.shape[2:]), x], 1)  # noqa: E731
    return (zq(q), cat(state.window_keys, k), cat(state.window_values, v), zq(q_rope),
            cat(state.window_keys_rope, k_rope), cat(state.window_log_alpha.float(), log_alpha.float()),
            cat(state.window_mask, mask))


@torch.no_grad()
def _forward_with_state(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias,
                        initial_state, output_final_state):
    batch, new_len = q.shape[:2]
    mask = None if attention_mask is None else attention_mask[:, -new_len:].bool()
    state_dtype = gate_dtype = torch.promote_types(k.dtype, torch.float32)  # as `NHAState.empty`
    if initial_state is None:  # a first prefill: nothing to prepend and nothing carried (no device sync to learn
        # it), the mask as given (None: the kernels' maskless form)
        prefix, filled0, carried = 0, None, False
        stream = (q, k, v, q_rope, k_rope, log_alpha.float(), mask)
    else:
        prefix, filled0 = initial_state.window_length, initial_state.slots_filled
        carried = bool(filled0.any())
        stream = _stream(q, k, v, q_rope, k_rope, log_alpha, mask, initial_state)
        state_dtype, gate_dtype = initial_state.slot_keys.dtype, initial_state.window_log_alpha.dtype
    sq, sk_, sv_, sqr, skr, sla, smask = stream
    total = prefix + new_len
    win = total if window is None else window
    prep = Prepared(sq, sk_, sv_, sqr, skr, sla, win, smask, slot_bias)
    o, _, states, _ = chunk_fwd.forward(
        prep, scale, prep.has_slots or carried,
        initial_keys=initial_state.slot_keys if carried else None,
        initial_values=initial_state.slot_values if carried else None,
        filled0=None if filled0 is None else filled0.to(torch.int32),
    )
    o = o[:, prefix:]
    if not output_final_state:
        return o, None
    if states is not None:
        final_keys, final_values = states[0][:, :, -1], states[1][:, :, -1]
    elif initial_state is not None:
        final_keys, final_values = initial_state.slot_keys, initial_state.slot_values
    else:  # nothing absorbed yet
        final_keys = torch.zeros(batch, prep.H, prep.M, prep.D, dtype=state_dtype, device=q.device)
        final_values = torch.zeros(batch, prep.H, prep.M, prep.DV, dtype=state_dtype, device=q.device)
    keep = total - min(win, total)
    if smask is None:  # every token real
        absorbed_real = torch.full((batch,), keep > 0, dtype=torch.bool, device=q.device)
        window_mask = torch.ones(batch, total - keep, dtype=torch.bool, device=q.device)
    else:
        absorbed_real = smask[:, :keep].any(1)
        window_mask = smask[:, keep:]
    final = NHAState(
        slot_keys=final_keys.to(state_dtype),
        slot_values=final_values.to(state_dtype),
        slots_filled=absorbed_real if filled0 is None else filled0 | absorbed_real,
        window_keys=sk_[:, keep:],
        window_keys_rope=skr[:, keep:],
        window_values=sv_[:, keep:],
        window_log_alpha=sla[:, keep:].to(gate_dtype),
        window_mask=window_mask,
    ).compact()
    return o, final


def nha_chunked_triton(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask=None, slot_bias=None,
                       initial_state=None, output_final_state=False):
    """Same contract as `nha_chunked` (returns (o, NHAState | None)).

    Without a carried state this is `nha_attention` (differentiable); with one (prefill after a cached prefix)
    it is inference only: the state's window tokens are prepended as keys without queries.
    """
    slices = batch_slices(q, v, log_alpha)
    if len(slices) > 1:  # beyond the kernels' int32 offsets (OFFSET_LIMIT): one call per batch slice
        parts = [nha_chunked_triton(*(x[rows] for x in (q, k, v, q_rope, k_rope, log_alpha)), window, scale,
                                    _part(attention_mask, rows), slot_bias,
                                    None if initial_state is None else initial_state.map(lambda t, r=rows: t[r]),
                                    output_final_state) for rows in slices]
        return torch.cat([o for o, _ in parts]), NHAState.cat([s for _, s in parts]) if output_final_state else None
    if initial_state is None and not output_final_state:
        return nha_attention_triton(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias), None
    if initial_state is None and _backward_can_run(q, k, v, q_rope, k_rope, log_alpha, slot_bias):
        o = nha_attention_triton(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias)
        _, state = _forward_with_state(q.detach(), k.detach(), v.detach(), q_rope.detach(), k_rope.detach(),
                                       log_alpha.detach(), window, scale, attention_mask,
                                       None if slot_bias is None else slot_bias.detach(), None, True)
        return o, state
    return _forward_with_state(q, k, v, q_rope, k_rope, log_alpha, window, scale, attention_mask, slot_bias,
                               initial_state, output_final_state)
