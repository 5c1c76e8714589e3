"""strata against llama.cpp on one GGUF, on the CPU, with no memory limit and under cgroup memory
limits given as shares of the model file (the experts + dense).

The GGUF is a Qwen3-MoE model made by strata's model maker (strata.testing.models.make_model:
structured routing, Q8_0 dense, --expert-type experts) and written in llama.cpp's layout
(strata.testing.llama_cpp_export: blocks bit for bit), or --gguf names one. llama.cpp reads it
with `llama-bench` (its mmap; every thread count of --threads, and both with and without its CPU
repacking of Q4_0 / Q8_0 into interleaved copies, which takes the weights out of the page cache
into the process: the best of these is its row); strata reads what `strata convert` makes of it
(the blocks kept as stored) with default settings: `Config()` (compiled CPU kernels, threads and
arena by the budget rule), greedy. Each limited run starts with the files out of the page cache
and runs in a fresh cgroup (benchmarks/_memory_limit.py); the no-limit runs start warm.

    python benchmarks/llama_cpp_side_by_side.py --llama-cpp-build ~/llama.cpp/build
    python benchmarks/llama_cpp_side_by_side.py --llama-cpp-build B --expert-type q4_0 --limits none,50%
    python benchmarks/llama_cpp_side_by_side.py --llama-cpp-build B --gguf model.gguf

Decode tok/s: llama-bench's tg (N tokens from an empty context), strata's N greedy decode steps
after the prompt; prompt tok/s: llama-bench's pp, strata's prefill of the same length. Prints a
table and one JSON line. The build is llama.cpp's CPU tools, e.g. from the llama-cpp-python
source package (docs/cpu.md, "Side by side with llama.cpp").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _memory_limit import evict, limit_support, run_limited, warm  # noqa: E402

HERE = Path(__file__).resolve()
RUN_TIMEOUT_S = 600  # one tool's run at one limit; a thrashing run past it is reported as such


DEFAULT_WORK = Path(tempfile.gettempdir()) / "strata-bench-llama-cpp"  # the made models, GGUFs and logs

def _parse_limits(text: str) -> list[float | None]:
    out: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "none":
            out.append(None)
        elif part.endswith("%") and 0 < float(part[:-1]) <= 100:
            out.append(float(part[:-1]) / 100)
        else:
            raise SystemExit(f"--limits: {part!r} is not `none` or a share like 50%")
    return out


def made_gguf(args, work: Path) -> Path:
    """The llama.cpp GGUF of the made model of args' shape (made and exported once, then reused)."""
    from strata.formats.quant_types import QuantType
    from strata.testing.llama_cpp_export import export_qwen3moe_gguf
    from strata.testing.models import make_model

    name = (f"qwen3moe_{args.expert_type}_d{args.hidden}_f{args.ffn}_l{args.layers}_e{args.experts}"
            f"k{args.top_k}_v{args.vocab}")
    out = work / f"{name}.llama.gguf"
    if out.exists():
        return out
    made = work / name
    print(f"making {made} ...", file=sys.stderr)
    make_model(made, "demo", 0, expert_type=QuantType[args.expert_type.upper()], dense_type=QuantType.Q8_0,
               progress=True, n_layers=args.layers, hidden_size=args.hidden, n_heads=args.hidden // 64,
               n_kv_heads=max(1, args.hidden // 256), head_dim=64, n_experts=args.experts,
               n_experts_per_token=args.top_k, expert_ffn_size=args.ffn, shared_ffn_size=0,
               shared_expert_gated=False, vocab_size=args.vocab)
    print(f"exporting {out} ...", file=sys.stderr)
    partial = out.with_suffix(".partial")
    export_qwen3moe_gguf(made.with_suffix(".gguf"), partial, progress=True)
    partial.rename(out)
    for f in (made.with_suffix(".gguf"), made.with_suffix(".experts")):
        f.unlink()
    return out


def converted(gguf_path: Path, work: Path) -> Path:
    """`strata convert` of the GGUF (blocks kept as stored), once: the strata model's .gguf."""
    from strata.convert import convert

    out = work / (gguf_path.name.removesuffix(".gguf").removesuffix(".llama") + "-strata")
    model, experts = out.parent / (out.name + ".gguf"), out.parent / (out.name + ".experts")
    if not experts.exists():
        print(f"strata convert {gguf_path} {out} ...", file=sys.stderr)
        convert(gguf_path, out)
    return model


def llama_cpp_run(build: Path, gguf_path: Path, limit: int | None, form, args) -> dict:
    """llama-bench at each repack setting (each thread count of --threads in one run): the best
    decode and prompt tok/s and the settings that gave them, or why none ran."""
    rows, notes = [], []
    for repack in (1, 0):
        cmd = [str(build / "bin" / "llama-bench"), "-m", str(gguf_path), "-p", str(args.prompt), "-n", str(args.tokens),
               "-t", args.threads, "-r", "1", "-o", "json", "--repack", str(repack)]
        if limit is not None:
            evict(gguf_path)
        t = time.perf_counter()
        r = run_limited(cmd, limit, form, timeout=RUN_TIMEOUT_S)
        wall = time.perf_counter() - t
        if r.returncode != 0:
            why = ("killed (memory)" if r.returncode in (-9, 137) else "timeout" if r.returncode is None
                   else f"exit {r.returncode}: {(r.stderr.strip().splitlines() or ['?'])[-1][:120]}")
            notes.append(f"repack {repack}: {why} after {wall:.0f} s")
            continue
        for entry in json.loads(r.stdout):
            kind = "prompt" if entry["n_prompt"] > 0 else "decode"
            rows.append(dict(kind=kind, threads=entry["n_threads"], repack=repack, tok_s=entry["avg_ts"]))
    best = {}
    for kind in ("decode", "prompt"):
        got = [x for x in rows if x["kind"] == kind]
        if got:
            b = max(got, key=lambda x: x["tok_s"])
            best[kind] = dict(tok_s=round(b["tok_s"], 2), threads=b["threads"], repack=b["repack"])
    return dict(best=best, runs=rows, notes=notes)


def strata_run(model_path: Path, limit: int | None, form, args, *, arena: str | None = None) -> dict:
    """The worker under the limit with default settings (or that arena, forced past the budget
    rule). Where the defaults refuse naming the smallest legal arena, `explicit` is the run with it."""
    cmd = [sys.executable, str(HERE), "--strata-worker", str(model_path), "--prompt", str(args.prompt),
           "--tokens", str(args.tokens)]
    if limit is not None:
        evict(model_path, model_path.with_suffix(".experts"))
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}
    if arena is not None:  # the smallest legal arena, past the budget rule (it may not fit the limit)
        env.update(STRATA_ARENA=arena, STRATA_FORCE_ARENA="1")
    t = time.perf_counter()
    r = run_limited(cmd, limit, form, timeout=RUN_TIMEOUT_S, env=env)
    wall = time.perf_counter() - t
    line = next((l for l in r.stdout.splitlines() if l.startswith("WORKER ")), None)
    if r.returncode == 0 and line:
        out = json.loads(line[len("WORKER "):])
        named = re.search(r"give arena='(\d+slots)'", out.get("error", ""))
        if named and arena is None:
            out["explicit"] = dict(arena=named.group(1), **strata_run(model_path, limit, form, args, arena=named.group(1)))
        return out
    why = ("killed (memory)" if r.returncode in (-9, 137) else "timeout" if r.returncode is None
           else (r.stderr.strip().splitlines() or ["?"])[-1][:160])
    return dict(error=f"{why} after {wall:.0f} s")


def strata_worker(model_path: str, prompt_len: int, n_tokens: int) -> None:
    """In the limited process: load, open the engine the default configuration gives, prefill,
    decode greedily; one WORKER JSON line."""
    import numpy as np

    import strata
    from strata.errors import StrataError

    t0 = time.perf_counter()
    try:
        model = strata.load(model_path)
        loaded_rss = _status_bytes("VmRSS")
        eng = strata.open_engine(model)
    except StrataError as e:
        print("WORKER " + json.dumps(dict(error=f"refused: {e}")))
        return
    opened = time.perf_counter() - t0
    prompt = np.random.default_rng(0).integers(0, 256, prompt_len).tolist()
    t = time.perf_counter()
    logits = eng.prefill(prompt)
    prompt_s = time.perf_counter() - t
    before = eng.stats().cache
    t = time.perf_counter()
    for _ in range(n_tokens):
        logits = eng.decode(int(np.argmax(logits)))
    decode_s = time.perf_counter() - t
    stats = eng.stats()
    arena = getattr(eng, "arena", None)  # a streaming engine's: its slots and the plan's knobs line
    arena_bytes = arena.capacity * arena.slot_bytes if arena is not None else 0
    plan = dict(arena_slots=arena.capacity, io=eng.report().io) if arena is not None else {}
    ops = getattr(eng, "ops", None)  # the kernels' threads the all-resident engine chose at open (a streaming one: None)
    eng.close()
    reads = None  # a streaming engine's decode reads per token (all-resident: none)
    if stats.cache is not None:
        reads = round((stats.cache.reads_issued - before.reads_issued) / n_tokens, 1)
    # the process's growth after loading beyond its arena: what the budget's keep must hold
    growth = _status_bytes("VmHWM") - loaded_rss - arena_bytes
    print("WORKER " + json.dumps(dict(decode_tok_s=round(n_tokens / decode_s, 2),
                                      prompt_tok_s=round(prompt_len / prompt_s, 2), open_s=round(opened, 1),
                                      engine=stats.engine, decode_reads_per_token=reads,
                                      growth_beyond_arena_mb=round(growth / 1e6, 1),
                                      kernel_threads=ops.threads if ops is not None else None, **plan)))


def _status_bytes(field: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes; 0 where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            line = next((l for l in f if l.startswith(field + ":")), None)
    except OSError:
        return 0
    return int(line.split()[1]) << 10 if line else 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--strata-worker":
        w = argparse.ArgumentParser()
        w.add_argument("--strata-worker")
        w.add_argument("--prompt", type=int)
        w.add_argument("--tokens", type=int)
        a = w.parse_args()
        strata_worker(a.strata_worker, a.prompt, a.tokens)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp-build", type=Path, required=True, help="llama.cpp's cmake build folder (bin/llama-bench)")
    ap.add_argument("--gguf", type=Path, help="a llama.cpp Qwen3-MoE GGUF (default: make one of the shape below)")
    ap.add_argument("--expert-type", choices=("q8_0", "q4_0"), default="q8_0")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--limits", default="none,75%,50%,30%,15%", help="shares of the model file (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=16, help="decode tokens per run (default 16)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per run (default 32)")
    ap.add_argument("--threads", default="1,2", help="llama.cpp's thread counts (default 1,2); strata's: auto")
    ap.add_argument("--strata-only", action="store_true", help="skip llama.cpp (its rows from an earlier run)")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK)
    args = ap.parse_args()
    if not (args.llama_cpp_build / "bin" / "llama-bench").exists():
        raise SystemExit(f"llama_cpp_side_by_side: no bin/llama-bench under {args.llama_cpp_build}; build llama.cpp's "
                         "CPU tools first (docs/cpu.md)")
    limits = _parse_limits(args.limits)
    args.work.mkdir(parents=True, exist_ok=True)
    gguf_path = args.gguf or made_gguf(args, args.work)
    strata_model = converted(gguf_path, args.work)
    size = gguf_path.stat().st_size
    form, how = limit_support()
    if form is None and any(l is not None for l in limits):
        print(f"memory limits: not available here ({how}); the no-limit row only", file=sys.stderr)
        limits = [l for l in limits if l is None]
    rows = []
    for share in limits:
        limit = None if share is None else int(size * share)
        if limit is None:
            warm(gguf_path, strata_model, strata_model.with_suffix(".experts"))
        print(f"limit {share and f'{share:.0%}' or 'none'}: llama.cpp ...", file=sys.stderr, flush=True)
        theirs = (dict(best={}, runs=[], notes=["not run (--strata-only)"]) if args.strata_only
                  else llama_cpp_run(args.llama_cpp_build, gguf_path, limit, form, args))
        if limit is None:
            warm(gguf_path, strata_model, strata_model.with_suffix(".experts"))
        print(f"limit {share and f'{share:.0%}' or 'none'}: strata ...", file=sys.stderr, flush=True)
        ours = strata_run(strata_model, limit, form, args)
        rows.append(dict(limit=None if share is None else f"{share:.0%}", limit_bytes=limit, strata=ours, llama_cpp=theirs))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    res = dict(bench="llama_cpp_side_by_side", gguf=str(gguf_path), gguf_bytes=size, expert_type=args.expert_type,
               shape=dict(layers=args.layers, hidden=args.hidden, ffn=args.ffn, experts=args.experts, top_k=args.top_k,
                          vocab=args.vocab) if args.gguf is None else None,
               tokens=args.tokens, prompt=args.prompt, cores=os.cpu_count(), load_avg=round(os.getloadavg()[0], 2),
               limits_by=how, rows=rows)
    _print_table(res)
    print("JSON " + json.dumps(res, sort_keys=True))


def _fmt(x: dict, kind: str) -> str:
    b = x["best"].get(kind)
    return f"{b['tok_s']} ({b['threads']}t, repack {b['repack']})" if b else "; ".join(x["notes"]) or "-"


def _print_table(res: dict) -> None:
    print(f"\n{res['gguf']} ({res['gguf_bytes'] / 2**20:.0f} MiB, {res['expert_type'].upper()} experts); "
          f"{res['prompt']} prompt + {res['tokens']} decode tokens; {res['cores']} cores, load avg {res['load_avg']}; "
          f"limits: {res['limits_by']}\n")
    print("| memory limit (share of the file) | strata decode tok/s | llama.cpp decode tok/s (best) | strata / llama.cpp "
          "| strata prompt tok/s | llama.cpp prompt tok/s (best) |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        ours, theirs = r["strata"], r["llama_cpp"]
        limit = "none" if r["limit"] is None else f"{r['limit']} ({r['limit_bytes'] / 2**20:.0f} MiB)"
        d = theirs["best"].get("decode")
        ratio = f"{ours['decode_tok_s'] / d['tok_s']:.2f}x" if d and "decode_tok_s" in ours else "-"
        got = ours.get("decode_tok_s")
        if got is None:
            ex = ours.get("explicit", {})
            got = f"refused by default ({ours['error'][:60]}...)"
            if "decode_tok_s" in ex:
                got += f"; {ex['decode_tok_s']} with arena={ex['arena']}"
            elif ex:
                got += f"; with arena={ex['arena']}: {ex.get('error')}"
        print(f"| {limit} | {got} | {_fmt(theirs, 'decode')} | {ratio} "
              f"| {ours.get('prompt_tok_s', '-')} | {_fmt(theirs, 'prompt')} |")


if __name__ == "__main__":
    main()
