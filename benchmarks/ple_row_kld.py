"""What a lossy PLE row type costs on the made Qwen4-Exp model: the KLD of Q8_0 and Q4_0 rows
against F16 rows, through the real forward (strata.tools.ngram_rows_quality.model_forward).

    python benchmarks/ple_row_kld.py [--seed 1] [--positions 256] [--embed 128]

The model is the `qwen4` made shape with PLE rows 32 wide (`--embed 128` over its 4 n-gram heads:
Q8_0 and Q4_0 need a multiple of 32), its tables of random normal rows (make_model), teacher-
forced over byte tokens of a code text (holding the EOS token, so the n-gram shifts stop). The
rows are read through row stores on disk written in each type (F16, Q8_0, Q4_0), so what is
measured is what the engines read. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import strata
from strata.formats.ngram_rows_writer import write_ngram_rows
from strata.formats.quant_types import QuantType
from strata.testing.models import SHAPES, make_model
from strata.tools.ngram_rows_quality import model_forward, model_tables, row_source_kld

TEXT = (b"def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        b"for i in range(20):\n    print(i, fibonacci(i))\n") * 4


def measure(seed: int, positions: int, embed: int, workdir: Path) -> list:
    made = make_model(workdir / "m", "qwen4", seed=seed, ple_rows=QuantType.F32, ple_embed_dim=embed)
    eos = SHAPES["qwen4"].qwen4.ngram_eos_token
    tokens = np.array([eos if b == ord("\n") and i % 3 == 0 else b for i, b in enumerate(TEXT)][:positions])
    with strata.load(made.model_path) as model:
        tables = model_tables(model)
        stores = {}
        for qt in (QuantType.F16, QuantType.Q8_0, QuantType.Q4_0):
            stores[qt.name] = write_ngram_rows(workdir / f"{qt.name}.ngrams", qtype=qt,
                                               shapes={i: t.shape for i, t in tables.items()}, pieces=tables.items())
        forward = model_forward(model.resident_params())
        try:
            return row_source_kld(forward, stores["F16"], {k: stores[k] for k in ("Q8_0", "Q4_0")}, tokens)
        finally:
            for s in stores.values():
                s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--embed", type=int, default=128, help="ple_embed_dim (rows of embed / 4 values)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        res = measure(args.seed, args.positions, args.embed, Path(d))
    print(f"{'rows':<6} {'KLD mean':>10} {'p99':>10} {'max':>10} {'argmax agrees':>14}")
    for r in res:
        print(f"{r.name:<6} {r.kld_mean:10.3g} {r.kld_p99:10.3g} {r.kld_max:10.3g} {100 * r.top1_agreement:13.1f}%")
    print(json.dumps({"bench": "ple_row_kld", "seed": args.seed, "positions": res[0].positions,
                      **{r.name: {"kld_mean": r.kld_mean, "kld_p99": r.kld_p99, "kld_max": r.kld_max,
                                  "top1": r.top1_agreement} for r in res}}))


if __name__ == "__main__":
    main()
