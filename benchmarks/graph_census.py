"""The nodes of one decoded token's graph, counted without a GPU (issue 19: the host's work a token).

MLX's host work for a decoded token grows with the nodes of its graph (the compiled call replays
each one; `async_eval` evaluates each one) and with each custom kernel's outputs (every output is
its own allocation and argument). This builds one token's graph on the GPU kernel path, the
greedy selection included, as generate's pipelined loop pushes it, with every custom kernel
stood in by an `mx.depends` node on its inputs whose outputs are made beforehand (leaves, not
nodes). `launch` is the only function replaced, so everything strata builds around the kernels
is the real graph; the stood-in dialect picks the launches (CUDA chains phases, Metal does not).

    python3 benchmarks/graph_census.py                      # seed shape, 1 and 2 layers, CUDA
    python3 benchmarks/graph_census.py --dialect metal --forms default,pick
    python3 benchmarks/graph_census.py --context 2048        # the split attention's launches

Prints, per form, the kernel launches and their inputs and outputs by kernel, the other nodes by label, and
what one more layer adds; one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from _measure import known_forms  # noqa: E402
from decode_context import SHAPE, SMALL, SWITCHES, state_at, switched  # noqa: E402
from strata.mlx_backend import compiled  # noqa: E402
from strata.mlx_backend.greedy import greedy_select  # noqa: E402
from strata.mlx_backend.kernels import launch  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, using_path  # noqa: E402
from strata.mlx_backend.kernels.preludes import Dialect  # noqa: E402
from strata.mlx_backend.model import decode_device  # noqa: E402
from strata.testing.mlx_params import random_params  # noqa: E402

STAND_IN = "Depends"  # the label of a stood-in kernel's node


@contextlib.contextmanager
def stood_in(dialect: Dialect) -> Iterator[collections.Counter]:
    """Within: the GPU path as `dialect` sees it, each custom kernel an `mx.depends` node. Yields
    a Counter of (kernel name, "launches" | "outputs") filled as kernels are launched."""
    counts: collections.Counter = collections.Counter()
    leaves: dict = {}

    def build(src):
        def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            counts[src.name, "launches"] += 1
            counts[src.name, "outputs"] += len(output_shapes)
            counts[src.name, "inputs"] += len(inputs)
            outs = []
            for shape, dtype in zip(output_shapes, output_dtypes):
                key = (tuple(shape), dtype)
                if key not in leaves:  # evaluated once: a leaf of the graph, not a node
                    leaves[key] = mx.zeros(key[0], dtype)
                    mx.eval(leaves[key])
                outs.append(leaves[key])
            return mx.depends(outs, list(inputs))
        return kernel

    # every strata module that took gpu_dialect by name answers `dialect` too
    original = launch.gpu_dialect
    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("strata") and getattr(m, "gpu_dialect", None) is original]
    saved = launch._build, launch._kernels
    launch._build, launch._kernels = build, {}
    for m in holders:
        m.gpu_dialect = lambda: dialect
    try:
        yield counts
    finally:
        launch._build, launch._kernels = saved
        for m in holders:
            m.gpu_dialect = original


def census(cfg, dialect: Dialect, form: str = "default", context: int = 8) -> dict:
    """One decoded token at `context` positions (logits and the greedy selection), counted."""
    p = random_params(cfg, seed=0, pred_q8=False)
    state = state_at(cfg, context, seed=8)
    # mx.compile off: a function compiled by strata (the greedy selection) would otherwise replay
    # the stand-in it traced in an earlier census, a node no launch counted here
    mx.disable_compile()
    try:
        return _census(p, state, dialect, form, context)
    finally:
        mx.enable_compile()


def _census(p, state, dialect: Dialect, form: str, context: int) -> dict:
    with stood_in(dialect) as counts, using_path(KernelPath.GPU), switched(form):
        views = launch.constant_views(compiled._constant_arrays(p, state))
        with launch.using_constant_views(views):
            logits, _ = decode_device(p, state, compiled.device_ids(1), launch.index_param(context))
            selection = greedy_select(logits)
        with tempfile.TemporaryDirectory() as td:
            dot = Path(td) / "token.dot"
            mx.export_to_dot(str(dot), selection)
            labels = collections.Counter(re.findall(r'label\s*=\s*"([^"]*)"', dot.read_text()))
    kernels = {name: {"launches": counts[name, "launches"], "inputs": counts[name, "inputs"],
                      "outputs": counts[name, "outputs"]} for name, what in counts if what == "launches"}
    launches = sum(k["launches"] for k in kernels.values())
    if labels[STAND_IN] != launches:
        raise AssertionError(f"graph_census: {labels[STAND_IN]} stood-in nodes for {launches} launches")
    other = {k: v for k, v in labels.most_common() if k != STAND_IN}
    return {"layers": len(state.layers), "launches": launches, "inputs": sum(k["inputs"] for k in kernels.values()),
            "outputs": sum(k["outputs"] for k in kernels.values()),
            "other_nodes": sum(other.values()), "kernels": kernels, "other": other}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: python3 benchmarks/graph_census.py --layers 1,2 --forms default,pick")
    ap.add_argument("--layers", default="1,2", help="two layer counts: what one more layer adds (default 1,2)")
    ap.add_argument("--dialect", choices=("cuda", "metal"), default="cuda", help="the GPU dialect stood in")
    ap.add_argument("--forms", default="default", help="comma list: default or decode_context's switched forms")
    ap.add_argument("--small", action="store_true", help="decode_context's small shape (the seed shape's layer kinds)")
    ap.add_argument("--context", type=int, default=8, help="positions before the decoded token (default 8; past 256 "
                                                           "the attention splits by chunks)")
    args = ap.parse_args()
    counts = [int(x) for x in args.layers.split(",") if x]
    if len(counts) != 2 or counts[0] >= counts[1] or counts[0] < 1:
        ap.error("--layers: two layer counts, the first smaller, e.g. 1,2")
    forms = [f for f in args.forms.split(",") if f]
    known_forms(ap, "--forms", [f for f in forms if f != "default"], SWITCHES)
    dialect = Dialect.CUDA if args.dialect == "cuda" else Dialect.METAL
    base = SMALL if args.small else SHAPE
    out = {}
    for form in forms:
        lo, hi = (census(replace(base, n_layers=n), dialect, form, args.context) for n in counts)
        per_layer = {k: (hi[k] - lo[k]) / (counts[1] - counts[0]) for k in ("launches", "inputs", "outputs", "other_nodes")}
        token = {k: lo[k] + per_layer[k] * (SHAPE.n_layers - counts[0]) for k in per_layer}
        out[form] = {"at": {counts[0]: lo, counts[1]: hi}, "per_layer": per_layer,
                     f"token_at_{SHAPE.n_layers}_layers": token}
        print(f"## {form} ({args.dialect}, context {args.context}): a layer adds {per_layer['launches']:g} launches with "
              f"{per_layer['inputs']:g} inputs, {per_layer['outputs']:g} outputs and {per_layer['other_nodes']:g} "
              f"other nodes; a token at {SHAPE.n_layers} layers: {token['launches']:g} launches, "
              f"{token['inputs']:g} inputs, {token['outputs']:g} outputs, {token['other_nodes']:g} other nodes")
        print("| kernel | launches | inputs | outputs |\n|---|---|---|---|")
        for name, k in hi["kernels"].items():
            print(f"| {name} | {k['launches']} | {k['inputs']} | {k['outputs']} |")
        print("| other node | count |\n|---|---|")
        for label, n in hi["other"].items():
            print(f"| {label} | {n} |")
    print("JSON " + json.dumps({"bench": "graph_census", "dialect": args.dialect, "layers": counts, "context": args.context,
                                "forms": out}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
