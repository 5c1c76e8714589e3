"""The kernel source bytes MLX's CUDA build hashes for a decoded token: each launch's CUDA source as
MLX receives it (`source.full_source`), by kernel, per layer, in each decode form. MLX hashes a
custom kernel's whole source on every evaluation (~0.17 us a KB on the H200), so this is a part of
a token's host cost that needs no GPU to count. Seed shape's layer (hidden 2560, 16 / 4 heads of
128, expert ffn 576; fewer experts and a smaller vocabulary: neither changes a source's size), two
layers, emulated: each kernel's source size inline and with its header and body included
(`included_source.py`, the default on CUDA; the files written to a temporary directory here), and
its launches in the token; a table and one JSON line.

    python3 benchmarks/source_bytes.py                     # default and all_cuts
    python3 benchmarks/source_bytes.py --forms default,deferred,ranked
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import known_forms  # noqa: E402
from decode_context import SWITCHES, switched  # noqa: E402
from strata.mlx_backend import model as mlx_model  # noqa: E402
from strata.mlx_backend.kernels import included_source  # noqa: E402
from strata.mlx_backend.kernels.folded_outputs import FOLDED  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path  # noqa: E402
from strata.mlx_backend.kernels.preludes import Dialect  # noqa: E402
from strata.mlx_backend.kernels.source import full_source, mlx_source  # noqa: E402
from strata.testing.mlx_params import SEED_SHAPE, random_params  # noqa: E402

LAYERS = 2


def included_bytes(src, inline: int) -> int:
    """What MLX hashes of a source `inline` bytes long when its header and body are includes."""
    header, body = mlx_source(src, Dialect.CUDA)
    with tempfile.TemporaryDirectory() as d:
        saved = included_source._dir[:]
        included_source._dir[:] = [Path(d)]
        try:
            h, b = included_source.included(header, body, src.inputs)
        finally:
            included_source._dir[:] = saved
    return inline - len(header) - len(body) + len(h) + len(b)


def token_bytes(form: str) -> dict[str, tuple[int, int, int]]:
    """One decoded token (after a prompt of 3): by kernel, (its CUDA source's bytes inline, with its
    header and body included, its launches).
    A kernel launched with some outputs folded into one buffer (folded_outputs.py) is a source of
    its own, `<name> (outputs folded)`: with the deferred down step the last layer's gate/up is
    folded and the others' are not."""
    cfg = replace(SEED_SHAPE, n_layers=LAYERS, shared_ffn_size=0, vocab_size=4096, n_experts=64)
    p = random_params(cfg, seed=0, pred_q8=False)
    with using_path(KernelPath.EMULATED), switched(form):
        _, state = mlx_model.forward(p, mlx_model.MlxModelState.empty(cfg), np.array([1, 2, 3]))
        with recording(every=True) as seen:
            logits, _ = mlx_model.forward(p, state, np.array([4]))
            mx.eval(logits)
    size: dict[str, int] = {}
    included: dict[str, int] = {}
    launches: collections.Counter = collections.Counter()
    for src, ins, outs, template in seen:
        name = src.name + (" (outputs folded)" if FOLDED in src.outputs else "")
        n = len(full_source(src, Dialect.CUDA, ins, outs, template))
        if size.setdefault(name, n) != n:
            raise SystemExit(f"source_bytes: {name} ran in specialisations of different sizes")
        if name not in included:
            included[name] = included_bytes(src, n)
        launches[name] += 1
    return {name: (n, included[name], launches[name]) for name, n in size.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: python3 benchmarks/source_bytes.py --forms default,all_cuts")
    ap.add_argument("--forms", default="default,all_cuts", help="comma list: default and decode_context's forms")
    args = ap.parse_args()
    forms = known_forms(ap, "--forms", [f for f in args.forms.split(",") if f and f != "default"], SWITCHES)
    forms = (["default"] if "default" in args.forms.split(",") else []) + forms
    res = {}
    print(f"| form | kernel | source bytes inline | included | launches in a {LAYERS}-layer token |\n"
          "|---|---|---|---|---|")
    for form in forms:
        by_kernel = token_bytes(form)
        for name, (n, inc, launches) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0]):
            print(f"| {form} | {name} | {n} | {inc} | {launches} |")
        res[form] = {name: {"bytes": n, "included_bytes": inc, "launches": k}
                     for name, (n, inc, k) in by_kernel.items()}
    print("JSON " + json.dumps({"bench": "source_bytes", "layers": LAYERS, "forms": res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
