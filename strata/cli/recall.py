"""`strata recall TRACE`: how well the read-ahead guess predicts the next layers' experts."""

from __future__ import annotations

import argparse

HELP = """\
Recall of the read-ahead guess W_router(l+a)·h(l), made after layer l, against layer l+a's real
(λ = 0) selection, for a = 1 and 2: recall@K of the real top-k, the real top-1 in the guessed
top-K, and the real routing weight the top-K covers. A tier-2 trace holds the guesses its gate
modules gave (no weights: its weight recall is n/a).

example:
  strata recall t.npz --K 10,16,32 -o /tmp/recall.json"""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="read-ahead recall of a trace", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="trace file from `strata trace`")
    p.add_argument("--K", dest="K", default="10,16,32", help="guess depths (default 10,16,32)")
    p.add_argument("--q8", action="store_true", help="guess on the Q8_0 copy of the routers (the runtime's pred_q8)")
    p.add_argument("--warmup", type=int, default=0, help="skip the first N tokens")
    p.add_argument("-o", "--output", help="write the results as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json

    from strata.tools.options import parse_list
    from strata.tools.recall import readahead_recall
    from strata.tools.tables import recall_rows, table
    from strata.tools.trace import load_trace

    trace = load_trace(args.trace)
    from strata.errors import ConfigError

    if args.q8 and trace.family_routing:
        raise ConfigError("--q8: this tier-2 trace recorded the read-ahead scores its gate modules gave (the "
                          "runtime's own guesses); there is no Q8_0 router copy on tier 2: leave --q8 off")
    ks = parse_list(args.K, int, "--K")
    bad = [k for k in ks if not 1 <= k <= trace.n_experts]
    if bad or not ks:
        raise ConfigError(f"--K {bad[0] if bad else args.K!r}: a guess depth is between 1 and the trace's "
                          f"{trace.n_experts} experts (K = 0 guesses nothing: there is no recall to measure)")
    results = [readahead_recall(trace, ks, ahead=a, warmup=args.warmup, pred_q8=args.q8) for a in (1, 2)]
    print(f"{trace.n_tokens} tokens x {trace.n_layers} layers, top-{trace.top_k} of {trace.n_experts}")
    print(table(*recall_rows([r for r in results if r.pairs])))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"trace": str(args.trace), "results": [r.to_json() for r in results]}, f, indent=1)
        print(f"wrote {args.output}")
    return 0
