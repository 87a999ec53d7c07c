"""benchmarks/ncu_stalls.py on a small hand-written Nsight Compute source page (CPU)."""

import ncu_stalls

HEADER = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb",
          "stall_barrier", "stall_long_sb (Not Issued)"]


def _row(*cells):
    return ",".join(f'"{c}"' for c in cells)


def test_samples_are_summed_by_line_reason_and_opcode(tmp_path):
    page = "\n".join([
        _row("File Path", "/x/products.py"),
        _row("Function Name", "_k"),
        _row(*HEADER),
        _row("38", "hi = x.to(tl.bfloat16)", "-", "-", "30", "20", "7", "99"),
        _row("", "", "0x10", "      F2F.BF16 R1, R2", "18", "12", "4", "99"),
        _row("", "", "...", "...", "-", "-", "-", "-"),
        _row("", "", "0x20", "  @!P0 F2F.BF16 R3, R4", "12", "8", "3", "99"),
        _row("File Path", "/x/slot_bwd.py"),
        _row(*HEADER),
        _row("315", "q_real = tl.load(MASK)", "-", "-", "5", "5", "0", "99"),
        _row("", "", "0x30", "      LDG.E R5, [R6]", "5", "5", "0", "99"),
    ])
    path = tmp_path / "page.csv"
    path.write_text(page + "\n")
    by_line, reasons, by_opcode, text = ncu_stalls.stalls(str(path))
    assert by_line == {("products.py", 38): 30, ("slot_bwd.py", 315): 5}
    assert reasons[("products.py", 38)] == {"long_sb": 20, "barrier": 7}  # the "Not Issued" columns left out
    assert by_opcode == {"F2F": 30, "LDG": 5}  # predicates and modifiers dropped
    assert text[("slot_bwd.py", 315)] == "q_real = tl.load(MASK)"


def test_a_source_line_with_unescaped_quotes_keeps_its_columns(tmp_path):
    """ncu leaves a source line's double quotes unescaped inside its quoted cell, so a line such as an
    inline_asm_elementwise call splits at its commas into extra cells; they are joined again and the sample and
    stall columns stay where the header puts them."""
    line = '"386","tl.inline_asm_elementwise("prefetch [$1];", "=r,l", [p])","-","-","9","6","2","99"'
    page = "\n".join([_row("File Path", "/x/chunk_fwd.py"), _row("Function Name", "_k"), _row(*HEADER), line,
                      _row("", "", "0x10", "      CCTL.E [R2]", "9", "6", "2", "99")])
    path = tmp_path / "page.csv"
    path.write_text(page + "\n")
    by_line, reasons, by_opcode, text = ncu_stalls.stalls(str(path))
    assert by_line == {("chunk_fwd.py", 386): 9}
    assert reasons[("chunk_fwd.py", 386)] == {"long_sb": 6, "barrier": 2}
    assert by_opcode == {"CCTL": 9}
    assert text[("chunk_fwd.py", 386)].startswith("tl.inline_asm_elementwise(")
