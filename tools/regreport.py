"""Registers, spills and shared memory of every NHA kernel and of the float8 cache read, for sm_90a, without a GPU
(developer tool).

Compiles each kernel with Triton for a Hopper target, as the wrappers launch it (the shipped settings,
`ops/nha/kernels/settings.py`), and runs the ptxas bundled in Triton's wheel with -v; shared memory is Triton's own figure
(the H200 allows ~227 KB per block). (Triton 3.9 emits PTX 9.4 that the bundled ptxas 12.8 refuses; the .version
line is lowered.) With --sass also each kernel's static instruction mix (nvdisasm, bundled too): its matrix products
(HMMA, HGMMA) against the shared-memory traffic of Triton's layout conversions (STS, LDS, LDSM, BAR) and the spills
(LDL, STL), and how its products run (`asm_stats.product_kinds`). In the one-program-per-multiprocessor kernels more
spill bytes or instructions have usually meant a slower kernel, but not always: only a timing decides.

Every pointer and integer argument counts as divisible by 16, as at T = 32768, where Triton pipelines more loads
through shared memory. The figures depend on the Triton version: run it under the GPU machine's, e.g. in a venv with
`pip install torch==2.13.0 triton==3.6.0 transformers numpy`; under Triton 3.9 the merged key kernel reports more
spills and less shared memory than under 3.6. A kernel that fails to compile is reported as such (and the exit
status is 1).

    python tools/regreport.py [--quick] [--slot-bwd] [--sass] [--masked] [--match TEXT]
"""

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from asm_stats import instruction_mix, product_kinds  # noqa: E402

from nha_retrofit.ops.nha import fused_recurrent  # noqa: E402
from nha_retrofit.ops.nha.kernels import (chunk_bwd_slots, chunk_bwd_window, chunk_fwd, chunk_scan,  # noqa: E402
                                          chunk_states)
from nha_retrofit.ops.nha.kernels.settings import HOPPER, chunk_tokens, forward_block  # noqa: E402
from nha_retrofit.ops.stored_attention import split_kv  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
NVDISASM = os.path.join(os.path.dirname(PTXAS), "nvdisasm")
BF, F32, I32, I8 = "*bf16", "*fp32", "*i32", "*i8"
POINTERS = dict(Q=BF, K=BF, V=BF, QR=BF, KR=BF, DO=BF, Y=BF, X=BF, X2=BF, G=BF, O=BF, WK=F32, WV=F32,
                WKR=BF, WLA=F32, MASK=I32, FIRST=I32, FILLED0=I32, WMASK=I8, FILLED=I8, BIAS=F32, SK=F32, SV=F32,
                NSK=F32, NSV=F32,
                LSE=F32, DELTA=F32, DQ=BF, DB=F32, E=F32, WST=F32, R=F32, OUT=F32, CK=F32, CV=F32,
                RK=F32, RV=F32, DA=F32, XA=F32, DQR=BF, DKR=BF, DV_=F32, U=F32, DEC=F32, S=F32, S0=F32,
                CONT=F32, DBR=F32, C_OUT=F32, DK=BF, BIN=F32, X0=F32, CARRY=F32, FLAGS=I32, UVB=F32, Y2=BF, WST2=F32,
                TOT=F32, LOGITS=F32, LOCAL=F32, DCUM=F32, START=F32, ENDS=F32, DSEG=F32, DVW=F32, BCUM=F32)

# the decode state's window tensors (the model's dtype), its gates and ring start, the new token's gate logits and
# the slot bias (the model's dtype), the attention mask's column, the softmax partials and the completion counters
DECODE_POINTERS = dict(WK=BF, WV=BF, WLA=F32, LA=BF, BIAS=BF, WSTART="*i64", TOKEN_MASK="*i64", PART_ACC=F32,
                       PART_ML=F32, COUNT=I32)

# the float8 static cache's read: its keys and values, their scales, the real-token flags
STORED_POINTERS = dict(K="*fp8e4nv", V="*fp8e4nv", KS=F32, VS=F32, REAL="*u8", PART_ACC=F32, PART_ML=F32)


def report(jitfn, consts, num_warps, num_stages=2, pointers=None, sass=False):
    """'regs R, spill S B, smem K KB' of one compiled kernel (or 'compile failed: ...'); sass: with its static
    instruction counts (`asm_stats.MIX`, and all instructions) and its products' kinds."""
    ptrs = dict(POINTERS, ORES=I8, **(pointers or {}))  # o's int8 rounding residual
    floats = ("scale", "inv_tau")
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32") for n in jitfn.arg_names}
    # as a launch at T = 32768 specializes them: every pointer and integer divisible by 16 (without it Triton does
    # not pipeline the loads into shared memory: the merged key kernel at 64-token chunks reported 104 KB where the
    # H200 launch needed 240)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jitfn.arg_names)
               if sig[n] not in ("constexpr", "fp32")}
    try:
        kernel = triton.compile(ASTSource(fn=jitfn, signature=sig, constexprs=dict(consts), attrs=aligned),
                                target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as exc:  # noqa: BLE001 - report, do not stop
        return "compile failed: " + str(exc).strip().splitlines()[-1][:200]
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "kernel.ptx"), os.path.join(folder, "kernel.cubin")
        with open(ptx, "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 8.7", kernel.asm["ptx"]))
        out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True)
        regs = re.search(r"Used (\d+) registers", out.stderr)
        spill = re.search(r"(\d+) bytes spill stores", out.stderr)
        if regs is None:
            return "ptxas: " + out.stderr.strip()[-200:]
        text = (f"regs {regs.group(1):>3}, spill {int(spill.group(1)) if spill else 0:>5} B, "
                f"smem {kernel.metadata.shared / 1024:5.0f} KB")
        if "C7511" in out.stderr:  # ptxas waits for each wgmma before the next: its accumulators lack registers
            text += ", wgmma serialized"
        if sass:
            text += "; " + instruction_mix(subprocess.run([NVDISASM, "-c", cubin], capture_output=True,
                                                          text=True).stdout)
            text += "; products: " + product_kinds(kernel.asm["ttgir"])
    return text


def cases(HQ, H, D, M):
    """(name, jit function, constexprs, num_warps, num_stages) of every kernel as the wrappers launch it on bf16
    inputs; a None constexpr is an argument the launch passes as None (an absent optional tensor)."""
    s = HOPPER
    G = HQ // H
    pow2 = triton.next_power_of_2
    out = []
    for training in (False, True):
        cs = chunk_tokens(G, training, s)
        tag = "training" if training else "inference"
        update = dict(H=H, M=M, DX=D, CSZ=cs, BD=chunk_states._update_columns_per_program(s, M, D), PREC="bf16x3")
        walk = dict(update, K=s.forward.segment_longest)
        out += [(f"chunk update ({tag} chunk {cs})", chunk_states._chunk_update_kernel, dict(update, ZERO_FIRST=True),
                 4, 2)]
        if training:
            out += [("segment walk: ends", chunk_states._segment_update_kernel,
                     dict(walk, LOCAL=None, DCUM=None, DEC=None, START=None, ZERO_FIRST=True), 4, 2),
                    ("segment walk: whole states", chunk_states._segment_update_kernel,
                     dict(walk, DCUM=None, ENDS=None, DSEG=None, ZERO_FIRST=False), 4, 2)]
        else:
            out += [("segment walk: local states", chunk_states._segment_update_kernel,
                     dict(walk, DEC=None, START=None, ZERO_FIRST=True), 4, 2)]
        cq = forward_block(G, cs, s)
        br = max(16, pow2(cq * G))
        warps = 4 if br * D < 32 * 128 else s.forward.warps
        fwd = dict(HQ=HQ, H=H, GQ=G, D=D, DV=D, M=M, MT=max(M, chunk_fwd.MIN_SLOT_TILE), CQB=cq, CSZ=cs, BR=br,
                   BN=64 if br <= 64 else 32, HAS_WINDOW=True, HAS_SLOTS=True, PREC="tf32", SPREC="bf16x3",
                   BDS=min(64, D))
        if training:
            out += [(f"fwd training, block {cq}", chunk_fwd._fwd_kernel,
                     dict(fwd, RPREC="bf16x3", CK=None, CV=None, DCUM=None, KSEG=1,
                          PREFETCH=s.forward.train_prefetch), warps, s.forward.stages),
                    ("fwd training, no window", chunk_fwd._fwd_kernel,
                     dict(fwd, HAS_WINDOW=False, ORES=None, RPREC="bf16x3", CK=None, CV=None, DCUM=None, KSEG=1,
                          PREFETCH=s.forward.train_prefetch), warps, s.forward.stages),
                    ("fwd training, window only", chunk_fwd._fwd_kernel,
                     dict(fwd, HAS_SLOTS=False, ORES=None, LOGITS=None, RPREC="bf16x3", CK=None, CV=None, DCUM=None,
                          KSEG=1, PREFETCH=s.forward.train_prefetch), warps, s.forward.stages)]
        else:
            inference = dict(fwd, RPREC="bf16", LSE=None, LOGITS=None, ORES=None)
            out += [(f"fwd inference, block {cq}, segment-local", chunk_fwd._fwd_kernel,
                     dict(inference, KSEG=s.forward.segment_longest, PREFETCH=s.forward.inference_prefetch), warps,
                     s.forward.stages),
                    (f"fwd inference, block {cq}, states whole", chunk_fwd._fwd_kernel,
                     dict(inference, CK=None, CV=None, DCUM=None, KSEG=1, PREFETCH=0), warps, s.forward.stages)]
    segment = s.forward.scan_segment
    slots = chunk_states.scan_slots(s, M, D, segment)
    scan = dict(M=M, DX=D, DXP=pow2(D), BM=slots, K=segment, KB=pow2(segment))
    warps = chunk_scan.scan_warps(slots, D)
    out += [("chained scan", chunk_scan._chained_scan_kernel, dict(scan, REVERSE=False, HAS_X0=True), warps, 2),
            ("chained reverse scan", chunk_scan._chained_scan_kernel, dict(scan, REVERSE=True, HAS_X0=False), warps, 2)]
    window = s.window_backward
    br = max(16, pow2(window.block_tokens * G))
    wwarps = 4 if br <= 64 else 8
    wconsts = dict(HQ=HQ, H=H, GQ=G, D=D, DV=D, CQB=window.block_tokens, BR=br, PREC="tf32")
    out += [("window dq, delta from o", chunk_bwd_window._dq_kernel,
             dict(wconsts, BN=window.dq_keys_short, DELTA_ONLY=False), wwarps, window.stages),
            ("window dq, delta given", chunk_bwd_window._dq_kernel,
             dict(wconsts, BN=window.dq_keys_short, DELTA_ONLY=False, O=None, ORES=None), wwarps, window.stages),
            ("window delta", chunk_bwd_window._dq_kernel,
             dict(wconsts, BN=window.dq_keys_short, DELTA_ONLY=True, O=None, ORES=None), wwarps, window.stages),
            ("window dkv", chunk_bwd_window._dkv_kernel, dict(wconsts, BN=window.dkv_keys_short), wwarps,
             window.stages)]
    dec = dict(HQ=HQ, H=H, GQ=G, D=D, DV=D, M=M, BR=max(16, pow2(G)), BN=s.decode.window_block, HAS_MASK=True,
               HAS_BIAS=True, GATE=True, RING=True, PREC="tf32")
    out += [("decode, one block", fused_recurrent._decode_kernel, dict(dec, SINGLE=True), s.decode.warps, 2),
            ("decode, merged blocks", fused_recurrent._decode_kernel, dict(dec, SINGLE=False), s.decode.warps, 2)]
    rows = split_kv.query_rows(G)
    out += [("stored read, float8 partials", split_kv._partials_kernel,
             dict(H=H, G=G, BG=rows, D=D, DV=D, BN=split_kv.BLOCK_N, SCALED=True, PREC="tf32"), 4, 2),
            ("stored read, combine", split_kv._combine_kernel, dict(H=H, G=G, BG=rows, DV=D), 4, 1)]
    return out + slot_bwd_cases(HQ, H, D, M)


def slot_bwd_cases(HQ, H, D, M):
    """The slot backward's kernels as `slot_backward_triton` launches them (at the training chunk)."""
    s = HOPPER.slot_backward
    G = HQ // H
    pow2 = triton.next_power_of_2
    cs = chunk_tokens(G, True, HOPPER)
    sprec = chunk_bwd_slots.slot_precision(torch.bfloat16, M)
    gprec = chunk_bwd_slots.gradient_precision(sprec)
    br = max(16, pow2(s.block_tokens * G))
    rows_br = max(16, pow2(s.rows_block_tokens * G))
    blocks = dict(HQ=HQ, H=H, GQ=G, M=M, CSZ=cs, CQB=s.block_tokens, BR=br)
    stages = chunk_bwd_slots._stages(s, br, D)
    rows = dict(HQ=HQ, H=H, GQ=G, M=M, CSZ=cs, D=D, CQB=s.rows_block_tokens, BR=rows_br,
                BT=max(16, pow2(s.rows_block_tokens)), BD=min(64, D), PREC="tf32", SPREC=sprec, GPREC=gprec)
    cols = min(s.columns, D)
    out = [("slot bwd rows, delta whole", chunk_bwd_slots._rows_kernel, dict(rows, DELTA_WHOLE=True), s.warps,
            chunk_bwd_slots._stages(s, rows_br, D)),
           ("slot bwd rows, delta completed", chunk_bwd_slots._rows_kernel, dict(rows, DELTA_WHOLE=False), s.warps,
            chunk_bwd_slots._stages(s, rows_br, D)),
           ("slot bwd state_grad", chunk_bwd_slots._state_grad_kernel, dict(blocks, DX=D, BD=cols, SPREC=sprec),
            s.warps, stages)]
    if cols == D and M <= s.keys_gate_slots:
        merged = dict(blocks, D=D, PREC="tf32", SPREC=sprec, GPREC=gprec)
        out += [("slot bwd merged keys, window dv", chunk_bwd_slots._keys_merged_kernel, merged, s.merged_keys_warps,
                 stages),
                ("slot bwd merged keys, no window", chunk_bwd_slots._keys_merged_kernel, dict(merged, DVW=None),
                 s.merged_keys_warps, stages)]
    else:
        out += [("slot bwd keys", chunk_bwd_slots._keys_kernel, dict(blocks, D=D, BD=cols, SPREC=gprec), s.warps,
                 stages),
                ("slot bwd keys_da", chunk_bwd_slots._keys_da_kernel,
                 dict(blocks, D=D, BD=min(64, D), PREC="tf32", SPREC=sprec, BM=min(M, s.keys_gate_slots)), s.warps,
                 stages)]
    return out


def main():
    shapes = [(32, 8, 128, 64), (9, 3, 64, 64), (4, 4, 128, 128), (9, 3, 64, 16)]
    quick = "--quick" in sys.argv
    slot_only = "--slot-bwd" in sys.argv  # only the slot backward kernels
    sass = "--sass" in sys.argv
    masked = "--masked" in sys.argv  # the launches with an attention mask (padding) instead of without
    match = sys.argv[sys.argv.index("--match") + 1] if "--match" in sys.argv else ""  # names containing it
    failed = False
    for HQ, H, D, M in shapes[:1] if quick else shapes:
        print(f"# HQ={HQ} H={H} D={D} M={M}, bf16, sm_90a{', masked' if masked else ''}")
        for name, fn, consts, warps, stages in cases(HQ, H, D, M):
            if slot_only and not name.startswith("slot bwd") or match not in name:
                continue
            ptrs = {"decode": DECODE_POINTERS, "stored read": STORED_POINTERS}.get(name.split(",")[0])
            if not masked and "MASK" in fn.arg_names:  # without padding the wrappers pass no mask
                consts = dict(consts, MASK=None)
            result = report(fn, consts, warps, stages, ptrs, sass)
            failed |= result.startswith(("compile failed", "ptxas"))
            print(f"{name:40s} {warps} warps, {stages} stages: {result}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
