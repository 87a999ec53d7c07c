"""Counts read from a compiled kernel's text (`tools/asm_stats.py`), on hand-written excerpts (CPU)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

from asm_stats import instruction_mix, product_kinds  # noqa: E402

TTGIR = """#blocked = #ttg.blocked<{sizePerThread = [1, 8], threadsPerWarp = [4, 8], warpsPerCTA = [8, 1], order = [1, 0]}>
#mma = #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [1, 8], instrShape = [16, 8]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 32, 16]}>
module {
    %1 = tt.dot %a, %b, %c, inputPrecision = tf32 : tensor<32x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * tensor<64x128xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> -> tensor<32x128xf32, #mma>
    %2 = ttng.warp_group_dot %d, %e, %f {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<64x64xbf16, #shared, #smem> * !ttg.memdesc<64x32xbf16, #shared1, #smem> -> tensor<64x32xf32, #mma1>
    %3 = ttng.warp_group_dot_wait %2 {pendings = 0 : i32} : tensor<64x32xf32, #mma1>
    %4 = tt.dot %g, %h, %i, inputPrecision = ieee : tensor<16x32xf32, #ttg.dot_op<{opIdx = 0, parent = #blocked}>> * tensor<32x64xf32, #ttg.dot_op<{opIdx = 1, parent = #blocked}>> -> tensor<16x64xf32, #blocked>
    %5 = tt.dot %a, %b, %1, inputPrecision = tf32 : tensor<32x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * tensor<64x128xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> -> tensor<32x128xf32, #mma>
}
"""


def test_products_are_told_apart_by_their_result_layout():
    """mma.sync (version 2 results), wgmma (version 3; its wait op is not a product) and FMA (blocked results)."""
    assert product_kinds(TTGIR) == "wgmma 1, mma.sync 2, fma 1"


DISASSEMBLY = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/              @!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0020*/               @P1 STS.128 [R2], R4 ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   LDL.64 R6, [R1+0x8] ;
"""


def test_instruction_mix_counts_opcodes_without_predicates_or_modifiers():
    mix = instruction_mix(DISASSEMBLY)
    assert mix.startswith("5 instructions, HMMA 1 HGMMA 0 STS 1 LDS 0 LDSM 0 BAR 1 LDG 0 STG 0 LDL 1 STL 0")
