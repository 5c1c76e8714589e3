"""Decode on the CPU: numpy's float32 products against the compiled kernels (Config.cpu_kernels,
docs/cpu.md), on one made model (dense Q8_0, experts Q8_0 or --expert-type), in one process.

The model is Qwen3-MoE's layer kind (attention with per-head q/k norms, softmax-top-k routing,
SwiGLU experts, no shared expert) at a width this machine decodes in seconds; --hidden, --ffn,
--layers, --experts, --top-k, --vocab scale it. Both engines are all-resident (the `none` row of
a memory limit: compute is all that differs) unless --arena names a streaming arena. They
decode greedily from the same prompt, token by token in turn (so a shared machine's drift falls
on both alike), and the table gives each one's decode and prompt tok/s, the ratio, whether the
greedy tokens are the same and the largest logit difference relative to the logits' scale.

    python benchmarks/cpu_compute.py                       # D 1024, F 512, 4 layers, 32 experts top-8
    python benchmarks/cpu_compute.py --layers 8 --tokens 32 --arena 50%
    python benchmarks/cpu_compute.py --hidden 2048 --ffn 768 --threads 4   # a many-core machine
    python benchmarks/cpu_compute.py --expert-type q2_0                    # Q2_0 experts (or q4_0)
    python benchmarks/cpu_compute.py --expert-type q4_k --tokens 8         # llama.cpp's Q4_K experts (random
                                      # blocks; q5_k, q6_k, q3_k, q2_k, iq4_nl, iq4_xs, mxfp4, q5_1 alike)

llama.cpp is not part of this run (benchmarks/llama_cpp_side_by_side.py runs both on one GGUF).
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import strata  # noqa: E402
from strata.engines import open_engine  # noqa: E402
from strata.formats.quant_types import QuantType, layout  # noqa: E402
from strata.numpy_backend import native_build  # noqa: E402
from strata.testing.models import make_model  # noqa: E402
from strata.threads import compute_threads  # noqa: E402

PROMPT_TOKENS = 32
# each on its kernel; llama.cpp's types (Q4_K ... Q5_1, MXFP4 ggml's) as random blocks at the same scale
EXPERT_TYPES = {"q8_0": QuantType.Q8_0, "q4_0": QuantType.Q4_0, "q2_0": QuantType.Q2_0, "q4_k": QuantType.Q4_K,
                "q5_k": QuantType.Q5_K, "q6_k": QuantType.Q6_K, "q3_k": QuantType.Q3_K, "q2_k": QuantType.Q2_K,
                "iq4_nl": QuantType.IQ4_NL, "iq4_xs": QuantType.IQ4_XS, "mxfp4": QuantType.GGML_MXFP4,
                "q5_1": QuantType.Q5_1}


def made_model(args, directory: Path):
    shape = dict(n_layers=args.layers, hidden_size=args.hidden, expert_ffn_size=args.ffn, n_experts=args.experts,
                 n_experts_per_token=args.top_k, n_heads=args.hidden // 64, n_kv_heads=max(1, args.hidden // 256),
                 head_dim=64, shared_ffn_size=0, shared_expert_gated=False, vocab_size=args.vocab)
    qtype = EXPERT_TYPES[args.expert_type]
    prefix = "q8" if qtype is QuantType.Q8_0 else f"{args.expert_type}_q8"  # the Q8_0 model keeps its name
    name = f"{prefix}_d{args.hidden}_f{args.ffn}_l{args.layers}_e{args.experts}k{args.top_k}_v{args.vocab}"
    path = directory / name
    if not path.with_suffix(".experts").exists():
        print(f"writing the model {path} ...", file=sys.stderr)
        make_model(path, "demo", 0, expert_type=qtype, dense_type=QuantType.Q8_0, progress=True, **shape)
    return path.with_suffix(".gguf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--tokens", type=int, default=16, help="greedy decode steps per engine (default 16)")
    ap.add_argument("--arena", default="", help="a streaming arena (e.g. 50%%); default: all-resident")
    ap.add_argument("--threads", type=int, default=0, help="Config.threads for both sides (default 0: auto)")
    ap.add_argument("--expert-type", choices=sorted(EXPERT_TYPES), default="q8_0",
                    help="the experts' type (default q8_0; llama.cpp's K / IQ4 / MXFP4 / Q5_1 types as random "
                         "blocks, hidden and ffn multiples of 256 for the K-quants and IQ4_XS); the dense "
                         "matrices are Q8_0")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "strata-bench-cpu"))
    args = ap.parse_args()
    block = layout(EXPERT_TYPES[args.expert_type]).block_size
    if args.hidden % block or args.ffn % block:
        raise SystemExit(f"cpu_compute: {args.expert_type} experts need --hidden and --ffn multiples of {block}")
    lib = native_build.library()
    if lib is None:
        raise SystemExit(f"cpu_compute: {native_build.reason()}")
    path = made_model(args, Path(args.cache_dir))
    model = strata.load(path)
    sides = {"numpy float32": False, "compiled": True}
    config = dict(backend="numpy", moce_lambda=0.0, arena=args.arena, threads=args.threads)
    engines = {name: open_engine(model, dict(config, cpu_kernels=on),
                                 stream=bool(args.arena) or None) for name, on in sides.items()}
    prompt = np.random.default_rng(0).integers(0, args.vocab - 1, PROMPT_TOKENS)
    prompt_s, decode_s, tokens, logits = {}, {n: 0.0 for n in sides}, {n: [] for n in sides}, {n: [] for n in sides}
    last = {}
    for name, eng in engines.items():
        t = time.perf_counter()
        last[name] = eng.prefill(prompt)
        prompt_s[name] = time.perf_counter() - t
    for _ in range(args.tokens):
        for name, eng in engines.items():
            tok = int(np.argmax(last[name]))
            tokens[name].append(tok)
            logits[name].append(last[name])
            t = time.perf_counter()
            last[name] = eng.decode(tok)
            decode_s[name] += time.perf_counter() - t
    ops = getattr(engines["compiled"], "ops", None)  # the count the engine chose at open (strata.threads.kernel_threads)
    kernel_threads = ops.threads if ops is not None else None
    for eng in engines.values():
        eng.close()
    ref, fast = np.stack(logits["numpy float32"]), np.stack(logits["compiled"])
    rel = float(np.max(np.abs(fast - ref).max(axis=1) / np.abs(ref).max(axis=1)))
    same = tokens["numpy float32"] == tokens["compiled"]
    res = dict(bench="cpu_compute", cores=os.cpu_count(), load_avg=round(os.getloadavg()[0], 2),
               expert_type=args.expert_type, hidden=args.hidden, ffn=args.ffn, layers=args.layers, experts=args.experts, top_k=args.top_k,
               vocab=args.vocab, arena=args.arena or "all-resident", tokens=args.tokens,
               threads=compute_threads(args.threads, args.hidden), kernel_threads=kernel_threads,
               decode_tok_s={n: round(args.tokens / decode_s[n], 2) for n in sides},
               prompt_tok_s={n: round(PROMPT_TOKENS / prompt_s[n], 1) for n in sides},
               decode_ratio=round(decode_s["numpy float32"] / decode_s["compiled"], 2),
               same_greedy_tokens=same, max_rel_logit_diff=rel)
    print(f"\n{args.expert_type.upper()} experts, Q8_0 dense, made model: D {args.hidden}, F {args.ffn}, {args.layers} layers, {args.experts} experts top-"
          f"{args.top_k}, vocab {args.vocab}, {res['arena']}; {args.tokens} greedy tokens each; {res['threads']} "
          f"BLAS thread(s), {kernel_threads} kernel thread(s); load avg {res['load_avg']}\n")
    print("| compute | decode tok/s | prompt tok/s |")
    print("|---|---|---|")
    for n in sides:
        print(f"| {n} | {res['decode_tok_s'][n]} | {res['prompt_tok_s'][n]} |")
    print(f"\ndecode: compiled / numpy = {res['decode_ratio']}x; same greedy tokens: {same}; "
          f"max |Δlogit| / max |logit|: {rel:.2e}")
    print("JSON " + json.dumps(res, sort_keys=True))


if __name__ == "__main__":
    main()
