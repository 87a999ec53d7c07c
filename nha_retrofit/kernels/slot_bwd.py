"""Backward of the slot half of NHA, chunked (CS tokens per chunk), fed the joint log-sum-exp L and delta.

Stream index u = query position; the slot stream holds token u - W at position u (the shift), and query u
reads the slot state after stream positions 0..u (inclusive gated-slot read). With A the cumulative (masked)
log gate of the stream, s = 1 - alpha the write weight, l the slot logits, P = exp(l - L):
    dP[u,i] = dO_u . Sv_u[i],   dl = P * (dP - delta),
    dSk_u = scale * sum_g dl[u,g] (x) q[u,g],   dSv_u = sum_g P[u,g] (x) dO[u,g],
    dq_u = scale * sum_i dl[u,i] Sk_u[i],
    dk_j = sum_i s_j[i] dK~_j[i],   dK~_j = sum_{u >= j} exp(A_u - A_j) dSk_u   (likewise dv),
    d/dA_n = <dSk_n, Sk_n> + <dSv_n, Sv_n> - s_n (<dK~_n, k_n> + <dV~_n, v_n>),
    dlog_alpha_j = sum_{n >= j} d/dA_n - alpha_j (<dK~_j, k_j> + <dV~_j, v_j>)   (real tokens only).
Inside a chunk everything is batched matrix products over [B, H, chunks]; between chunks, the chunk states
come from the forward scan kernel and the state gradients from `_rev_scan_kernel` (one sequential pass).
Intra-chunk decays are factored around the chunk's middle, so each factor spans at most half a chunk.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .chunk_fwd import CS, EXP_CLAMP, alloc, launched, scan_tile, slot_states


@triton.jit
def _rev_scan_kernel(CONT, DEC, R, NCH, M: tl.constexpr, DX: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """R[c] = sum_{c' > c} (prod_{c < c'' < c'} dec[c'']) * cont[c']: gradient w.r.t. the state after chunk c."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    NDB: tl.constexpr = (DX + BD - 1) // BD
    offs_m = (pid_t // NDB) * BM + tl.arange(0, BM)
    offs_d = (pid_t % NDB) * BD + tl.arange(0, BD)
    dmask = offs_d < DX
    tile = offs_m[:, None] * DX + offs_d[None, :]
    base = pid_bh.to(tl.int64) * NCH
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for i in range(NCH):
        c = NCH - 1 - i
        tl.store(R + (base + c) * M * DX + tile, acc, mask=dmask[None, :])
        dec = tl.load(DEC + (base + c) * M + offs_m)
        cont = tl.load(CONT + (base + c) * M * DX + tile, mask=dmask[None, :], other=0.0)
        acc = dec[:, None] * acc + cont


def reverse_scan(cont, dec):
    """cont [B, H, n, M, X], dec [B, H, n, M] -> R [B, H, n, M, X] (see the kernel)."""
    B, H, n, M, X = cont.shape
    cont, dec = cont.contiguous(), dec.contiguous()
    if not cont.is_cuda and not _interpreting():
        out, acc = torch.empty_like(cont), torch.zeros_like(cont[:, :, 0])
        for c in range(n - 1, -1, -1):
            out[:, :, c] = acc
            acc = dec[:, :, c, :, None] * acc + cont[:, :, c]
        return out
    out = alloc(*cont.shape, dtype=cont.dtype, device=cont.device)
    BM, BD = scan_tile(M, X, M)
    _rev_scan_kernel[((M // BM) * triton.cdiv(X, BD), B * H)](cont, dec, out, n, M=M, DX=X, BM=BM, BD=BD,
                                                              num_warps=4, num_stages=3)
    launched("rev_scan")
    return out


def suffix_sum(x, dim):
    """Reverse cumulative sum of x along `dim`, scanned along the innermost dimension: PyTorch scans an outer
    dimension with one thread per column, 11.5 ms for dA [1, 8, 32768, 64] on the H200."""
    return x.movedim(dim, -1).flip(-1).contiguous().cumsum(-1).flip(-1).movedim(-1, dim)


def _interpreting():
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def slot_backward(p, do, lse, delta, scale, filled0=None):
    """Gradients of the slot half: (dq, dk, dv, dlog_alpha, dslot_bias), fp32.

    Full fp32 products: with TF32 the log_alpha gradient (a reverse cumulative sum over the whole sequence)
    reached 9e-3 relative error at T=4097 against 2e-3 in fp32 (H200 run 2)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _slot_backward(p, do, lse, delta, scale, filled0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _slot_backward(p, do, lse, delta, scale, filled0=None):
    B, T, HQ, D, H, M, DV, G, W = p.B, p.T, p.HQ, p.D, p.H, p.M, p.DV, p.G, p.W
    n, C = p.nch, CS
    L = n * C
    dev = do.device
    f32 = torch.float32
    sk_all = slot_states(p.k, p.log_alpha, p.mask, W, n, p.prec)
    sv_all = slot_states(p.v, p.log_alpha, p.mask, W, n, p.prec)
    Sk, Sv = sk_all[:, :, :n], sv_all[:, :, :n]  # [B, H, n, M, X]

    def rows(x):  # [B, T, HQ, X] -> [B, H, n, C, G, X] fp32
        x = F.pad(x.to(f32), (0, 0, 0, 0, 0, L - T))
        return x.view(B, n, C, H, G, -1).permute(0, 3, 1, 2, 4, 5)

    def shifted(x):  # [B, T, H, X] -> stream [B, H, n, C, X]: position u holds token u - W (zeros elsewhere)
        out = torch.zeros(B, L, H, x.shape[-1], dtype=f32, device=dev)
        if T > W:
            out[:, W:T] = x[:, : T - W].to(f32)
        return out.view(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    Qs, dO = rows(p.q), rows(do)
    Lr = F.pad(lse, (0, 0, 0, L - T), value=float("inf")).view(B, n, C, H, G).permute(0, 3, 1, 2, 4)
    dl_ = F.pad(delta, (0, 0, 0, L - T)).view(B, n, C, H, G).permute(0, 3, 1, 2, 4)
    Ka, Va = shifted(p.k), shifted(p.v)
    real_tok = p.mask.bool()
    real_abs = torch.zeros(B, L, dtype=torch.bool, device=dev)
    if T > W:
        real_abs[:, W:T] = real_tok[:, : T - W]
    ra = real_abs.view(B, n, C)[:, None, :, :, None]  # [B, 1, n, C, 1]
    ga = shifted(p.log_alpha) * ra
    alpha = ga.exp()
    sa = (1 - alpha) * ra
    a = ga.cumsum(3)
    a_last = a[:, :, :, -1:]  # [B, H, n, 1, M]
    ar = a - a[:, :, :, C // 2 - 1 : C // 2]
    e_car = a.exp()  # [B, H, n, C, M] <= 1
    e_row = ar.exp()
    kw = sa * (-ar).clamp(max=EXP_CLAMP).exp()
    to_end = sa * (a_last - a).exp()

    u = torch.arange(L, device=dev)
    first = p.first.long()[:, None]
    fill0 = torch.zeros(B, 1, dtype=torch.bool, device=dev) if filled0 is None else filled0.bool()[:, None]
    q_real = F.pad(real_tok, (0, L - T))
    readable = q_real & (u[None] < T) & (fill0 | (u[None] - W >= first))
    readable = readable.view(B, n, C)[:, None, :, :, None, None]  # [B, 1, n, C, 1, 1]
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()[:, None, :]  # [C(u), 1(g), C(j)]

    ein = torch.einsum
    QK = ein("bhncgd,bhnjd->bhncgj", Qs, Ka) * causal
    lraw = (ein("bhncgj,bhnjm->bhncgm", QK, kw) * e_row[:, :, :, :, None]
            + ein("bhncgd,bhnmd->bhncgm", Qs, Sk) * e_car[:, :, :, :, None]) * scale
    bias = p.bias.view(H, 1, 1, G, 1)
    P = torch.where(readable, (lraw + bias - Lr[..., None]).exp(), torch.zeros((), device=dev))
    OV = ein("bhncgd,bhnjd->bhncgj", dO, Va) * causal
    dP = (ein("bhncgj,bhnjm->bhncgm", OV, kw) * e_row[:, :, :, :, None]
          + ein("bhncgd,bhnmd->bhncgm", dO, Sv) * e_car[:, :, :, :, None])
    dl = P * (dP - dl_[..., None])
    dbias = dl.sum((0, 2, 3, 5)).reshape(HQ)
    E = (dl * lraw + P * dP).sum(4)  # [B, H, n, C, M]
    wk = dl * scale
    # intra-chunk token weights: Bk[u, g, j] = sum_i wk[u,g,i] exp(A_u - A_j)[i] s_j[i]
    Bk = ein("bhncgm,bhnjm->bhncgj", wk * e_row[:, :, :, :, None], kw) * causal
    Bv = ein("bhncgm,bhnjm->bhncgj", P * e_row[:, :, :, :, None], kw) * causal
    dq = ein("bhncgm,bhnmd->bhncgd", wk * e_car[:, :, :, :, None], Sk) + ein("bhncgj,bhnjd->bhncgd", Bk, Ka)
    # gradients w.r.t. the state after each chunk (from every later read)
    dec = a_last[:, :, :, 0].exp()
    Rk = reverse_scan(ein("bhncgm,bhncgd->bhnmd", wk * e_car[:, :, :, :, None], Qs), dec)
    Rv = reverse_scan(ein("bhncgm,bhncgd->bhnmd", P * e_car[:, :, :, :, None], dO), dec)
    dk = ein("bhnjm,bhnmd->bhnjd", to_end, Rk) + ein("bhncgj,bhncgd->bhnjd", Bk, Qs)
    dv = ein("bhnjm,bhnmd->bhnjd", to_end, Rv) + ein("bhncgj,bhncgd->bhnjd", Bv, dO)
    e_neg = (-ar).clamp(max=EXP_CLAMP).exp()
    UV = ((ein("bhnjd,bhnmd->bhnjm", Ka, Rk) + ein("bhnjd,bhnmd->bhnjm", Va, Rv)) * (a_last - a).exp()
          + (ein("bhncgj,bhncgm->bhnjm", QK, wk * e_row[:, :, :, :, None])
             + ein("bhncgj,bhncgm->bhnjm", OV, P * e_row[:, :, :, :, None])) * e_neg)
    dA = (E - sa * UV).permute(0, 1, 2, 3, 4).reshape(B, H, L, M)
    dga = suffix_sum(dA, 2).reshape(B, H, n, C, M) - alpha * ra * UV

    def unshift(x):  # stream [B, H, n, C, X] -> tokens [B, T, H, X]
        x = x.permute(0, 2, 3, 1, 4).reshape(B, L, H, -1)
        out = torch.zeros(B, T, H, x.shape[-1], dtype=f32, device=dev)
        if T > W:
            out[:, : T - W] = x[:, W:T]
        return out

    dq = dq.permute(0, 2, 3, 1, 4, 5).reshape(B, L, HQ, D)[:, :T]
    dla = unshift(dga) * real_tok[:, :, None, None]
    return dq, unshift(dk), unshift(dv), dla, dbias
