"""Register / spill report of the fused forward kernel for sm_90a, WITHOUT a GPU (developer tool).

Compiles `_fwd_kernel` to PTX with Triton for a Hopper target and runs the ptxas bundled in Triton's wheel
with -v. (Triton 3.9 emits PTX 9.4 that the bundled ptxas 12.8 refuses; the .version line is lowered.)

    python -m nha_retrofit.kernels.regreport
"""

import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import chunk_fwd as cf

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def report(jitfn, ptrs, consts, num_warps, floats=()):
    sig = {}
    for name in jitfn.arg_names:
        sig[name] = "constexpr" if name in consts else ptrs.get(name, "fp32" if name in floats else "i32")
    kernel = triton.compile(ASTSource(fn=jitfn, signature=sig, constexprs=dict(consts)),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 2})
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx.replace(".version 9.4", ".version 8.7"))
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    return " ".join(line.split(":", 1)[-1].strip() for line in out.stderr.splitlines() if "spill" in line or "Used" in line)


def main():
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    ptrs = dict(Q=bf, K=bf, V=bf, QR=bf, KR=bf, G=bf, MASK=i32, FIRST=i32, FILLED0=i32, BIAS=f32, SK=f32, SV=f32,
                O=bf, LSE=f32, O32=f32)
    for cq, cs in [(16, 64), (16, 32), (16, 16), (8, 32), (8, 16)]:
        for slots in (False, True):
            for sprec in ("tf32", "tf32x3"):
                consts = dict(HQ=32, H=8, GQ=4, D=128, DV=128, M=64, CQB=cq, CSZ=cs, BR=cq * 4, BN=64, HAS_WINDOW=True,
                              HAS_SLOTS=slots, PREC="tf32", CLAMP=80.0, STORE_F32=True, SPREC=sprec, PV_F32=False)
                print(f"CQ={cq} CS={cs} slots={slots} {sprec} 8 warps:", report(cf._fwd_kernel, ptrs, consts, 8, ("scale",)))
                if not slots:
                    break


if __name__ == "__main__":
    main()
