"""Where a chained launch's time goes: each block's ticket, its wait met and its end on the GPU's
global clock, by phase (kernels/phases.py `stamping`).

ncu gives a chain's whole time (~27-30 us a layer at context 8 for 29 MB of weights, which copy
speed moves in ~9 us) but not which phase holds it up: the QKV walk's rounds, the attention
blocks' wait for their group, W_o, or the router's tail after the last partial. Here the decode
chain of `attention.attention_router` runs for `--layers` layers back to back in one evaluation
(each layer's x the one before's x_mid, so the launches queue as in decode), every block stamping
when it took its ticket, when its wait was met and when its body ended; with --layer, whole
decoded layers (`model.layer_forward`: the chain, then the expert step's gate/up and down, each
stamped too). Per launch kind and phase, over the launches after the first: its blocks' tickets,
waits met and ends (median and last, us after the launch's first ticket, on the global clock),
each block's wait and body in its SM's cycles (exact where the global clock is coarse); between
launches, the gap from one launch's last end to the next one's first ticket; with --marks, thread
0's cycles at places inside the walk, the attention, the split attention and the expert step
(MARKS, from its wait); and whether the last layer's outputs are bit for bit the first form's at
the same context (forms that change no values).

    python3 benchmarks/chain_timeline.py --contexts 8,2048 --forms default,split_chain

Seed shape without a shared expert; --small: a smoke test's shape on the emulator (its clock
counts stamps, not time). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _decode_kernels import SHAPE, SMALL  # noqa: E402
from _measure import device_name, kernel_bench_path  # noqa: E402
from decode_context import FORMS, switched  # noqa: E402
from strata.mlx_backend.attention import MlxLayerKV, attention_router, routes_with_attention  # noqa: E402
from strata.mlx_backend.kernels import attend_project, phases  # noqa: E402
from strata.mlx_backend.kernels.launch import using_path  # noqa: E402
from strata.mlx_backend.model import layer_forward  # noqa: E402
from strata.testing.mlx_params import random_params  # noqa: E402

# --marks: places in a phase's body (a text there once) where thread 0 stamps its cycles as it
# first passes, by phase kernel name: (label, the text the mark goes before)
MARKS = {
    "strata_qkv_groups": (("x staged and normed", "  for (int g = 0; g < KVH; ++g) {\n"),),
    "strata_attend_project_sum": (("attention made", attend_project.W_O_PROJECT),
                                  ("W_o's rows summed", attend_project.SUM_EPILOGUE)),
    "strata_attend_split_chained": (
        ("q's row asked", "  if (qwarp) {  // attend's code"),
        ("q normed and rotated", "  for (int ni = 0; ni < NEWMAX; ++ni) {  // ni: not i, which attend's pieces use\n"
                                 "    const int32_t p = nlo + (0) * NEWMAX + ni;"),
        ("the new position made", "  BARRIER();\n  float qv[HPB][EPL]"),
        ("the first step's rows scored", "    p0 += NW * PB;\n"),
        ("the cached rows scored", "  // the chunk's own positions, NEWMAX a round"),
        ("the new rows scored", "  // the warps merged in a fixed order"),
        ("the merge's barrier passed", "  for (uint32_t x = tid; x < (uint32_t)(HPB * HD); x += NT) {")),
    # the expert step (--layer): gate/up's ranking (z staged, the warps' sorts, the count; Ranking.BITONIC),
    # its loads issued, x staged; down's codes issued, its sums done (a warp's), the rows' sums over
    # the experts
    "strata_moe_gateup": (("z staged", "  if (ROUNDS == 4) {\n"),
                          ("the warps' sorts written", "    constexpr int NCAND = NCH32 * K;\n"),
                          ("the candidates counted", "  } else if (ROUNDS) {\n"),
                          ("ranked (the slot known)", "  const uint32_t c = rb % NCH;\n"),
                          ("gate/up codes asked", "  if (WE) {"),
                          ("x staged", "  float ga[UPW], ua[UPW];")),
    "strata_moe_down_warps": (("codes asked", "  float sp[SPW];\n"),
                              ("a warp's sums done", "  UNROLL for (int m = RB; m < 32; m <<= 1) acc +="),
                              ("summed over the experts", "  if (tid < (uint32_t)RB) {")),
}


def phase_rows(stamps: np.ndarray, starts: tuple[int, ...]) -> list[dict]:
    """One launch's stamps [blocks, STAMP_WORDS] (phases.ChainStamps) -> per phase: its blocks,
    the SMs they ran on, (median, last) of each moment in us after the launch's first ticket on
    the global clock, and (median, max) of each block's wait and body in its SM's kilocycles."""
    t = stamps[:, :3].astype(np.uint32)
    rel = (t - t[:, 0].min()).astype(np.int64) / 1000.0  # uint32 differences: right across the clock's wrap
    cyc = stamps[:, 3:5].astype(np.int64)
    cyc = np.stack([cyc[:, 0], cyc[:, 1] - cyc[:, 0]], axis=1) / 1000.0  # the wait, then the body after it
    rows = []
    stats = (("median", np.median), ("last", np.max))
    for i in range(len(starts) - 1):
        at = slice(starts[i], starts[i + 1])
        # mark k at index k, None where no block passed it (a form whose body skips that place)
        marks = [float(np.median((stamps[at, 6 + k].astype(np.int64) - stamps[at, 3].astype(np.int64)) / 1000.0))
                 if stamps[at, 6 + k].any() else None for k in range(phases.MAX_MARKS)]
        rows.append({"blocks": starts[i + 1] - starts[i], "sms": int(len(np.unique(stamps[at, 5]))),
                     "marks_kcyc_median": marks,
                     **{f"{m}_{s}": float(f(rel[at, k])) for k, m in enumerate(("ticket", "waited", "ended"))
                        for s, f in stats},
                     **{f"{m}_kcyc_{s}": float(f(cyc[at, k])) for k, m in enumerate(("wait", "body"))
                        for s, f in stats}})
    return rows


def launch_span(stamps: np.ndarray) -> tuple[int, int]:
    """(first ticket, last end) of one launch, uint32 ns."""
    return int(stamps[:, 0].min()), int(stamps[:, 2].max())


def kind_rows(launches: list) -> dict:
    """The launches of one kind (the same phases), the first left out where there are more: the
    median launch (first ticket to last end, us) and each phase's medians over them."""
    use = launches[1:] or launches
    per = [phase_rows(np.array(c.stamps), c.starts) for c in use]
    lens = [((e - b) % 2 ** 32) / 1000.0 for b, e in (launch_span(np.array(c.stamps)) for c in use)]
    out = []
    for i, name in enumerate(launches[0].phases):
        rows = [r[i] for r in per]
        out.append({"phase": name, "blocks": rows[0]["blocks"], "sms": rows[0]["sms"],
                    **{k: float(np.median([r[k] for r in rows])) for k in rows[0] if k.endswith(("median", "last"))
                       and k != "marks_kcyc_median"},
                    "marks": [[label, float(np.median(passed))]
                              for k, (label, _) in enumerate(MARKS.get(name, ()))
                              if (passed := [r["marks_kcyc_median"][k] for r in rows
                                             if r["marks_kcyc_median"][k] is not None])]})
    return {"launches": len(launches), "launch_us": float(np.median(lens)), "phases": out}


def run(form: str, context: int, layers: int, small: bool, marks: bool = False, whole: bool = False) -> dict:
    """The timeline of `layers` decoded layers back to back: their chained attention launches, or
    (whole) each whole layer (`layer_forward`: the chain, then the expert step's launches)."""
    cfg = replace(SMALL if small else SHAPE, n_layers=layers)
    if context + 1 > cfg.max_context:
        return {"error": f"context {context} leaves no room for a token in the shape's {cfg.max_context} positions"}
    p = random_params(cfg, seed=0, pred_q8=False)
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)) + 0
    kvs = []
    for _ in range(layers):
        kv = MlxLayerKV.empty(cfg)
        kvs.append(MlxLayerKV(kv.keys, kv.values, context))
    with switched(form):
        lw0 = p.layers[0]
        if not routes_with_attention(cfg, lw0.attn, kvs[0], 1):
            return {"error": f"no chained attention + router at context {context} in form {form}"}
        for rep in range(2):  # the first evaluation holds the builds; the second is measured
            with phases.stamping({k: [a for _, a in v] for k, v in MARKS.items()} if marks else None) as rec:
                h, z = x, x
                for layer, lw in enumerate(p.layers):
                    if whole:
                        h, _ = layer_forward(p, layer, kvs[layer], h)
                    else:
                        h, _, z, _ = attention_router(cfg, lw.attn, kvs[layer], h, lw.ffn_norm, lw.router)
                mx.eval(h, z)
            launches = rec
    out_bytes = np.array(h).tobytes() + np.array(z).tobytes()  # the last layer's: each form's bits against the first's
    kinds: dict[tuple, list] = {}
    for c in launches:
        kinds.setdefault(c.phases, []).append(c)
    spans = [launch_span(np.array(c.stamps)) for c in launches]
    gaps: dict[str, list] = {}
    for a, b, ca, cb in zip(spans, spans[1:], launches, launches[1:]):
        gaps.setdefault(f"{_kind_name(ca.phases)} -> {_kind_name(cb.phases)}", []).append(((b[0] - a[1]) % 2 ** 32) / 1000.0)
    return {"outputs": hashlib.sha256(out_bytes).hexdigest()[:16], "launches": len(launches),
            "kinds": {_kind_name(k): kind_rows(v) for k, v in kinds.items()},
            "gaps_us": {k: float(np.median(v)) for k, v in gaps.items()}}


def _kind_name(kind: tuple) -> str:
    return " + ".join(n.removeprefix("strata_") for n in kind)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="example: python3 benchmarks/chain_timeline.py --contexts 8,2048 "
                                        "--forms default,split_chain")
    ap.add_argument("--contexts", default="8,2048", help="comma list of cached positions before the token")
    ap.add_argument("--forms", default="default", help="comma list of default and decode_context.py's forms "
                    "(the module switches they flip; e.g. split_chain)")
    ap.add_argument("--layers", type=int, default=8, help="launches back to back (the first not counted)")
    ap.add_argument("--small", action="store_true", help="the smoke test's shape (the emulator off the GPU)")
    ap.add_argument("--layer", action="store_true",
                    help="whole decoded layers (the chain, then the expert step's launches, each stamped), not "
                         "only the chains: each launch kind's phases and the gaps between launches")
    ap.add_argument("--marks", action="store_true",
                    help="thread 0 also stamps its cycles at places inside the walk, the attention, the split "
                         "attention and (with --layer) the expert step's launches (MARKS), printed after the wait")
    args = ap.parse_args()
    forms = [f for f in args.forms.split(",") if f]
    bad = [f for f in forms if f != "default" and f not in FORMS]
    if bad:
        ap.error(f"unknown form(s) {bad}; known: default, {', '.join(FORMS)}")
    if args.layers < 2:
        ap.error("--layers must be at least 2 (the first launch is not counted)")
    path = kernel_bench_path(args.small)
    if path is None:
        return 1
    res: dict = {"bench": "chain_timeline", "device": device_name(), "path": path.value, "layers": args.layers,
                 "runs": {}}
    with using_path(path):
        for form in forms:
            for ctx in (int(c) for c in args.contexts.split(",") if c):
                got = run(form, ctx, args.layers, args.small, args.marks, args.layer)
                res["runs"][f"{form}@{ctx}"] = got
                if "error" in got:
                    print(f"{form} at context {ctx}: {got['error']}")
                    continue
                first = next(r for k, r in res["runs"].items() if k.endswith(f"@{ctx}") and "outputs" in r)
                got["same_bits_as_first_form"] = got["outputs"] == first["outputs"]
                print(f"{form} at context {ctx}: {got['launches']} launches; the outputs bit for bit the first "
                      f"form's: {got['same_bits_as_first_form']}")
                for kind, k in got["kinds"].items():
                    print(f"  {kind}: {k['launches']} launches, {k['launch_us']:.1f} us from the first ticket to the "
                          f"last end")
                    print(f"    {'phase':<34} {'blocks':>6} {'SMs':>4}  ticket med/last  waited med/last   "
                          "ended med/last (us)   wait / body med/max (kcycles)")
                    for ph in k["phases"]:
                        print(f"    {ph['phase']:<34} {ph['blocks']:>6} {ph['sms']:>4}  "
                              f"{ph['ticket_median']:6.1f} {ph['ticket_last']:6.1f}   {ph['waited_median']:6.1f} "
                              f"{ph['waited_last']:6.1f}   {ph['ended_median']:6.1f} {ph['ended_last']:6.1f}   "
                              f"{ph['wait_kcyc_median']:6.1f} {ph['wait_kcyc_last']:6.1f} / "
                              f"{ph['body_kcyc_median']:6.1f} {ph['body_kcyc_last']:6.1f}")
                        if ph["marks"]:
                            print("        from the wait (kcycles, median): "
                                  + ", ".join(f"{m} {v:.1f}" for m, v in ph["marks"]))
                print("  from one launch's last end to the next one's first ticket (us, median): "
                      + "; ".join(f"{k} {v:.1f}" for k, v in got["gaps_us"].items()))
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
