#!/usr/bin/env python3
"""Kernel times of one layer from an ncu CSV of `layer_decode`.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        .gpu/layer_decode --backend cuda --batches 1 --contexts 64 --prefill 8192 --reps 1 > k.csv
    benches/gpu/ncu_layer.py k.csv FIRST LAST   # launch IDs (inclusive) of one layer

Prints each launch (ID, kernel, grid, block, microseconds) and the sum. ncu serialises the
launches, so the sum is the layer's device time without overlap or host gaps.
"""
import csv
import io
import sys


def launches(path):
    lines = open(path).read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    rows = list(csv.reader(io.StringIO("\n".join(l for l in lines[start:] if l.startswith('"')))))
    head = rows[0]
    col = {name: head.index(name) for name in ("ID", "Kernel Name", "Grid Size", "Block Size", "Metric Value")}
    for r in rows[1:]:
        if len(r) == len(head):
            yield (int(r[col["ID"]]), r[col["Kernel Name"]], r[col["Grid Size"]],
                   r[col["Block Size"]], float(r[col["Metric Value"]].replace(",", "")) / 1e3)


def main():
    path, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    total = 0.0
    for i, name, grid, block, us in launches(path):
        if first <= i <= last:
            print(f"{i:5} {name[:32]:32} {grid:>16} {block:>14} {us:12.1f}")
            total += us
    print(f"sum {total:.1f} us")


if __name__ == "__main__":
    main()
