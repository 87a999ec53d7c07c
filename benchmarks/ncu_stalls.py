"""Where a kernel's warps wait, by source line, from an Nsight Compute report (developer tool, GPU machine).

Sums the per-instruction warp-stall samples of `ncu --section WarpStateStats --section SourceCounters
--import-source yes` by source line and by SASS opcode, e.g.:

    ncu --clock-control none --profile-from-start off -k regex:_rows_kernel -c 1 --section WarpStateStats \
        --section SourceCounters --import-source yes -o prof python3 benchmarks/kernel_profile.py --T 32768
    ncu -i prof.ncu-rep --page source --csv --print-source cuda,sass -k _rows_kernel > rows.csv
    python3 benchmarks/ncu_stalls.py rows.csv --top 20
"""

import argparse
import collections
import csv
import re

SAMPLES = "Warp Stall Sampling (All Samples)"


def count(value):
    """An integer cell of the report ('-' or empty: 0)."""
    return int(value) if value not in ("-", "") else 0


def stalls(path):
    """(samples per source line, stall reasons per line, samples per opcode, source text per line)."""
    by_line, reasons, by_opcode, text = collections.Counter(), collections.defaultdict(collections.Counter), \
        collections.Counter(), {}
    source_file, column, width = None, None, 0
    with open(path, newline="") as page:
        rows = list(csv.reader(page))
    for row in rows:
        if len(row) == 2 and row[0] == "File Path":
            source_file = row[1].rsplit("/", 1)[-1]
        elif row and row[0] == "Line No":
            column = {name: i for i, name in enumerate(row)}  # ("Source" twice: the SASS text's index wins)
            width = len(row)
        elif column and len(row) >= len(column):
            if row[0] not in ("", "-") and len(row) > width:
                # a source line whose text has double quotes: ncu leaves them unescaped inside its quoted cell, so
                # the text's commas split it (e.g. an inline_asm_elementwise call); join those pieces again
                extra = len(row) - width
                row = [row[0], ",".join(row[1:2 + extra])] + row[2 + extra:]
            samples = count(row[column[SAMPLES]])
            if row[0] not in ("", "-"):  # a source line: its samples and stall reasons
                line = (source_file, int(row[0]))
                text[line] = row[1]
                by_line[line] += samples
                for name, i in column.items():
                    if name.startswith("stall_") and "Not Issued" not in name:
                        reasons[line][name[6:]] += count(row[i])
            else:  # one SASS instruction under the line above
                opcode = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", row[3])
                if opcode:
                    by_opcode[opcode.group(1)] += samples
    return by_line, reasons, by_opcode, text


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source cuda,sass output for one kernel")
    parser.add_argument("--top", type=int, default=25, help="source lines to list")
    args = parser.parse_args()
    by_line, reasons, by_opcode, text = stalls(args.csv)
    total = sum(by_line.values()) or 1
    overall = sum(reasons.values(), collections.Counter())
    print(f"{total} samples; stalls: " + ", ".join(f"{k} {v / total:.0%}" for k, v in overall.most_common(8)))
    print("by opcode: " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_opcode.most_common(14)))
    for line, samples in by_line.most_common(args.top):
        top = ", ".join(f"{k} {n / samples:.0%}" for k, n in reasons[line].most_common(3))
        print(f"{samples / total:6.1%} {line[0]}:{line[1]:<5d} {text[line].strip()[:80]:80s} | {top}")


if __name__ == "__main__":
    main()
