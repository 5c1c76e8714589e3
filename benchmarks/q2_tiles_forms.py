"""The Q2_0 tile kernel's bodies side by side (kernels/q2_tiles.py TileForm; issue 19, a prompt of
2048 tokens in <= 0.2 s): one MoE layer's two launches at the seed shape (256 experts top-10, D
2560, F 576: N = 20480 pairs at 2048 tokens, random distinct experts per token), for each body
and 64 / 128 columns a block: wall ms (median of --repeat, each launch evaluated alone), the
mma work's rate (2 P N R C flops: P float16 terms of each row) and whether the output's bits are
the first body's (they must be: tests/test_mlx_q2_tiles_forms.py).

    python3 benchmarks/q2_tiles_forms.py                    # the H200: ~15 s (JIT of 8 specialisations)
    python3 benchmarks/q2_tiles_forms.py --small --path emulated --tokens 64   # smoke test (CPU)

Prints a table and one JSON line (`JSON {...}`). ncu's view of the same launches:
`ncu -k regex:strata_q2_tiles --metrics gpu__time_duration.sum,l1tex__throughput.avg.pct_of_peak_sustained_active
python3 benchmarks/q2_tiles_forms.py --repeat 1`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import median_time  # noqa: E402
from strata.mlx_backend import jit_cache, lowp  # noqa: E402,F401  (jit_cache: the PTX cache default)
from strata.mlx_backend.grouped_tiles import tile_table  # noqa: E402
from strata.mlx_backend.kernels import q2_tiles as qt  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, using_path  # noqa: E402
from strata.testing.mlx_params import SEED_SHAPE, random_params  # noqa: E402

SMALL = replace(SEED_SHAPE, hidden_size=256, n_experts=32, n_experts_per_token=4, expert_ffn_size=64)


def _time_bodies(forms, columns, launches, repeat: int, res: dict, first: dict) -> None:
    """Each body and column count: the launches' bits (against the first body's) and median ms."""
    for bn in columns:
        for form in forms:
            qt.FORM = form
            for name, (call, flops) in launches.items():
                try:
                    y = np.array(call(bn))  # JIT, and the bits
                except Exception as exc:  # reported, not fatal: the next body still runs
                    row = {"form": form.value, "bn": bn, "launch": name,
                           "error": f"{type(exc).__name__}: {exc}"[:300]}
                    res["rows"][f"{form.value}/{bn}/{name}"] = row
                    print("JSON-PART " + json.dumps(row), flush=True)
                    continue
                key = (name, bn)
                same = bool(np.array_equal(y, first[key])) if key in first else None
                first.setdefault(key, y)
                s = median_time(lambda: mx.eval(call(bn)), warmup=1, reps=repeat)
                row = {"form": form.value, "bn": bn, "launch": name, "ms": s * 1e3,
                       "mma_tflops": flops / s / 1e12, "same_bits_as_first": same}
                res["rows"][f"{form.value}/{bn}/{name}"] = row
                print("JSON-PART " + json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--forms", default=",".join(f.value for f in qt.TileForm))
    ap.add_argument("--columns", default="128,64", help="output columns a block (bn)")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--path", choices=["gpu", "emulated"], default="gpu")
    args = ap.parse_args(argv)
    cfg = replace(SMALL if args.small else SEED_SHAPE, n_layers=1, shared_ffn_size=0, shared_expert_gated=False)
    forms = [qt.TileForm(v) for v in args.forms.split(",")]
    columns = [int(v) for v in args.columns.split(",")]
    path = KernelPath.GPU if args.path == "gpu" else KernelPath.EMULATED
    t, k, e, d, f = args.tokens, cfg.n_experts_per_token, cfg.n_experts, cfg.hidden_size, cfg.expert_ffn_size
    p = random_params(cfg, seed=0, pred_q8=False)
    records, rec = p.arena.array[:e], p.rec
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)  # [T, k] distinct experts a token
    flat = mx.array(ids.reshape(-1))
    order = mx.argsort(flat).astype(mx.int32)
    terms = 2 if lowp.SPLIT else 1
    tiles = tile_table(flat[order], e, qt.BM // terms)
    x = mx.random.normal((t, d), key=mx.random.key(1))
    hid = mx.random.normal((t * k, f), key=mx.random.key(2))
    w = mx.random.uniform(0.1, 1.0, (t * k,), key=mx.random.key(3))
    mx.eval(order, tiles, x, hid, w)
    n = t * k
    launches = {  # name -> (call, mma flops)
        "gate_up_hidden": (lambda bn: qt.q2_tiles(x, order // k, order, w, tiles, n, records, rec, ("gate", "up"),
                                                  gather=True, scatter=False, terms=terms, hidden=True, bn=bn),
                           2 * terms * n * 2 * f * d),
        "down": (lambda bn: qt.q2_tiles(hid, order, order, w, tiles, n, records, rec, ("down",), gather=False,
                                        scatter=True, terms=terms, bn=bn), 2 * terms * n * d * f),
    }
    res = {"bench": "q2_tiles_forms", "device": str(mx.default_device()), "mlx": mx.__version__, "tokens": t,
           "pairs": n, "terms": terms, "rows": {}}
    first: dict = {}
    saved = qt.FORM
    try:
        with using_path(path):
            _time_bodies(forms, columns, launches, args.repeat, res, first)
    finally:
        qt.FORM = saved
    print(f"\n## Q2_0 tile kernel bodies: {res['device']}, MLX {res['mlx']}, {t} tokens ({n} pairs), {terms} terms, "
          f"median of {args.repeat}")
    print("| body | columns | launch | ms | mma TFLOP/s | bits = first body |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"].values():
        if "error" in r:
            print(f"| {r['form']} | {r['bn']} | {r['launch']} | error: {r['error']} | | |")
            continue
        print(f"| {r['form']} | {r['bn']} | {r['launch']} | {r['ms']:.3f} | {r['mma_tflops']:.1f} | "
              f"{'-' if r['same_bits_as_first'] is None else r['same_bits_as_first']} |")
    print("JSON " + json.dumps(res))


if __name__ == "__main__":
    main()
