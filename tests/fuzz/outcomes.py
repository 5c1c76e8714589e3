"""What the fuzz scripts share at their end: the bad runs listed, the counts saved as JSON, the exit status."""

from __future__ import annotations

import collections
import json

OUTCOMES = ("refused", "same", "WRONG", "TRACEBACK", "HANG")
FAILURES = ("WRONG", "TRACEBACK", "HANG")


def table(rows: dict, label: str, width: int) -> None:
    """One line per (group, `label`) key of `rows` (its outcome counts), `label` `width` wide."""
    print(f"{'group':8} {label:{width}} {'runs':>5} " + " ".join(f"{o:>9}" for o in OUTCOMES))
    for (group, key), c in rows.items():
        print(f"{group:8} {key:{width}} {sum(c.values()):5d} " + " ".join(f"{c[o]:9d}" for o in OUTCOMES))


def totals_of(counts: dict) -> collections.Counter:
    """Every outcome's count over all (group, mode) rows."""
    totals = collections.Counter()
    for c in counts.values():
        totals.update(c)
    return totals


def close(*, bad: list[dict], counts: dict, by_kind: dict, totals: dict, seconds: float, args) -> int:
    """Print the first 40 bad runs, write `args.json` if asked; -> the exit status (1 on any failure)."""
    for b in bad[:40]:
        print(f"  {b['outcome']}: {b['group']} {b['kind']} ({b['mode']}): {b['detail']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"counts": {f"{g}/{m}": dict(c) for (g, m), c in counts.items()},
                       "by_kind": {f"{g}/{k}": dict(c) for (g, k), c in by_kind.items()},
                       "bad": bad, "seconds": seconds, "args": vars(args)}, f, indent=1)
    return 1 if any(totals[o] for o in FAILURES) else 0
