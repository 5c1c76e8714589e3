"""ncu's CSV (`ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum ...`) on stdin as one
row per profiled kernel, in launch order: name (its first NAME_CHARS characters), grid, block, GPU
time, DRAM bytes read and their rate, and any of EXTRA's metrics the run collected; every other
line (the application's own output) passed through. A total per kernel name closes the table, and one JSON line of the rows.

    ncu --clock-control none -k regex:strata_ --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 benchmarks/kernels.py --ncu decode | python3 benchmarks/_ncu_table.py
"""

from __future__ import annotations

import collections
import csv
import json
import sys

NAME_CHARS = 90
# more metrics printed where collected: (metric, column, format)
EXTRA = (("launch__registers_per_thread", "regs", "{:5.0f}"),
         ("sm__warps_active.avg.pct_of_peak_sustained_active", "warps%", "{:6.1f}"),
         ("lts__t_sector_hit_rate.pct", "L2hit%", "{:6.1f}"))
UNITS = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0, "byte": 1.0, "Kbyte": 1e3,
         "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9, "B": 1.0, "ns": 1e-9, "us": 1e-6, "ms": 1e-3}


def main() -> int:
    header = None
    kernels: dict = {}
    for line in sys.stdin:
        if line.startswith('"ID"'):
            header = next(csv.reader([line]))
            continue
        if header is None or not line.startswith('"'):
            sys.stdout.write(line)
            continue
        row = dict(zip(header, next(csv.reader([line]))))
        k = kernels.setdefault(row["ID"], {"name": row.get("Kernel Name", "?"), "grid": row.get("Grid Size", ""),
                                           "block": row.get("Block Size", "")})
        try:
            value = float(row["Metric Value"].replace(",", "")) * UNITS.get(row.get("Metric Unit", ""), 1.0)
        except ValueError:
            continue
        k[row["Metric Name"]] = value
    totals: collections.OrderedDict = collections.OrderedDict()
    extra = [e for e in EXTRA if any(e[0] in k for k in kernels.values())]
    print(f"{'id':>4}  {'kernel':<{NAME_CHARS}}  {'grid':>14} {'block':>12} {'us':>8} {'MB read':>8} {'GB/s':>7}"
          + "".join(f" {col:>6}" for _, col, _ in extra))
    for kid, k in kernels.items():
        t, b = k.get("gpu__time_duration.sum"), k.get("dram__bytes_read.sum")
        rate = f"{b / t / 1e9:7.0f}" if t and b is not None else ""
        more = "".join(" " + (fmt.format(k[m]) if m in k else "     -") for m, _, fmt in extra)
        print(f"{kid:>4}  {k['name'][:NAME_CHARS]:<{NAME_CHARS}}  {k['grid']:>14} {k['block']:>12} "
              f"{(t or 0) * 1e6:8.2f} {(b or 0) / 1e6:8.2f} {rate}{more}")
        agg = totals.setdefault(k["name"][:NAME_CHARS], [0, 0.0])
        agg[0] += 1
        agg[1] += t or 0.0
    print("NCU-TOTALS")
    for name, (n, t) in totals.items():
        print(f"{n:>4} x {name:<{NAME_CHARS}} {t * 1e6:9.2f} us")
    rows = [{"id": kid, "kernel": k["name"][:NAME_CHARS], "grid": k["grid"], "block": k["block"],
             "us": (k.get("gpu__time_duration.sum") or 0) * 1e6, "mb_read": (k.get("dram__bytes_read.sum") or 0) / 1e6,
             **{col: k[m] for m, col, _ in extra if m in k}} for kid, k in kernels.items()]
    print("JSON " + json.dumps({"ncu": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
