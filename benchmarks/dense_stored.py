"""Dense weights as stored: what each dense type costs in memory and in decode speed.

For each dense type (F32, F16, Q8_0) one made model of the same shape and seed: the bytes the
loader holds (numpy, as stored), the bytes MLX holds (`dense_nbytes`, when --backend mlx), and a
fresh-process run (`strata.doctor.measure`): decode tok/s and peak RSS, all-resident. Prints a
markdown table and, last, one JSON line; a `JSON-PART` line per finished case as it goes.

    PYTHONPATH=$PWD python benchmarks/dense_stored.py [--backend numpy|mlx] [--shape demo]
        [--types f32,f16,q8_0] [--tokens 32] [--hidden 1024 --layers 8] [--case-timeout 60]

On a GPU the F16 model runs the float16 kernels and the compiled decode as F32 files did; a Q8_0
model's matrices go through the Q8_0 GEMV on the ops attention, uncompiled (docs/mlx_backend.md,
"Dense weights as stored"): this says what that costs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _mlx_bytes(model) -> int | None:
    try:
        from strata.mlx_backend.model import dense_nbytes, to_mlx_params
    except ImportError:
        return None
    return dense_nbytes(to_mlx_params(model.cfg, model.dense, pred_q8=False))


def main(argv=None) -> int:
    from strata.doctor.measure import measure_run
    from strata.formats.quant_types import parse_quant_type
    from strata.loader import load
    from strata.testing.models import make_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="numpy", choices=("numpy", "mlx"))
    p.add_argument("--shape", default="demo")
    p.add_argument("--types", default="f32,f16,q8_0")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=0, help="override the shape's hidden size (heads x head_dim kept)")
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count")
    p.add_argument("--case-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    overrides = {}
    if args.hidden:
        overrides.update(hidden_size=args.hidden, shared_ffn_size=args.hidden)
    if args.layers:
        overrides["n_layers"] = args.layers
    t0, rows = time.time(), []
    with tempfile.TemporaryDirectory() as d:
        for name in [t.strip() for t in args.types.split(",") if t.strip()]:
            qtype = parse_quant_type(name)
            made = make_model(Path(d) / name, args.shape, dense_type=qtype, **overrides)
            with load(made.model_path) as model:
                f32 = sum(model.dense[n].nbytes for n in model.dense)  # what float32 at load held
                held = model.dense.nbytes
                mlx = _mlx_bytes(model) if args.backend == "mlx" else None
            row = {"dense": qtype.name, "f32_bytes": f32, "held_bytes": held, "mlx_bytes": mlx,
                   "file_bytes": made.model_path.stat().st_size}
            try:
                run = measure_run(made.model_path, {"backend": args.backend}, max_tokens=args.tokens,
                                  timeout=args.case_timeout)
                row.update(tps=run.decode_tps, median_tps=1.0 / run.median_token_s if run.median_token_s else 0.0,
                           peak_rss=run.peak_rss)
            except (subprocess.TimeoutExpired, RuntimeError) as e:
                row.update(tps=None, median_tps=None, peak_rss=None, error=" ".join(str(e).split())[:300])
            rows.append(row)
            print("JSON-PART " + json.dumps({"part": "case", "seconds": round(time.time() - t0, 1), **row}), flush=True)
    mb = lambda n: "-" if n is None else f"{n / 1e6:.1f}"  # noqa: E731
    num = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    print(f"\n{args.shape} {overrides or ''}, backend {args.backend}, {args.tokens} tokens, all-resident\n")
    print("| dense | float32 MB | held MB (numpy) | held MB (MLX) | file MB | decode tok/s | median tok/s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dense']} | {mb(r['f32_bytes'])} | {mb(r['held_bytes'])} | {mb(r['mlx_bytes'])} "
              f"| {mb(r['file_bytes'])} | {num(r['tps'])} | {num(r['median_tps'])} | {mb(r['peak_rss'])} |")
    print()
    print(json.dumps({"backend": args.backend, "shape": args.shape, "overrides": overrides, "tokens": args.tokens,
                      "rows": rows, "seconds": round(time.time() - t0, 1)}, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
