"""Each kernel's GPU time from `ncu --csv --metrics gpu__time_duration.sum ...` on stdin, per
segment: the launches between one marker kernel (`strata_probe_marker`, benchmarks/prompt_probe.py
--ncu) and the next (or the end): in launch order, then summed by kernel name, then the total.
Lines that are not ncu's CSV pass through (the program's own output).

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        python3 benchmarks/prompt_probe.py --ncu --lengths 2048 --forms q2tiles | python3 benchmarks/ncu_summary.py
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict

UNIT_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6}
MARKER = "strata_probe_marker"


def gpu_time_rows(lines) -> list[dict]:
    """ncu's CSV rows of gpu__time_duration.sum in `lines` (a dict a row, by the CSV's header);
    the lines that are not ncu's CSV are written through to stdout."""
    rows, header = [], None
    for line in lines:
        if line.startswith('"ID"'):
            header = next(csv.reader([line]))
            continue
        if header and line.startswith('"'):
            rec = dict(zip(header, next(csv.reader([line]))))
            if rec.get("Metric Name") == "gpu__time_duration.sum":
                rows.append(rec)
            continue
        sys.stdout.write(line)
    return rows


def row_us(rec: dict) -> float:
    """A gpu__time_duration row's value in us."""
    return float(rec["Metric Value"].replace(",", "")) * UNIT_US.get(rec.get("Metric Unit", "nsecond"), 1e-3)


def main() -> None:
    rows = gpu_time_rows(sys.stdin)
    marks = [i for i, r in enumerate(rows) if MARKER in r.get("Kernel Name", "")]
    bounds = list(zip(marks, marks[1:] + [len(rows)])) if marks else [(-1, len(rows))]
    out = []
    for seg, (a, b) in enumerate(bounds, 1):
        after = rows[a + 1:b]
        print(f"\n| segment {seg} # | kernel | grid | block | GPU us |\n|---|---|---|---|---|")
        by_name: dict[str, list[float]] = defaultdict(list)
        total = 0.0
        for i, r in enumerate(after):
            us = row_us(r)
            name = r["Kernel Name"][:90]
            by_name[name].append(us)
            total += us
            print(f"| {i} | {name} | {r.get('Grid Size', '')} | {r.get('Block Size', '')} | {us:.1f} |")
        print(f"\n| segment {seg}: kernel | launches | GPU us (sum) |\n|---|---|---|")
        for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
            print(f"| {name} | {len(v)} | {sum(v):.1f} |")
        print(f"\nsegment {seg}: total GPU time {total:.1f} us over {len(after)} launches")
        out.append({"segment": seg, "total_us": total, "launches": len(after),
                    "by_kernel_us": {k: sum(v) for k, v in by_name.items()}})
    print("JSON " + json.dumps({"bench": "ncu_summary", "segments": out}))


if __name__ == "__main__":
    main()
