"""Registers, spills and shared memory of every NHA kernel for sm_90a, WITHOUT a GPU (developer tool).

Compiles each kernel with Triton for a Hopper target (the launch settings the wrappers use) and runs the
ptxas bundled in Triton's wheel with -v; shared memory is Triton's own figure (the H200 allows ~227 KB per
block). (Triton 3.9 emits PTX 9.4 that the bundled ptxas 12.8 refuses; the .version line is lowered.)
With --sass also each kernel's static instruction mix (nvdisasm, bundled too): its matrix products (HMMA, HGMMA)
against the shared-memory traffic of Triton's layout conversions (STS, LDS, LDSM, BAR) and the spills (LDL, STL),
which an Nsight profile showed the slot backward's kernels waiting on (NOTES.md, session 17), and how its products
run (`asm_stats.product_kinds`). In the one-program-per-multiprocessor kernels more spill bytes or instructions
have usually meant a slower kernel, but not always: only a timing decides (NOTES.md, sessions 31-33).

Every pointer and integer argument counts as divisible by 16, as at T = 32768, where Triton pipelines more loads
through shared memory. The figures depend on the Triton version: run it under the GPU machine's (3.6), e.g. in a
venv with `pip install torch==2.13.0 triton==3.6.0 transformers numpy`; under Triton 3.9 the merged key kernel
reports 772 B of spills and 104 KB where 3.6 gives 188 B and 120 KB (NOTES.md, session 31).

    python -m nha_retrofit.kernels.regreport [--quick] [--slot-bwd] [--sass] [--match TEXT]
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

from . import chunk_fwd as cf
from . import chunk_scan, config, decode, slot_bwd, window_bwd
from .asm_stats import instruction_mix, product_kinds

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


def report(jitfn, consts, num_warps, num_stages=2, pointers=None, maxnreg=None, sass=False):
    """'regs R, spill S B, smem K KB' of one compiled kernel (or the compile error); maxnreg: a register cap; sass:
    with its static instruction counts (`asm_stats.MIX`, and all instructions) and its products' kinds."""
    ptrs = dict(POINTERS, ORES=I8 if config.CONFIG["int8_residual"] else BF, **(pointers or {}))  # o's residual
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
                                options=dict(num_warps=num_warps, num_stages=num_stages,
                                             **({"maxnreg": maxnreg} if maxnreg else {})))
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
    """(name, jit function, constexprs, num_warps, num_stages) as the wrappers launch them (bf16 inputs);
    the fused forward in each CONFIG variant (block, split, slot/value precision)."""
    G = HQ // H
    cs = cf.inference_chunk(G)
    pow2 = triton.next_power_of_2
    update = dict(H=H, M=M, DX=D, CSZ=cs, BD=cf.update_columns(M, D), PREC=config.CONFIG["slot_precision"],
                  ZERO_FIRST=True)
    walk = dict(update, K=32, BM=M, PREFETCH=config.CONFIG["segment_prefetch"], DEC=None, START=None)  # (inference)
    out = [("chunk_update", cf._chunk_update_kernel, update, 4, 2),
           ("segment_update K=32", cf._segment_update_kernel, walk, 4, 2),
           ("segment_update K=32, ends only", cf._segment_update_kernel, dict(walk, LOCAL=None, DCUM=None), 4, 2),
           ("segment_update K=32, whole states", cf._segment_update_kernel,
            dict({k: v for k, v in walk.items() if k not in ("DEC", "START")}, DCUM=None, ENDS=None, DSEG=None,
                 ZERO_FIRST=False), 4, 2),
           ("segment_update K=32, 64 columns", cf._segment_update_kernel, dict(walk, BD=min(64, D)), 4, 2),
           ("segment_update K=32, 32 slots", cf._segment_update_kernel, dict(walk, BM=min(32, M)), 4, 2),
           ("segment_update K=32, 16 slots", cf._segment_update_kernel, dict(walk, BM=min(16, M)), 4, 2),
           ("state_scan", cf._state_scan_kernel, dict(M=M, DX=D, BM=min(M, 16), BD=min(64, D), HAS_S0=False), 4, 3),
           ("rev_scan", slot_bwd._rev_scan_kernel, dict(M=M, DX=D, BM=M, BD=min(64, D)), 4, 3)]
    segment = config.CONFIG["scan_segment"] or 16
    slots = cf.scan_slice(M, D, segment)
    seg = dict(M=M, DX=D, DXP=pow2(D), BM=slots, K=segment, KB=pow2(segment), REVERSE=False)
    warps = chunk_scan.scan_warps(slots, D)
    out += [("chained scan", chunk_scan._chained_scan_kernel, dict(seg, HAS_X0=True), warps, 2),
            ("chained reverse scan", chunk_scan._chained_scan_kernel, dict(seg, REVERSE=True, HAS_X0=False), warps, 2)]
    auto = cf.fwd_block(G, cs)
    stages = config.CONFIG["num_stages"]
    for cq, sprec, vprec in [(auto, "tf32x3", "tf32x3"), (auto, "bf16x3", "bf16x3"), (auto, "tf32x3", "tf32"),
                             (auto, "tf32", "tf32"), (16, "bf16x3", "bf16x3"), (8, "tf32x3", "tf32")]:
        br = max(16, pow2(cq * G))
        warps = cf.fwd_warps(br, D)
        consts = dict(HQ=HQ, H=H, GQ=G, D=D, DV=D, M=M, MT=max(M, config.CONFIG["fwd_min_slot_tile"]), CQB=cq, CSZ=cs,
                      BR=br, BN=64 if br <= 64 else 32,
                      HAS_WINDOW=True, HAS_SLOTS=True, PREC="tf32", SPREC=sprec, VPREC=vprec, KPREC=sprec,
                      BDS=min(64, D),
                      LIMIT=config.CONFIG["block_factor_limit"], SLOTS_FIRST=False, STORE_LOGITS=False, ORES=None,
                      CK=None, CV=None, DCUM=None, KSEG=1, PREFETCH=0,
                      WHOLE_CHUNK_SPLIT=config.CONFIG["fwd_whole_chunk_split"],
                      FACTORED_DECAY=config.CONFIG["factored_carry_decay"],
                      DECAYS_LATE=config.CONFIG["fwd_decays_late"])
        out.append((f"fwd block={cq} {sprec}/{vprec}", cf._fwd_kernel, consts, warps, stages))
        if cq == auto and sprec == vprec:
            out.append((f"fwd block={cq} {sprec}/{vprec} slots first", cf._fwd_kernel,
                        dict(consts, SLOTS_FIRST=True), warps, stages))
    out.append(("fwd window only", cf._fwd_kernel, dict(out[-1][2], HAS_SLOTS=False), 8, stages))
    train_cs = config.CONFIG["train_chunk"] or cs  # the training forward, which keeps its logits for the backward
    train = [c for c in out if c[0] == f"fwd block={auto} bf16x3/bf16x3 slots first"][0]
    local = {k: v for k, v in train[2].items() if k not in ("CK", "CV", "DCUM")}  # the carries: pointers
    vprec = cf.value_precision(torch.bfloat16, training=False)  # the forward without a backward (inference)
    kprec = cf.key_precision(torch.bfloat16, training=False)
    for prefetch in (0, 1, 2):  # CONFIG["fwd_prefetch"]
        out.append((f"fwd block={auto} bf16x3/{vprec}, key state {kprec}, slots first, segment-local states, "
                    f"prefetch {prefetch}", cf._fwd_kernel, dict(local, KSEG=32, PREFETCH=prefetch, VPREC=vprec,
                                                                 KPREC=kprec, LSE=None), train[3], stages))
    cq = cf.fwd_block(G, train_cs)
    training = dict(train[2], CQB=cq, CSZ=train_cs, BR=max(16, pow2(cq * G)), STORE_LOGITS=True,
                    PREFETCH=config.CONFIG["train_fwd_prefetch"])
    if cf.keeps_exact_output(torch.bfloat16):  # its output residual stored (a pointer, not the constexpr None)
        del training["ORES"]
    out.append((f"fwd training block={cq} chunk={train_cs}, logits stored", cf._fwd_kernel, training,
                cf.fwd_warps(max(16, pow2(cq * G)), D), stages))
    for cq in (window_bwd.CQ, 32):
        br = max(16, pow2(cq * G))
        wconsts = dict(HQ=HQ, H=H, GQ=G, D=D, DV=D, CQB=cq, BR=br, BN=window_bwd.dq_keys(64), PREC="tf32",
                       HIGH=False)
        wwarps = 4 if br <= 64 else 8
        # the dq kernel forms delta from the forward's output (pointers) with CONFIG["delta_from_output"]
        output = {} if cf.keeps_exact_output(torch.bfloat16) else dict(O=None, ORES=None)
        out += [(f"window dq block={cq}", window_bwd._dq_kernel, dict(wconsts, DELTA_ONLY=False, **output), wwarps, 2),
                (f"window delta block={cq}", window_bwd._dq_kernel, dict(wconsts, DELTA_ONLY=True, O=None, ORES=None),
                 wwarps, 2),
                (f"window dkv block={cq}", window_bwd._dkv_kernel, dict(wconsts, BN=window_bwd.dkv_keys(64)),
                 config.CONFIG["window_dkv_warps"] or wwarps, 2)]
    dec = dict(HQ=HQ, H=H, GQ=G, D=D, DV=D, M=M, BR=max(16, pow2(G)), BN=decode.BLOCK, HAS_MASK=True,
               HAS_BIAS=True, GATE=True, RING=True, PREC="tf32")
    out += [("decode, one block", decode._decode_kernel, dict(dec, SINGLE=True), 8, 2),
            ("decode, merged blocks", decode._decode_kernel, dict(dec, SINGLE=False), 8, 2)]
    return out + slot_bwd_cases(HQ, H, D, M)


def slot_bwd_cases(HQ, H, D, M, launches=((16, 4, "bf16x3"), (16, 4, "tf32x3"), (16, 8, "bf16x3"), (8, 4, "bf16x3"),
                                                   (32, 4, "bf16x3"), (32, 8, "bf16x3"))):
    """The slot backward kernels per (row-block tokens, warps, fp32 product precision); the first is the
    keys-side kernels' default launch, the last the rows kernel's (CONFIG["slot_bwd_rows_block"] / "_warps")."""
    G = HQ // H
    pow2 = triton.next_power_of_2
    # the row decays the merged key kernel loads, from the rows or the state_grad kernel (CONFIG["shared_row_decays"]):
    # a pointer in the producer and the key kernel
    producer = config.CONFIG["shared_row_decays"]
    shared = {} if producer else dict(BCUM=None)
    shared_by = lambda kernel: {} if producer == kernel else dict(BCUM=None)  # noqa: E731

    def constants(bq, sprec, columns):  # at the training chunk (the slot backward runs only in training)
        return dict(HQ=HQ, H=H, GQ=G, M=M, CQB=bq, CSZ=config.CONFIG["train_chunk"] or cf.inference_chunk(G),
                    BR=max(16, pow2(bq * G)), BD=min(columns, D), SPREC=sprec,
                    LIMIT=config.CONFIG["block_factor_limit"])

    out = []
    for bq, warps, sprec in launches:
        common = constants(bq, sprec, 64)
        rows_grads = dict(GPREC=slot_bwd.gradient_precision("rows", sprec))  # the products that form only dq
        keys = dict(common, SPREC=slot_bwd.gradient_precision("keys", sprec))  # its products form only dk and dv
        stages = slot_bwd.pipeline_stages(common["BR"], D)
        tag = f"block={bq} {sprec}"
        rows = dict(common, D=D, DV=D, BT=max(16, pow2(bq)), PREC="tf32", **shared_by("rows"),
                    DELTA_WHOLE=cf.keeps_exact_output(torch.bfloat16), CUMSUM_SPLIT=config.CONFIG["rows_cumsum_split"],
                    FACTORED_DECAY=config.CONFIG["factored_carry_decay"], **rows_grads)
        out += [(f"slot bwd rows {tag}", slot_bwd._rows_kernel, dict(rows, HAS_LOGITS=True), warps, stages),
                (f"slot bwd rows {tag}, logits formed", slot_bwd._rows_kernel, dict(rows, HAS_LOGITS=False), warps,
                 stages),
                (f"slot bwd state_grad {tag}", slot_bwd._state_grad_kernel,
                 dict(common, DX=D, CHUNK_DECAY=config.CONFIG["state_grad_chunk_decay"], **shared_by("state_grad")),
                 warps, stages),
                (f"slot bwd keys (dk+dv) {tag}", slot_bwd._keys_kernel,
                 dict(keys, D=D, DV=D, DO_K=True, DO_V=True), warps, stages),
                (f"slot bwd keys (dk only) {tag}", slot_bwd._keys_kernel,
                 dict(keys, D=D, DV=D, DO_K=True, DO_V=False), warps, stages),
                (f"slot bwd keys_da {tag}", slot_bwd._keys_da_kernel,
                 dict(common, D=D, DV=D, PREC="tf32", BM=min(M, config.CONFIG["keys_da_slots"] or M)), warps, stages)]
    # the column-split kernels over all columns of D = 128 in one program (CONFIG["slot_bwd_columns"])
    bq, _, sprec = launches[0]
    common = constants(bq, sprec, 128)
    grads = dict(GPREC=slot_bwd.gradient_precision("keys", sprec))
    keys = dict(common, SPREC=grads["GPREC"])
    stages = slot_bwd.pipeline_stages(common["BR"], D)
    for warps in (4, 8):
        tag = f"block={bq} {sprec} columns={min(128, D)}"
        out += [(f"slot bwd state_grad {tag}", slot_bwd._state_grad_kernel,
                 dict(common, DX=D, CHUNK_DECAY=config.CONFIG["state_grad_chunk_decay"], **shared_by("state_grad")),
                 warps, stages),
                (f"slot bwd keys (dk+dv) {tag}", slot_bwd._keys_kernel,
                 dict(keys, D=D, DV=D, DO_K=True, DO_V=True), warps, stages),
                (f"slot bwd keys (dk only) {tag}", slot_bwd._keys_kernel,  # CONFIG["slot_bwd_merge_keys"] False
                 dict(keys, D=D, DV=D, DO_K=True, DO_V=False), warps, stages),
                (f"slot bwd keys (dv only) {tag}", slot_bwd._keys_kernel,
                 dict(keys, D=D, DV=D, DO_K=False, DO_V=True), warps, stages),
                # CONFIG["slot_bwd_keys_merged_warps"]
                (f"slot bwd keys + keys_da merged {tag}", slot_bwd._keys_merged_kernel,
                 dict(common, **grads, D=D, PREC="tf32", PREFETCH=config.CONFIG["keys_prefetch"],
                      CARRY_SPLIT=config.CONFIG["keys_carry_split"],
                      SIDES_APART=config.CONFIG["keys_sides_apart"], REST_PRODUCT=config.CONFIG["keys_rest_product"],
                      **shared),
                 warps, stages)]
    return out


# the slot backward's kernels that CONFIG["slot_bwd_maxnreg"] can cap (`slot_bwd.register_cap`), by their kind there
CAPPED = {slot_bwd._rows_kernel: "rows", slot_bwd._state_grad_kernel: "state_grad",
          slot_bwd._keys_merged_kernel: "keys"}


def main():
    shapes = [(32, 8, 128, 64), (9, 3, 64, 64)]
    # NHA_KERNEL_VARIANT=name reports the kernels under that CONFIG variant (e.g. chunk32), as the GPU tests take it
    config.CONFIG.update(config.variant_overrides(os.environ.get("NHA_KERNEL_VARIANT", "defaults")))
    quick = "--quick" in sys.argv
    slot_only = "--slot-bwd" in sys.argv  # only the slot backward kernels
    sass = "--sass" in sys.argv
    match = sys.argv[sys.argv.index("--match") + 1] if "--match" in sys.argv else ""  # names containing it
    for HQ, H, D, M in shapes[:1] if quick else shapes:
        print(f"# HQ={HQ} H={H} D={D} M={M}, bf16, sm_90a")
        for name, fn, consts, warps, stages in cases(HQ, H, D, M):
            if slot_only and not name.startswith("slot bwd") or match not in name:
                continue
            ptrs = DECODE_POINTERS if name.startswith("decode") else None
            cap = slot_bwd.register_cap(CAPPED[fn]).get("maxnreg") if fn in CAPPED else None
            if config.CONFIG["maskless"] and "MASK" in fn.arg_names:  # as the wrappers launch them without padding
                consts = dict(consts, MASK=None)
            print(f"{name:36s} {warps} warps, {stages} stages: {report(fn, consts, warps, stages, ptrs, cap, sass)}",
                  flush=True)


if __name__ == "__main__":
    main()
