"""A llama.cpp GGUF run in place against the same file converted: decode ms/token and expert bytes
read per token, one run each, on one model.

The model is a made one (a random Qwen3-MoE checkpoint written in llama.cpp's layout by the test
suite's GGUF builder, tests/gguf_models.py: `qwen3moe`, stacked `*_exps` experts of the type
asked) or a GGUF you give (`--gguf PATH`). It is converted once (`strata convert`, timed: the cost
a run in place does not pay) and both are streamed through the numpy engine at the same arena
(a share of the experts, never below the smallest legal one), with the same greedy tokens checked
equal: ms/token of the decode, expert reads and bytes read per token (the reader pool's own
count: an in-place expert is a read of whole pages around each of its three slices; a converted
one, one read of its aligned record), and reads per expert. `--cold` drops both files' pages from
the page cache before each run, so reads go to the disk (else they are page-cache copies and the
difference is the read count and the placing). Prints a markdown table and, last, one JSON line.

    PYTHONPATH=$PWD python benchmarks/gguf_in_place.py [--gguf PATH] [--experts Q8_0] [--layers 8]
        [--n-experts 32] [--hidden 512] [--ffn 512] [--arena 0.25] [--tokens 32] [--cold]

CPU numbers from a shared 2-core machine are in docs/convert.md; the same command on the GPU
machine (or a Mac's SSD, `--cold`) is the measurement that counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "The quick brown fox jumps over the lazy dog because"


def _made_gguf(work: Path, args) -> Path:
    from tests import gguf_models, hf_models

    hf_models.write_synthetic_checkpoint(work / "hf", layers=args.layers, experts=args.n_experts, hidden=args.hidden,
                                         ffn=args.ffn, shards=1, seed=0, std=hf_models.INIT_STD)
    return gguf_models.write_gguf(work / "hf", work / "model.gguf", experts=args.experts, dense="F16")


def _run(path: Path, args, cold: bool) -> dict:
    from benchmarks._page_cache import drop_cache
    from strata.config import Backend, Config
    from strata.engines import open_engine
    from strata.loader import load
    from strata.runtime.decode import arena_plan_for

    with load(path) as model:
        store = model.experts_file
        total = store.header.n_records
        base = Config(backend=Backend.NUMPY, moce_lambda=0.0)
        smallest = arena_plan_for(model, base.replace(arena="100000slots")).min_slots
        slots = max(smallest, int(round(args.arena * total)))
        prompt = list(model.tokenizer.encode(PROMPT))
        if cold:
            for f in store.files:
                drop_cache(Path(f))
        with open_engine(model, base.replace(arena=f"{slots}slots"), stream=True) as eng:
            logits = eng.prefill(prompt)
            bytes0, reads0 = eng.io.bytes_read, eng.io.reads_done
            tokens, t0 = [], time.perf_counter()
            for _ in range(args.tokens):
                tokens.append(int(np.argmax(logits)))
                logits = eng.decode(tokens[-1])
            seconds = time.perf_counter() - t0
            reads, nbytes = eng.io.reads_done - reads0, eng.io.bytes_read - bytes0
            io = eng.io.note
        return {"ms_per_token": 1e3 * seconds / args.tokens, "expert_reads_per_token": reads / args.tokens,
                "bytes_read_per_token": nbytes / args.tokens, "reads_per_expert": store.reads_per_record,
                "bytes_per_expert_read": store.read_bytes_per_record, "arena_slots": slots, "total_experts": total,
                "smallest_arena": smallest, "io": io, "tokens": tokens}


def main(argv=None) -> int:
    from strata.convert import convert

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, help="a llama.cpp GGUF to measure (default: a made one)")
    p.add_argument("--experts", default="Q8_0", help="the made model's expert type (a ggml type name)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--n-experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--arena", type=float, default=0.25, help="the arena as a share of all experts")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--cold", action="store_true", help="drop the files' pages from the page cache before each run")
    args = p.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        path = args.gguf or _made_gguf(work, args)
        c0 = time.perf_counter()
        converted = convert(path, work / "converted")
        convert_s = time.perf_counter() - c0
        written = converted.model_path.stat().st_size + converted.experts_path.stat().st_size
        rows = {"converted": _run(converted.model_path, args, args.cold), "in place": _run(path, args, args.cold)}
    same = rows["converted"].pop("tokens") == rows["in place"].pop("tokens")
    rows["converted"].update(convert_s=convert_s, written_bytes=written)
    rows["in place"].update(convert_s=0.0, written_bytes=0)
    r = rows["in place"]
    print(f"\n{path.name if args.gguf else f'made qwen3moe {args.layers} layers x {args.n_experts} experts, D={args.hidden} F={args.ffn}, {args.experts} experts'}"
          f"; numpy streaming at {r['arena_slots']} of {r['total_experts']} slots (smallest {r['smallest_arena']}); "
          f"{args.tokens} tokens{' (cold)' if args.cold else ''}; greedy tokens {'equal' if same else 'DIFFER'}\n")
    print("| path | ms/token | expert reads/token | reads/expert | bytes read/token | convert s | written MB |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['ms_per_token']:.2f} | {row['expert_reads_per_token']:.2f} | {row['reads_per_expert']:.1f} "
              f"| {row['bytes_read_per_token'] / 1e6:.3f} MB | {row['convert_s']:.1f} | {row['written_bytes'] / 1e6:.1f} |")
    print()
    print(json.dumps({"gguf": str(args.gguf) if args.gguf else None, "experts": args.experts, "layers": args.layers,
                      "n_experts": args.n_experts, "hidden": args.hidden, "ffn": args.ffn, "arena": args.arena,
                      "tokens": args.tokens, "cold": args.cold, "tokens_equal": same, "rows": rows,
                      "seconds": round(time.time() - t0, 1)}, sort_keys=True))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
