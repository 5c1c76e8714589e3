"""Prompt tok/s of the all-resident MLX engine at the seed shape (48 layers, 256 experts, top-10,
hidden 2560, expert ffn 576, 16 q / 4 kv heads of 128, float16 dense, Q2_0 experts; no shared
expert unless --shared), `benchmarks/prompt.py --mlx`:

1. the prompt path (strata/mlx_backend/prompt.py) against the decode kernels' `forward` (what
   MlxEngine.prefill ran before), the same prompt, the last position's logits compared;
2. one layer's parts at each length, each evaluated alone (attention, router + routing, the
   experts' dequantization, the grouped GEMMs), and `mx.gather_qmm(sorted_indices=True)` on the
   Q2_0 planes as the alternative the grouped path does not take (on MLX's CUDA build a GEMV per row);
3. the floors: matrix-unit flops at PEAK_TFLOPS and the bytes the path moves at the copy bandwidth.

Prints a table and one JSON line (`JSON {...}`).

    python benchmarks/prompt.py --mlx --lengths 512,2048          # the seed shape (GPU; ~17 GB arena)
    python benchmarks/prompt.py --mlx --small --lengths 64,128    # smoke test (any machine)
    python benchmarks/prompt.py --mlx --streaming 6144 --lengths 512,2048   # + a streaming engine's prompt
                                                                            # (half the experts; .experts in /dev/shm)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import copy_bandwidth, device_name  # noqa: E402
from strata.mlx_backend import grouped  # noqa: E402
from strata.mlx_backend.kernel_plan import KernelPlan, using_plan  # noqa: E402
from strata.mlx_backend.grouped import GroupedGemm, dequantized_experts, grouped_experts, route_prompt  # noqa: E402
from strata.mlx_backend.model import MlxModelState, forward  # noqa: E402
from strata.mlx_backend.experts import experts_route, slot_planes  # noqa: E402
from strata.mlx_backend.prompt import prompt_forward  # noqa: E402
from strata.mlx_backend.prompt_attention import prompt_attention  # noqa: E402
from strata.mlx_backend.attention import rms_norm  # noqa: E402
from strata.testing.mlx_params import SEED_SHAPE, random_params  # noqa: E402

PEAK_TFLOPS = 800.0  # H200 dense float16 on the tensor cores (~990 spec; ~800 reached by cuBLAS)
SMALL = replace(SEED_SHAPE, n_layers=4, hidden_size=256, n_experts=32, n_experts_per_token=4, expert_ffn_size=64,
                n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512, max_context=4096)


def _time(fn, reps: int, setup=None) -> float:
    """Median seconds of fn(setup()) (fn evaluates what it builds), after one warm-up call; setup
    (a fresh KV state: 48 layers' zeroed caches) runs outside the timing."""
    fn(setup() if setup else None)
    ts = []
    for _ in range(reps):
        arg = setup() if setup else None
        t = time.perf_counter()
        fn(arg)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def flops_per_token(cfg, context: float) -> float:
    """Matrix flops of one prompt position (context: the mean number of keys it attends to)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    qkv = 2 * d * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    o = 2 * cfg.n_heads * hd * d
    att = 4 * cfg.n_heads * hd * context
    experts = cfg.n_experts_per_token * 3 * 2 * d * cfg.expert_ffn_size
    shared = 3 * 2 * d * cfg.shared_ffn_size
    router = 2 * d * cfg.n_experts
    return cfg.n_layers * (qkv + o + att + experts + shared + router)


def layer_parts(p, n: int, reps: int, gemms) -> dict:
    """One MoE layer's parts over n positions, each evaluated alone (seconds)."""
    cfg, lw, rec = p.cfg, p.layers[0], p.rec
    x = mx.random.normal((n, cfg.hidden_size)).astype(mx.float32)
    mx.eval(x)
    out = {}
    kv = MlxModelState.empty(cfg).layers[0]
    out["attention"] = _time(
        lambda _: mx.eval(prompt_attention(cfg, lw.attn, replace_kv(kv), x, dtype=p.dtype)[0]), reps)
    h = rms_norm(x, lw.ffn_norm, cfg.rms_norm_eps)
    mx.eval(h)
    out["router + routing"] = _time(lambda _: mx.eval(*route_prompt(h @ lw.router.T, lw.rule)), reps)
    experts, weights = route_prompt(h @ lw.router.T, lw.rule)
    records = p.arena.array[:cfg.n_experts]
    mx.eval(experts, weights, records)
    out["dequantize E experts"] = _time(lambda _: mx.eval(*dequantized_experts(records, rec, p.dtype)), reps)
    for g in gemms:
        try:
            out[f"grouped experts ({g.value})"] = _time(lambda _, g=g: mx.eval(grouped_experts(
                records, rec, h, experts, weights, dtype=p.dtype, gemm=g)), reps)
        except Exception as exc:  # reported, not fatal (e.g. no CUDA gather_mm for this case)
            out[f"grouped experts ({g.value})"] = f"failed: {type(exc).__name__}: {exc}"[:120]
    base_z = h @ lw.router.T
    mx.eval(base_z)
    out["fused kernel experts (decode's)"] = _time(lambda _: mx.eval(experts_route(
        p.arena.array, rec, h, base_z, 0, lw.rule, None)[0]), reps)  # the crossing: grouped.MIN_PAIRS
    try:  # the alternative: MLX's quantized gather over the Q2_0 planes, pairs sorted by expert
        st = slot_planes(records, rec)
        flat = experts.reshape(-1)
        order = mx.argsort(flat)
        rows = h.astype(p.dtype)[order // cfg.n_experts_per_token][:, None, :]
        idx = flat[order].astype(mx.uint32)
        w, s, b = st.gate
        s16, b16 = s.astype(p.dtype), b.astype(p.dtype)
        mx.eval(rows, idx, w, s16, b16)
        out["gather_qmm gate (sorted)"] = _time(lambda _: mx.eval(mx.gather_qmm(
            rows, w, s16, b16, rhs_indices=idx, transpose=True, group_size=32, bits=2, sorted_indices=True)), reps)
    except Exception as exc:  # reported, not fatal
        out["gather_qmm gate (sorted)"] = f"failed: {type(exc).__name__}: {exc}"[:120]
    return out


def streaming_prompt(cfg, lengths: list[int], slots: int, reps: int) -> dict:
    """A streaming engine's prefill (an arena of `slots` slots, the `.experts` file in /dev/shm or the
    temporary directory) with the prompt path's pieces and without them (the plan's prompt_paths empty):
    seconds per length."""
    from decode import make_experts_file
    from decode_memory import stream_dir
    from strata.config import Backend, Config
    from strata.formats.experts_file import ExpertsFile
    from strata.loader import Model
    from strata.mlx_backend.arena import MlxArena
    from strata.mlx_backend.compute import MlxCompute
    from strata.runtime.decode import StreamingEngine, cache_config_for
    from strata.runtime.io import ReaderPool

    path = stream_dir(cfg) / f"strata_prompt_{os.getpid()}.experts"
    make_experts_file(path, cfg, 1)
    xf = ExpertsFile.open(path)
    out = {}
    try:
        model = Model(cfg, {}, None, xf, path.with_suffix(".gguf"))
        slots = max(slots, cache_config_for(model, Config(), 1).min_capacity)
        config = Config(backend=Backend.MLX, arena=f"{slots}slots", moce_lambda=0.0)
        params = random_params(cfg, seed=0, experts=False, pred_q8=config.pred_q8)
        rng = np.random.default_rng(0)
        for label, paths in (("prompt path", KernelPlan().prompt_paths), ("decode kernels", frozenset())):
            for n in lengths:
                times = []
                for _ in range(reps if paths else 1):
                    arena = MlxArena(slots, xf.header.padded_bytes)
                    pool = ReaderPool(xf, arena, threads=config.io_threads, direct=config.direct_io, verify=False,
                                      timeout=config.io_timeout, switch_interval=config.io_switch_ms / 1e3)
                    eng = StreamingEngine(model, config, arena, MlxCompute(params, arena, xf.layout,
                                                                           pred_q8=config.pred_q8), pool)
                    t = time.perf_counter()
                    with using_plan(KernelPlan(prompt_paths=paths)):
                        eng.prefill(list(rng.integers(0, cfg.vocab_size, n)))
                    times.append(time.perf_counter() - t)
                    eng.close()
                out[f"{label} {n}"] = statistics.median(times)
                print("JSON-PART " + json.dumps({"streaming": label, "tokens": n, "slots": slots,
                                                 "s": out[f"{label} {n}"]}), flush=True)
    finally:
        xf.close()
        path.unlink(missing_ok=True)
    return out


def replace_kv(kv):
    return type(kv)(kv.keys, kv.values, 0)


def main(args) -> None:
    cfg = SMALL if args.small else SEED_SHAPE
    cfg = cfg if args.shared else replace(cfg, shared_ffn_size=0, shared_expert_gated=False)
    lengths = [int(v) for v in args.lengths.split(",")]
    cfg = replace(cfg, max_context=max(cfg.max_context, max(lengths) + 8))
    t0 = time.time()
    p = random_params(cfg, seed=0, pred_q8=False)
    build_s = time.time() - t0
    bw = copy_bandwidth(256 * 2**20)
    rng = np.random.default_rng(0)
    res = {"device": device_name(), "mlx": mx.__version__, "build_s": build_s, "lengths": {}}
    gemms = {}
    wanted = [GroupedGemm(v) for v in args.gemms.split(",")] if args.gemms else [
        g for g in GroupedGemm if not (g is GroupedGemm.GATHER and grouped.default_gemm() is not g)]
    for g in wanted:  # warm-up at 256 tokens, every layer's experts grouped: MLX's CUDA build JIT-
        # compiles its gather / scatter / fused kernels (and CUTLASS's) on first use
        t = time.perf_counter()
        try:
            with using_plan(KernelPlan(grouped_gemm=g, grouped_min_pairs=0)):
                mx.eval(prompt_forward(p, MlxModelState.empty(cfg), rng.integers(0, cfg.vocab_size, 256))[0])
            gemms[g] = None
        except Exception as exc:
            gemms[g] = f"{type(exc).__name__}: {exc}"[:160]
        res.setdefault("first_call_s", {})[g.value] = time.perf_counter() - t
        print("JSON-PART " + json.dumps({"first_call_s": g.value, "s": res["first_call_s"][g.value],
                                         "error": gemms[g], "t": time.time() - t0}), flush=True)
    res["gemm_failures"] = {g.value: why for g, why in gemms.items() if why}
    got = {}
    try:  # a time limit's SIGINT ends the measuring, not the report: what finished is printed
        for n in lengths:  # 1. the prompt path, each grouped GEMM
            tokens = rng.integers(0, cfg.vocab_size, n)
            fresh = lambda: MlxModelState.empty(cfg)  # noqa: E731
            run_new = lambda st: np.array(prompt_forward(p, st, tokens)[0][-1])  # noqa: E731
            r, best = {}, None
            for g in (g for g, why in gemms.items() if why is None):
                with using_plan(KernelPlan(grouped_gemm=g)):
                    s = _time(run_new, args.repeat, fresh)
                r[f"prompt_path_{g.value}_s"] = s
                if best is None or s < best[1]:
                    best = (g, s)
            if best is None:
                print(f"JSON-PART {json.dumps({'tokens': n, 'error': res['gemm_failures']})}", flush=True)
                continue
            new_s = best[1]
            with using_plan(KernelPlan(grouped_gemm=best[0])):
                got[n] = (tokens, run_new(fresh()))
            r.update(prompt_path_s=new_s, prompt_path_tok_s=n / new_s, gemm=best[0].value)
            flops = n * flops_per_token(cfg, n / 2)
            deq_bytes = cfg.n_moe_layers * cfg.n_experts * (p.rec.record_bytes
                                                            + 2 * 2 * 3 * cfg.hidden_size * cfg.expert_ffn_size)
            r.update(tflop=flops / 1e12, compute_floor_s=flops / (PEAK_TFLOPS * 1e12),
                     dequant_bytes_gb=deq_bytes / 1e9, dequant_floor_s=deq_bytes / bw["read_Bps"])
            res["lengths"][str(n)] = r
            print("JSON-PART " + json.dumps({"tokens": n, **r, "t": time.time() - t0}), flush=True)
        if not args.skip_old:  # 2. the decode kernels' forward (their first launches build them: NVRTC)
            mx.eval(forward(p, MlxModelState.empty(cfg), rng.integers(0, cfg.vocab_size, 64))[0])
            for n, (tokens, new) in got.items():
                st = MlxModelState.empty(cfg)
                t = time.perf_counter()
                ref = np.array(forward(p, st, tokens)[0][-1])
                old_s = time.perf_counter() - t
                r = res["lengths"][str(n)]
                r.update(old_path_s=old_s, old_path_tok_s=n / old_s, speedup=old_s / r["prompt_path_s"],
                         same_argmax=bool(np.argmax(ref) == np.argmax(new)),
                         rel_l2=float(np.linalg.norm(new - ref) / np.linalg.norm(ref)),
                         max_rel=float(np.abs(new - ref).max() / np.abs(ref).max()))
                print("JSON-PART " + json.dumps({"tokens": n, **{k: v for k, v in r.items() if "old" in k or k in (
                    "speedup", "same_argmax", "rel_l2", "max_rel")}}), flush=True)
        for n in got:  # 3. one layer's parts
            parts = layer_parts(p, n, args.repeat, [g for g, why in gemms.items() if why is None])
            res["lengths"][str(n)]["layer_parts_ms"] = {k: (v * 1e3 if isinstance(v, float) else v)
                                                         for k, v in parts.items()}
            print("JSON-PART " + json.dumps({"tokens": n, "layer_parts_ms": res["lengths"][str(n)]["layer_parts_ms"]}),
                  flush=True)
        if args.streaming:  # 4. a streaming engine's prompt, the prompt path's pieces on and off
            res["streaming_s"] = streaming_prompt(cfg, lengths, args.streaming, args.repeat)
    except KeyboardInterrupt:
        res["interrupted"] = True
    print(f"\n## MLX prompt path: {res['device']}, MLX {res['mlx']}, {'small' if args.small else 'seed'} shape, "
          f"{'with' if args.shared else 'no'} shared expert, median of {args.repeat}")
    print("| tokens | prompt path (grouped GEMM) | tok/s | before (decode kernels) | speedup | same argmax | rel L2 | "
          "compute floor | dequant bytes floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, r in res["lengths"].items():
        old = f"{r['old_path_s'] * 1e3:.0f} ms" if "old_path_s" in r else "-"
        print(f"| {n} | {r['prompt_path_s'] * 1e3:.1f} ms ({r['gemm']}) | {r['prompt_path_tok_s']:.0f} | {old} | "
              f"{r.get('speedup', 0):.1f}x | {r.get('same_argmax', '-')} | {r.get('rel_l2', float('nan')):.2g} | "
              f"{r['compute_floor_s'] * 1e3:.1f} ms | {r['dequant_floor_s'] * 1e3:.1f} ms |")
    print("\n| tokens | " + " | ".join(f"{g.value} (ms)" for g in GroupedGemm) + " |")
    print("|---|" + "---|" * len(GroupedGemm))
    for n, r in res["lengths"].items():
        cells = [f"{r[f'prompt_path_{g.value}_s'] * 1e3:.1f}" if f"prompt_path_{g.value}_s" in r
                 else res["gemm_failures"].get(g.value, "-")[:60] for g in GroupedGemm]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\n| tokens | one layer's part | ms |")
    print("|---|---|---|")
    for n, r in res["lengths"].items():
        for k, v in r.get("layer_parts_ms", {}).items():
            print(f"| {n} | {k} | {v:.3f} |" if isinstance(v, float) else f"| {n} | {k} | {v} |")
    for k, v in res.get("streaming_s", {}).items():
        print(f"| streaming ({args.streaming} slots): {k} tokens | {v * 1e3:.0f} ms |")
    print("JSON " + json.dumps(dict(bench="prompt_mlx", shape="small" if args.small else "seed", shared=args.shared,
                                    repeat=args.repeat, **res)))
