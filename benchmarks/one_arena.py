"""One arena for expert records and PLE pages against today's two caches, by replay.

    python benchmarks/one_arena.py [--tokens 512] [--record-bytes made|seed|N] [--budgets 0.25,0.5]

A made Qwen4-Exp model (the `qwen4` shape widened: 8 layers, 6 DeltaNet of which 4 carry PLE,
64 experts top-8, 8 n-gram heads of 64-wide rows) is traced over a text (docs/*.md as byte
tokens, in windows of its context); its n-gram hash gives each token's PLE pages in a row
store's layout (F16 rows, 4 KiB pages). strata.tools.one_arena replays the trace under one byte
budget shared by records and pages (`combined`: one LRU with byte weights; `combined, used pages
last`: a used PLE page becomes the first victim) and under today's split (`ple_reserve` of N
positions' pages, the rest whole records) at the same total bytes. Per token: expert misses
(urgent reads), PLE waits (pages read at use, not before layer 0), PLE pages read, bytes read.

--record-bytes: `made` (the made model's own Q2_0 records, about a page each), `seed` (the
reference engine's shape: a Q2_0 record of hidden 2560 x ffn 576, 1.38 MB; PLE pages are then
~0.2% of the bytes a token looks up, as in that shape) or a number. Budgets are fractions of
all records' bytes. Prints a table per record size and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLE_POSITIONS = (1, 16, 64, 256)  # today's reserve in positions of pages; 64 is the default
PREFETCH_DEPTH = 10  # the stock read-ahead


def made_model(path: Path):
    from strata.model_config import Ffn, LayerType, Mixer
    from strata.testing.models import make_model

    kinds = ((LayerType(Mixer.DELTANET, Ffn.MOE),) * 3 + (LayerType(Mixer.INDEXED_ATTENTION, Ffn.MOE),)) * 2
    return make_model(path, "qwen4", 0, n_layers=8, layer_types=kinds, n_experts=64, n_experts_per_token=8,
                      ple_layer_ids="0,2,4,6", ngram_heads_per_order=4, ple_embed_dim=512, ngram_vocab_base=10007)


def trace_text(made, n_tokens: int):
    """The λ = 0 selections and ranked read-ahead guesses over docs/*.md byte tokens, in windows of
    the model's context (one reference forward each)."""
    from strata.loader import load
    from strata.tools.quality import fast_params
    from strata.tools.trace import record_trace

    text = b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
    tokens = np.frombuffer(text[:n_tokens], np.uint8).astype(np.int64)
    params = fast_params(load(made.model_path).resident_params())
    window = made.cfg.max_context
    selected, guesses = [], []
    for i in range(0, len(tokens), window):
        tr = record_trace(params, tokens[i:i + window], decode_order=False)
        g = np.zeros(tr.selected.shape[:2] + (PREFETCH_DEPTH,), np.int64)
        g[:, :-1] = np.argsort(-tr.guess_logits(1), axis=-1, kind="stable")[..., :PREFETCH_DEPTH]
        selected.append(tr.selected)
        guesses.append(g)
    return tokens, np.concatenate(selected), np.concatenate(guesses)


def record_bytes_for(choice: str, made) -> int:
    from strata.formats.expert_record import RecordLayout
    from strata.formats.experts_file import ExpertsFile
    from strata.formats.quant_types import QuantType

    if choice == "made":
        with ExpertsFile.open(made.experts_path) as xf:
            return xf.header.padded_bytes
    if choice == "seed":
        return RecordLayout(QuantType.Q2_0, 2560, 576).padded_bytes
    return int(choice)


def run(args) -> dict:
    from strata.errors import ArenaTooSmallError
    from strata.families.qwen4_exp import ple_layers
    from strata.formats.ngram_rows_file import PAGE_BYTES, store_layout
    from strata.formats.quant_types import QuantType
    from strata.ple_store import table_shapes
    from strata.runtime.ngram_source import rows_per_position
    from strata.tools.one_arena import ple_pages_per_token, simulate

    t0 = time.perf_counter()
    made = made_model(Path(args.out) / "one_arena")
    cfg = made.cfg
    tokens, selected, guesses = trace_text(made, args.tokens)
    pages = ple_pages_per_token(cfg, tokens, store_layout(QuantType.F16, PAGE_BYTES, table_shapes(cfg)))
    trace_s = time.perf_counter() - t0
    L, E = selected.shape[1], cfg.n_experts
    per_position = rows_per_position(cfg)
    results = []
    for choice in args.record_bytes.split(","):
        record = record_bytes_for(choice, made)
        for fraction in (float(f) for f in args.budgets.split(",")):
            budget = int(fraction * L * E * record)
            layouts = [("combined", None, False), ("combined, used pages last", None, True)]
            layouts += [(f"separate, ple_reserve {n} positions", (n * per_position + 1) * PAGE_BYTES, False)
                        for n in PLE_POSITIONS]
            for name, ple_bytes, last in layouts:
                row = dict(record=choice, record_bytes=record, budget_fraction=fraction, budget=budget, layout=name,
                           ple_bytes=ple_bytes)
                try:
                    c = simulate(selected, guesses, pages, record_bytes=record, page_bytes=PAGE_BYTES, budget=budget,
                                 ple_bytes=ple_bytes, ple_layers=ple_layers(cfg), prefetch_depth=PREFETCH_DEPTH,
                                 used_pages_last=last)
                    row.update(c.per_token())
                except ArenaTooSmallError:  # the reserve leaves the experts less than a window's pins
                    row.update(misses=None)
                results.append(row)
    return dict(bench="one_arena", tokens=len(tokens), layers=L, experts=E, top_k=cfg.n_experts_per_token,
                ple_layers=list(ple_layers(cfg)), ple_pages_per_token=per_position, page_bytes=PAGE_BYTES,
                prefetch_depth=PREFETCH_DEPTH, seconds=time.perf_counter() - t0, trace_seconds=trace_s,
                results=results)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="text tokens traced (default 512)")
    ap.add_argument("--record-bytes", default="made,seed", help="made, seed or bytes; comma-separated (default both)")
    ap.add_argument("--budgets", default="0.25,0.5", help="budgets as fractions of all records' bytes")
    ap.add_argument("--out", default="/tmp/strata_one_arena", help="where the made model is written")
    args = ap.parse_args(argv)
    try:
        fractions = [float(f) for f in args.budgets.split(",")]
        for choice in args.record_bytes.split(","):
            if choice not in ("made", "seed") and int(choice) < 1:
                raise ValueError
    except ValueError:
        ap.error("--budgets takes fractions like 0.25,0.5; --record-bytes takes made, seed or a positive number")
    if not all(0 < f <= 1 for f in fractions) or args.tokens < 2:
        ap.error("--budgets: fractions in (0, 1]; --tokens: at least 2")
    out = run(args)
    print(f"one arena vs two caches: {out['tokens']} tokens, {out['layers']} layers x {out['experts']} experts "
          f"top-{out['top_k']}, PLE on layers {out['ple_layers']} ({out['ple_pages_per_token']} pages a token), "
          f"read-ahead {out['prefetch_depth']}")
    head = f"  {'record':>9} {'budget':>7} {'layout':<36}{'misses/tok':>11}{'PLE waits/tok':>14}" \
           f"{'PLE reads/tok':>14}{'MB read/tok':>12}"
    print(head)
    for r in out["results"]:
        if r["misses"] is None:
            print(f"  {r['record_bytes']:>9} {r['budget_fraction']:>7.0%} {r['layout']:<36}  does not fit (the reserve "
                  "leaves the experts less than a window's pins)")
            continue
        print(f"  {r['record_bytes']:>9} {r['budget_fraction']:>7.0%} {r['layout']:<36}{r['misses']:>11.3f}"
              f"{r['ple_waits']:>14.3f}{r['ple_reads']:>14.3f}{r['bytes'] / 1e6:>12.4f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
