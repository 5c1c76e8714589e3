"""The decode attention step alone (after the QKV GEMV), context by context and form by form, at the
seed shape's heads (16 q / 4 KV heads of 128, D 2560, float16 W_o, float32 KV cache): what
benchmarks/decode_context.py's per-token difference between contexts is made of (issue 19).

Forms (each writes the new position's key and value and returns the attention output projected
by W_o):
    project       kernels/attend_project.py: one block per (head, 256 rows of W_o), the head's
                  whole context walked in the block (the form at short contexts; any length here)
    split         kernels/attend_split.py: the split attend, then the merge inside W_o's blocks
                  (two launches: the default past attention.SPLIT_FROM positions)
    split_ns32, split_ns128, split_pb2, split_pb5   the same with 32 / 128 splits, 2 / 5 rows a warp step
    split_chunks  attend with CH = SPLIT_CHUNK, attend_merge, the W_o GEMV (three launches: the
                  form before attend_split)

Bytes a layer: keys and values 2 KVH n HD 4 (8.4 MB at 2048 positions), W_o 10.5 MB, the split's
partials H NS (HD + 2) 4 written and read back. Each layer of the chain has its own cache and W_o
(48 of them: 0.8 + 0.5 GB), so nothing is an L2 hit that would not be one in a decoded token.

    python3 benchmarks/attend_context.py                 # contexts 8,2048; every form (GPU)
    python3 benchmarks/attend_context.py --small         # emulated kernels, a small head shape
    ncu --clock-control none -k 'regex:strata_(attend|merge|dense_gemv)' --csv \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 benchmarks/attend_context.py --ncu | python3 benchmarks/_ncu_table.py

Prints each form's agreement with the context's first form (split_chunks, else project: relative
L2 of the summed output), a table (wall
us a layer over a compiled chain of layers, steps enqueued back to back) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import device_name, known_forms  # noqa: E402
from strata.mlx_backend.attention import rope_table_cached  # noqa: E402
from strata.mlx_backend.kernels import attend_project, attend_split, dense_gemv  # noqa: E402
from strata.mlx_backend.kernels import attention as attn_kernels  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, current_path, index_param, using_path  # noqa: E402
from strata.model_config import QKNorm  # noqa: E402
from strata.testing.mlx_params import SEED_SHAPE  # noqa: E402

SHAPE = replace(SEED_SHAPE, qk_norm=QKNorm.PER_HEAD)
SMALL = replace(SHAPE, hidden_size=256, n_heads=8, n_kv_heads=2, head_dim=64, max_context=320)
# name -> attend_split's (splits, rows a step) for the split forms; None: not attend_split
FORMS = {"project": None, "split": (None, None), "split_ns32": (32, None), "split_ns128": (128, None),
         "split_pb2": (None, 2), "split_pb5": (None, 5), "split_chunks": None}


def layer_inputs(cfg, length: int, seed: int, dtype=mx.float32) -> dict:
    """One layer's raw qkv row, q/k norms, W_o and KV buffers with random keys / values below length."""
    ks = mx.random.split(mx.random.key(seed), 6)
    h, kvh, hd, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_size
    shape = (kvh, cfg.max_context, hd)
    live = (mx.arange(cfg.max_context) < length)[None, :, None]
    arrays = {"qkv": mx.random.normal((1, (h + 2 * kvh) * hd), key=ks[0]),
              "q_norm": (1.0 + 0.1 * mx.random.normal((hd,), key=ks[1])).astype(mx.float16),
              "k_norm": (1.0 + 0.1 * mx.random.normal((hd,), key=ks[2])).astype(mx.float16),
              "wo": (mx.random.normal((d, h * hd), key=ks[3]) / np.sqrt(h * hd)).astype(mx.float16),
              "kc": mx.where(live, mx.random.normal(shape, key=ks[4]), 0.0).astype(dtype),
              "vc": mx.where(live, mx.random.normal(shape, key=ks[5]), 0.0).astype(dtype)}
    mx.eval(*arrays.values())
    return arrays


def attention_step(cfg, form: str, a: dict, pos: mx.array) -> mx.array:
    """One layer's attention by `form` -> its output [1, D] (the partials summed: the router's job)."""
    cos, sin = rope_table_cached(cfg)
    args = (a["qkv"], a["q_norm"], a["k_norm"], cos, sin, a["kc"], a["vc"])
    if form == "project":
        return attend_project.attend_project(*args, a["wo"], 0, cfg.rms_norm_eps, cfg.n_heads, pos=pos).sum(axis=1)
    if form == "split_chunks":
        o = attn_kernels.attend(*args, 0, cfg.rms_norm_eps, cfg.n_heads, pos=pos, split=True)
        return dense_gemv.dense_gemv(a["wo"], o)
    splits, rows = FORMS[form]
    return attend_split.attend_split_project(*args, a["wo"], 0, cfg.rms_norm_eps, cfg.n_heads, pos=pos,
                                             splits=splits, positions_per_step=rows).sum(axis=1)


def predicted_bytes(cfg, length: int, form: str) -> dict:
    """HBM bytes a layer: the context's keys and values, W_o, the split's partials (written, read)."""
    h, kvh, hd, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_size
    kv = 2 * kvh * (length + 1) * hd * 4
    if form == "split_chunks":
        ns = -(-cfg.max_context // attn_kernels.SPLIT_CHUNK)
    elif form == "project":
        ns = 0
    else:
        ns = FORMS[form][0] or attend_split.SPLITS
    return {"kv": kv, "wo": 2 * d * h * hd, "partials": 2 * 4 * h * ns * (hd + 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="the emulated kernels, a small head shape, 2 layers")
    ap.add_argument("--contexts", default="8,2048")
    ap.add_argument("--forms", default=",".join(FORMS), help="comma list of " + ", ".join(FORMS))
    ap.add_argument("--layers", type=int, default=48, help="layers in the timed chain (each its own cache and W_o)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--also", default="", help="more CONTEXT/FORM runs, e.g. 64/project,64/split")
    ap.add_argument("--ncu", action="store_true", help="3 launches of each form and context for ncu, no timing")
    args = ap.parse_args()
    cfg = SMALL if args.small else SHAPE
    forms = known_forms(ap, "--forms", [f for f in args.forms.split(",") if f], FORMS)
    path = KernelPath.EMULATED if args.small else current_path()
    if path is KernelPath.OPS:
        ap.error("no MLX GPU here (--small runs the emulated kernels)")
    n_layers = 2 if args.small or args.ncu else args.layers
    clamp = lambda c: min(int(c), cfg.max_context - 2)  # noqa: E731
    runs = [(clamp(c), f) for c in args.contexts.split(",") for f in forms]
    runs += [(clamp(a.split("/")[0]), a.split("/")[1]) for a in args.also.split(",") if a]
    known_forms(ap, "--also", [f for _, f in runs], FORMS)
    contexts = list(dict.fromkeys(c for c, _ in runs))
    res: dict = {"device": device_name(), "mlx": mx.__version__, "path": path.value, "layers": n_layers,
                 "heads": [cfg.n_heads, cfg.n_kv_heads, cfg.head_dim], "hidden": cfg.hidden_size,
                 "splits": attend_split.SPLITS, "split_chunk": attn_kernels.SPLIT_CHUNK, "runs": {}}
    rows = []
    with using_path(path):
        for ctx in contexts:
            layers = [layer_inputs(cfg, ctx, seed=1000 * ctx + l) for l in range(n_layers)]
            pos = index_param(ctx)
            ref, ref_form = None, None
            here = [f for c, f in runs if c == ctx]
            for form in sorted(here, key=lambda f: (f != "split_chunks", f != "project")):  # the reference first
                run = lambda: [attention_step(cfg, form, a, pos) for a in layers]  # noqa: E731
                out = np.array(run()[0])
                if ref is None:
                    ref, ref_form = out, form
                agree = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                if args.ncu:
                    for _ in range(2):
                        mx.eval(run())
                    print(f"context {ctx:>5} {form:<13} vs {ref_form}: rel L2 {agree:.1e}", flush=True)
                    continue
                step = mx.compile(lambda p: [attention_step(cfg, form, a, p) for a in layers]) if path is KernelPath.GPU \
                    else (lambda p: [attention_step(cfg, form, a, p) for a in layers])
                mx.eval(step(pos))  # the trace (and each kernel's JIT compile)
                reps = 2 if args.small else args.reps
                t0 = time.perf_counter()
                for _ in range(reps):
                    outs = step(pos)
                    mx.async_eval(outs)
                mx.eval(outs)
                us = (time.perf_counter() - t0) / reps / n_layers * 1e6
                b = predicted_bytes(cfg, ctx, form)
                res["runs"][f"{ctx}/{form}"] = {"us_per_layer": us, "rel_l2_vs": [ref_form, agree], "bytes": b}
                rows.append((f"context {ctx}, {form}", us, agree, b))
                print(f"context {ctx:>5} {form:<13} {us:8.2f} us a layer  vs {ref_form}: rel L2 {agree:.1e}", flush=True)
    if args.ncu:
        print("ncu launches done")
        return 0
    print(f"## decode attention alone on {res['device']} (path {path.value}, MLX {mx.__version__}; heads "
          f"{cfg.n_heads}/{cfg.n_kv_heads}x{cfg.head_dim}, D {cfg.hidden_size}; {n_layers} layers a chain, wall time "
          f"with steps back to back)")
    print(f"{'run':<30} {'us/layer':>9} {'rel L2':>9} {'KV MB':>7} {'W_o MB':>7} {'part. MB':>8}")
    for name, us, agree, b in rows:
        print(f"{name:<30} {us:9.2f} {agree:9.1e} {b['kv'] / 1e6:7.2f} "
              f"{b['wo'] / 1e6:7.2f} {b['partials'] / 1e6:8.3f}")
    print("JSON " + json.dumps(res, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
