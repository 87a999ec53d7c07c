"""Counts read from a compiled kernel's text (no Triton needed, so CPU tests cover them; `regreport` prints them)."""

import re

MIX = ("HMMA", "HGMMA", "STS", "LDS", "LDSM", "BAR", "LDG", "STG", "LDL", "STL", "F2FP", "SHFL", "MUFU")


def product_kinds(ttgir):
    """'wgmma W, mma.sync S, fma F' of a kernel's TTGIR: how its matrix products run, by their result's layout.
    Hopper's wgmma takes a product of at least 64 rows per warpgroup; smaller ones fall back to mma.sync, whose
    operands go through shared memory into registers (ldmatrix); fp32 "ieee" products run on the FMA units. The
    merged key kernel's products with the chunk's 32 tokens as rows are mma.sync."""
    versions = dict(re.findall(r"^(#\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+)", ttgir, re.M))
    kinds = {"wgmma": 0, "mma.sync": 0, "fma": 0}
    for layout in re.findall(r"= (?:tt\.dot|ttng\.warp_group_dot) .*-> tensor<[^>]*, (#\w+)>", ttgir):
        kinds[{"3": "wgmma", "2": "mma.sync"}.get(versions.get(layout), "fma")] += 1
    return ", ".join(f"{name} {n}" for name, n in kinds.items())


def instruction_mix(disassembly):
    """'N instructions, HMMA a, ...' of nvdisasm output: static counts by opcode (predicates and modifiers dropped)."""
    opcodes = re.findall(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", disassembly, re.M)
    counts = {name: 0 for name in MIX}
    for opcode in opcodes:
        if opcode in counts:
            counts[opcode] += 1
    return f"{len(opcodes)} instructions, " + " ".join(f"{name} {n}" for name, n in counts.items())
