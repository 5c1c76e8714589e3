"""The per-token cost of a pipeline's stage hand-off, measured on local ranks (ring, 127.0.0.1).

    python benchmarks/pipeline_handoff.py [--tokens 16] [--rounds 200]

Three parts, a table and one JSON line:
1. ping: one Link message (header + [1, D] or [1, V] float32) there and back between two ranks,
   for the embedded model's D and V and for a 30B-A3B-class model's (D 2048, V 151936): the
   per-hop latency and the loopback's bytes/s;
2. run: a 2-rank pipeline decoding the embedded model, every rank at its smallest arena: per token
   the bytes each hop carries and the time each rank spends sending and waiting;
3. boundary: the read-ahead the first MoE layer of a later stage does not get (the guess is
   skipped): urgent reads per token at that layer, on the pipeline's stage vs the same layer in one
   process with the same total arena (in-process stages, numpy, λ = 0).
This 2-core machine says nothing about speed; docs/pipeline.md turns the bytes and message
counts into a prediction for two Macs on Thunderbolt from published link figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = {"embedded D": 256, "embedded V": 2048, "30B-A3B D": 2048, "30B-A3B V": 151936}


def _ping_rank(rounds: int, out: str) -> int:
    """Rank 0 sends each size to rank 1 and back `rounds` times; rank 0 writes the timings."""
    from strata.pipeline.transport import FLOAT32, Header, connect

    link = connect(timeout=60)
    other, res = 1 - link.rank, {}
    for name, cols in SIZES.items():
        x = np.zeros((1, cols), np.float32)
        head = Header(1, 0, 1, cols, FLOAT32)
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            if link.rank == 0:
                link.send(other, head, x, timeout=60)
                link.recv(other, timeout=60)
            else:
                h, y = link.recv(other, timeout=60)
                link.send(other, h, y, timeout=60)
            times.append(time.perf_counter() - start)
        res[name] = {"bytes": int(x.nbytes + 48), "one_way_us": 1e6 * float(np.median(times)) / 2}
    if link.rank == 0:
        Path(out).write_text(json.dumps(res))
    return 0


def ping(rounds: int) -> dict:
    from strata.testing.pipeline import spawn_ranks

    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/ping.json"
        ranks = spawn_ranks(2, [sys.executable, __file__, "--ping-rank", out, "--rounds", str(rounds)], timeout=300)
        if any(r.returncode for r in ranks):
            raise SystemExit("\n".join(r.output for r in ranks))
        return json.loads(Path(out).read_text())


def run(tokens: int) -> dict:
    from strata.default_model import EMBEDDED
    from strata.testing.pipeline import spawn_ranks

    with tempfile.TemporaryDirectory() as d:
        spec = dict(model=str(EMBEDDED), config=dict(backend="numpy", moce_lambda=0.0), arenas=["min", "min"],
                    prompt=list(b"def fibonacci(n):"), max_tokens=tokens, out=f"{d}/r0.npz")
        Path(f"{d}/spec.json").write_text(json.dumps(spec))
        ranks = spawn_ranks(2, [sys.executable, "-m", "strata.testing.pipeline", f"{d}/spec.json"], timeout=300)
        if any(r.returncode for r in ranks):
            raise SystemExit("\n".join(r.output for r in ranks))
        return json.loads(str(np.load(f"{d}/r0.npz")["report"]))


def _urgent_by_layer(engine, first: int) -> np.ndarray:
    """Urgent reads per MoE layer (local index) among the cache's decisions from `first` on."""
    from strata.cache.types import Read

    counts = np.zeros(engine.cache_config.n_layers, np.int64)
    for a in engine.streamer.decisions[first:]:
        if isinstance(a, Read) and a.urgent:
            counts[a.layer] += 1
    return counts


def boundary(tokens: int) -> dict:
    import strata
    from strata.config import Backend, Config
    from strata.default_model import EMBEDDED
    from strata.pipeline.plan import plan_stages
    from strata.pipeline.stage import open_stage
    from strata.testing.engines import open_numpy_streaming

    conf = Config(backend=Backend.NUMPY, moce_lambda=0.0)
    full = strata.load(EMBEDDED)
    plan = plan_stages(full.cfg, 2, expert_bytes=full.experts_file.header.padded_bytes)
    stages = [open_stage(strata.load(EMBEDDED, layers=s), conf, s, arena="min", keep_trace=True) for s in plan.stages]
    total = sum(e.arena.capacity for e in stages)
    one = open_numpy_streaming(full, conf.replace(arena=f"{total}slots"), keep_trace=True)
    prompt = np.array(list(b"def fibonacci(n):"))
    x = prompt
    for e in stages:
        x = e._prefill(x)
    one.prefill(prompt)
    marks = [len(e.streamer.decisions) for e in stages], len(one.streamer.decisions)
    token = int(np.argmax(x))
    for _ in range(tokens):
        y = np.asarray([token])
        for e in stages:
            y = e._timed_window(y)
        one.decode(token)
        token = int(np.argmax(y[-1]))
    at = plan.stages[1].moe_start(full.cfg)  # the second stage's first MoE layer, as one process counts
    piped = _urgent_by_layer(stages[1], marks[0][1])[0] / tokens
    single = _urgent_by_layer(one, marks[1])[at] / tokens
    both = [_urgent_by_layer(e, m) for e, m in zip(stages, marks[0])]
    return {"moe_layer": at, "urgent_per_token_stage": float(piped), "urgent_per_token_one_process": float(single),
            "stage_arenas": [e.arena.capacity for e in stages], "one_process_arena": total,
            "urgent_per_token_pipeline_total": float(sum(b.sum() for b in both) / tokens),
            "urgent_per_token_one_process_total": float(_urgent_by_layer(one, marks[1]).sum() / tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--ping-rank", metavar="OUT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ping_rank:
        sys.exit(_ping_rank(args.rounds, args.ping_rank))
    p, r, b = ping(args.rounds), run(args.tokens), boundary(args.tokens)
    print("1. one message, one way (ring over 127.0.0.1, median)")
    for name, v in p.items():
        print(f"   {name:12s} {v['bytes']:>8d} B  {v['one_way_us']:8.1f} us")
    print(f"2. 2-rank decode of the embedded model, {r['tokens']} tokens: hand-off "
          f"{r['handoff_bytes_per_token']:.0f} B/token over 2 hops, {r['ms_per_token']:.2f} ms/token")
    for s in r["stages"]:
        print(f"   stage {s['rank']}: sent {s['sent_bytes']:.0f} B in {s['send_ms']:.3f} ms, compute "
              f"{s['compute_ms']:.2f} ms, waiting for the previous stage {s['prev_wait_ms']:.2f} ms per token")
    print(f"3. read-ahead skipped at MoE layer {b['moe_layer']} (stage 1's first): urgent reads/token "
          f"{b['urgent_per_token_stage']:.2f} on the stage vs {b['urgent_per_token_one_process']:.2f} in one process; "
          f"all layers {b['urgent_per_token_pipeline_total']:.2f} vs {b['urgent_per_token_one_process_total']:.2f} "
          f"(arenas {b['stage_arenas']} vs {b['one_process_arena']})")
    print(json.dumps({"bench": "pipeline_handoff", "ping": p, "run": {k: v for k, v in r.items() if k != "stages"},
                      "stages": [{k: s[k] for k in ("rank", "sent_bytes", "send_ms", "compute_ms", "prev_wait_ms")}
                                 for s in r["stages"]], "boundary": b}, sort_keys=True))


if __name__ == "__main__":
    main()
