"""First-call costs of MLX's JIT compiles (issue 19): how long a fresh process's first decode step
and first prompts take against the second call, and whether a second process is faster (MLX's
CUDA build caches its own JIT kernels on disk; strata's custom kernels compile once per process:
docs/mlx_backend.md, "JIT compile costs on MLX's CUDA build").

In one process, in this order:
1. the all-resident decode step (the compiled step on a GPU; the uncompiled graph elsewhere, where
   mx.compile does not take the kernel path): first call, second call;
2. the prompt path (`prompt_forward`) at each of --lengths (default 128, 512, 2048, 1000, 1020 on a
   GPU: 1000 is no bucket, 1020 is in 1000's): first and second call at each, a fresh KV state each call;
3. a per-layer breakdown of the largest length's prompt, warm: each layer's mixer, and the whole
   layer, evaluated alone;
then the same in a second process (`--child`), unless --one-process; the JSON line holds both and
the PTX cache directory's file count before and after each.

At --layers 8 (the default on a GPU: every layer's kernels are the same specialisations, so the
compile costs are the 48 layers', the run ~1/6 and so is mx.compile's Python trace of the decode
step: --layers 48 for the whole first call) the seed shape's per-layer size; --budget-s (120)
bounds both processes:

    python benchmarks/jit_probe.py                     # GPU: the seed shape, 8 layers, <= ~120 s
    python benchmarks/jit_probe.py --small             # any machine (MLX's CPU build: seconds)
    python benchmarks/jit_probe.py --no-bucket         # exact shapes (no group-capacity or position buckets)

Prints a table and one JSON line (`JSON {...}`); JSON-PART lines as parts finish.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from strata.mlx_backend import grouped, jit_cache, prompt_attention  # noqa: E402  (jit_cache: the PTX cache default)
from strata.mlx_backend.compiled import CompiledDecode, unsupported  # noqa: E402
from strata.mlx_backend.grouped import GroupedGemm  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, gpu_dialect, recording, using_path  # noqa: E402
from strata.mlx_backend.kernels.preludes import Dialect  # noqa: E402
from strata.mlx_backend.model import MlxModelState, forward  # noqa: E402
from strata.mlx_backend.prompt import _layer, prompt_forward, prompt_mixer  # noqa: E402
from strata.mlx_backend.model import embed  # noqa: E402
from strata.testing.mlx_params import SEED_SHAPE, random_params  # noqa: E402

SMALL = replace(SEED_SHAPE, n_layers=4, hidden_size=256, n_experts=32, n_experts_per_token=4, expert_ffn_size=64,
                n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512, shared_ffn_size=0, shared_expert_gated=False)
GPU_LAYERS = 8
# 1000: no bucket (its first call builds bucket 1024's attention graph); 1020: the same bucket, so
# its first call should cost what a second call does
GPU_LENGTHS = "128,512,2048,1000,1020"
CPU_LENGTHS = "32,64,128,100"  # MLX's CPU build on two cores: the prompt's attention alone is seconds at 2048
BUDGET_S = 120  # both processes together: the second gets what the first left


def _cache_files() -> int:
    d = jit_cache.cache_dir()
    return sum(1 for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


_SEEN: set = set()  # (kernel, input dtypes, template) launched so far in this process


def _first(fn) -> tuple[float, int]:
    """Seconds of fn and how many custom-kernel specialisations it launched first in this process
    (each one an NVRTC compile on MLX's CUDA build; a compiled step launches only while tracing)."""
    with recording() as seen:
        s = _timed(fn)
    new = {(src.name, ins, tpl) for src, ins, _, tpl in seen} - _SEEN
    _SEEN.update(new)
    return s, len(new)


def one_compile_s() -> float | None:
    """What one NVRTC compile of a trivial custom kernel costs here (MLX's device header and a
    line of body): the first call less the second. None without MLX's CUDA build."""
    if gpu_dialect() is not Dialect.CUDA:
        return None
    kernel = mx.fast.cuda_kernel(name="strata_jit_probe_copy", input_names=["a"], output_names=["b"],
                                 source="uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; if (i < N) b[i] = a[i];")
    a = mx.zeros((1024,), mx.float32)
    mx.eval(a)

    def one():
        mx.eval(kernel(inputs=[a], template=[("N", 1024)], grid=(1024, 1, 1), threadgroup=(256, 1, 1),
                       output_shapes=[(1024,)], output_dtypes=[mx.float32])[0])
    first = _timed(one)
    return first - _timed(one)


def decode_part(p, cfg) -> dict:
    """First and second decoded token after a one-token prefill (the engine's compiled step where it runs)."""
    state = MlxModelState.empty(cfg)
    _, state = forward(p, state, [1])
    mx.eval([s for kv in state.layers for s in (getattr(kv, "keys", None), getattr(kv, "values", None)) if s is not None])
    why = unsupported(p)
    out = {"compiled": why is None, "why_not": why}
    if why is None:
        step = CompiledDecode(p, state)
        holder = [state]

        def one():
            logits, holder[0] = step(holder[0], 2)
            mx.eval(logits)
    else:
        holder = [state]

        def one():
            logits, holder[0] = forward(p, holder[0], [2])
            mx.eval(logits)
    out["first_s"], out["new_kernels"] = _first(one)
    out["second_s"] = _timed(one)
    return out


def prompt_part(p, cfg, n: int, rng) -> dict:
    tokens = rng.integers(0, cfg.vocab_size, n)

    def one():
        mx.eval(prompt_forward(p, MlxModelState.empty(cfg), tokens)[0])
    first_s, new = _first(one)
    return {"first_s": first_s, "new_kernels": new, "second_s": _timed(one)}


def layer_part(p, cfg, n: int, rng) -> list[dict]:
    """Each layer of an n-token prompt alone (warm: the prompt ran before), its mixer and the whole layer."""
    tokens = rng.integers(0, cfg.vocab_size, n)
    x = embed(p, tokens)
    mx.eval(x)
    empty = MlxModelState.empty(cfg)
    rows = []
    for layer in range(cfg.n_layers):
        st = empty.layers[layer]
        mixer_s = _timed(lambda: mx.eval(prompt_mixer(p, layer, st, x)[0]))
        out = []
        layer_s = _timed(lambda: out.append(_layer(p, layer, st, x, window=False)[0]) or mx.eval(out[-1]))
        rows.append({"layer": layer, "kind": cfg.kinds[layer].mixer.value, "mixer_s": mixer_s, "layer_s": layer_s})
        x = out[-1]
    return rows


def probe(args) -> dict:
    gpu = mx.default_device() == mx.gpu
    cfg = SMALL if args.small or not gpu else replace(SEED_SHAPE, shared_ffn_size=0, shared_expert_gated=False)
    lengths = [int(v) for v in (args.lengths or (GPU_LENGTHS if gpu else CPU_LENGTHS)).split(",")]
    cfg = replace(cfg, n_layers=args.layers or (cfg.n_layers if cfg is SMALL else GPU_LAYERS),
                  max_context=max(cfg.max_context, max(lengths) + 8))
    grouped.BUCKET_CAP = not args.no_bucket
    if args.no_bucket:
        prompt_attention.BUCKET_POSITIONS = False
    if args.gemm:
        grouped.GEMM = GroupedGemm(args.gemm)
    t0 = time.time()
    res = {"device": str(mx.default_device()), "mlx": mx.__version__, "layers": cfg.n_layers, "hidden": cfg.hidden_size,
           "bucket_cap": grouped.BUCKET_CAP,
           "bucket_positions": prompt_attention.buckets_positions(), "path": args.path, "gemm": (grouped.GEMM or grouped.default_gemm()).value,
           "ptx_cache": str(jit_cache.cache_dir()), "cache_files_before": _cache_files(), "prompt": {}}
    p = random_params(cfg, seed=0, pred_q8=False)
    mx.eval(p.arena.array)
    res["build_s"] = time.time() - t0
    rng = np.random.default_rng(0)
    try:  # a time limit's SIGINT ends the measuring, not the report
        res["one_compile_s"] = one_compile_s()
        res["decode"] = decode_part(p, cfg)
        print("JSON-PART " + json.dumps({"decode": res["decode"], "t": time.time() - t0}), flush=True)
        for n in lengths:
            res["prompt"][str(n)] = prompt_part(p, cfg, n, rng)
            print("JSON-PART " + json.dumps({"tokens": n, **res["prompt"][str(n)], "t": time.time() - t0}), flush=True)
        res["layers_at"] = max(lengths)
        res["per_layer"] = layer_part(p, cfg, max(lengths), rng)
    except KeyboardInterrupt:
        res["interrupted"] = True
    res["cache_files_after"] = _cache_files()
    res["total_s"] = time.time() - t0
    return res


def second_process(argv: list[str], limit_s: float) -> dict:
    if limit_s < 5:
        return {"error": f"no time left of the {BUDGET_S} s budget"}
    try:
        done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True,
                              timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {limit_s:.0f} s (the rest of the budget)"}
    except KeyboardInterrupt:  # the stage's limit: the first process's numbers are still printed
        return {"error": "interrupted"}
    line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("JSON ")), None)
    return json.loads(line[5:]) if line else {"error": (done.stderr or done.stdout)[-400:]}


def table(first: dict, second: dict | None) -> str:
    procs = [("P1", first)] + ([("P2", second)] if second and "decode" in second else [])
    lines = [f"{'(P1, P2: 1st, 2nd process)':28}" + "".join(f"{name + ' 1st call':>16}{name + ' 2nd call':>14}"
                                                             for name, _ in procs) + f"{'P1 new':>8}"]
    rows = [("decode step" + ("" if first.get("decode", {}).get("compiled") else " (uncompiled)"),
             lambda r: r.get("decode", {}))]
    rows += [(f"prompt {n}", lambda r, n=n: r["prompt"].get(n, {})) for n in first["prompt"]]
    for label, get in rows:
        cells = "".join(f"{get(r).get('first_s', float('nan')) * 1e3:14.1f}ms{get(r).get('second_s', float('nan')) * 1e3:12.1f}ms"
                        for _, r in procs)
        lines.append(f"{label:28}{cells}{get(first).get('new_kernels', '-'):>8}")
    if first.get("per_layer"):
        lines.append(f"per layer at {first['layers_at']} tokens (warm): layer, kind, mixer ms, whole layer ms")
        lines += [f"  {r['layer']:3d} {r['kind']:18} {r['mixer_s'] * 1e3:9.2f} {r['layer_s'] * 1e3:9.2f}"
                  for r in first["per_layer"]]
    if first.get("one_compile_s") is not None:
        lines.append(f"one NVRTC compile of a trivial custom kernel: {first['one_compile_s']:.2f} s "
                     "(P1 new: custom-kernel specialisations first launched by that row)")
    lines.append(f"PTX cache {first['ptx_cache']}: {first['cache_files_before']} files before, "
                 f"{first['cache_files_after']} after the 1st process"
                 + (f", {second['cache_files_after']} after the 2nd" if second and "cache_files_after" in second else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="a small shape (the default without a GPU)")
    ap.add_argument("--layers", type=int, default=0, help=f"layers (default: {GPU_LAYERS} on a GPU, the shape's else)")
    ap.add_argument("--lengths", default=None, help=f"prompt lengths (default {GPU_LENGTHS} on a GPU, {CPU_LENGTHS} else)")
    ap.add_argument("--gemm", choices=[g.value for g in GroupedGemm], help="the grouped form (default: the device's)")
    ap.add_argument("--no-bucket", action="store_true", help="no buckets: the exact group capacity (grouped.BUCKET_CAP) and prompt "
                                                              "length in attention (prompt_attention.BUCKET_POSITIONS)")
    ap.add_argument("--one-process", action="store_true", help="skip the second process")
    ap.add_argument("--path", choices=[k.value for k in KernelPath], help="the kernel path (default: the device's)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="both processes together")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    start = time.time()
    if args.path:
        with using_path(KernelPath(args.path)):
            first = probe(args)
    else:
        first = probe(args)
    if args.child:
        print("JSON " + json.dumps(first), flush=True)
        return
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--one-process"]
    second = None if args.one_process or first.get("interrupted") else second_process(forwarded, args.budget_s - (time.time() - start))
    print(table(first, second))
    print("JSON " + json.dumps({"bench": "jit_probe", "first_process": first, "second_process": second}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
