"""Compiled all-resident decode against the context length: ms/token at contexts 8 and 2048 (the
attention split over the context past SPLIT_FROM positions: kernels/attend_split.py), at the seed
shape without a shared expert (48 layers, 256 experts top-10, hidden 2560, expert ffn 576, 16 q /
4 kv heads of 128, float16 dense, Q2_0 experts), in the kernel plan's presets
(strata/mlx_backend/kernel_plan.py) and with float16 KV caches. Target: context 2048 within 1.3x
of context 8.

The context is made, not prefilled: each attention layer's KV buffers hold random keys and values
at the first L positions (the prompt path is not what this measures, and a 2048-token prefill
would cost more than the whole measurement). Two numbers first: at 2048 the float32 KV cache is
2 x 4 heads x 2048 x 128 x 4 B = 8.4 MB a layer, 0.40 GB a token: ~0.12 ms at the H200's ~3.4
TB/s, against ~2.6 GB of weights and experts a token.

    python benchmarks/decode_context.py                    # seed shape (GPU)
    python benchmarks/decode_context.py --small            # smoke test (any machine: the emulated
                                                           #   kernels, uncompiled, tiny shape)
    python benchmarks/decode_context.py --contexts 8,512,2048,4000
    python benchmarks/decode_context.py --forms default,unchained,no_views,kv16

Each run also times generate's greedy token source over an MlxEngine at that context (the
"generate" row): pipelined, the next token chosen on the device (what `generate` does), beside
the host loop that reads each token's logits, with real argmax tokens (the rows above feed
random or fixed ones).

Prints a table and one JSON line; a JSON-PART line after each context survives a kill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import device_name, known_forms, part  # noqa: E402
from decode_memory import resident_distinct  # noqa: E402
from strata.mlx_backend.attention import MlxLayerKV  # noqa: E402
from strata.mlx_backend.compiled import CompiledDecode  # noqa: E402
from strata.mlx_backend.kernel_plan import PRESETS, using_plan  # noqa: E402
from strata.mlx_backend.kernel_plan import current as current_plan  # noqa: E402
from strata.mlx_backend.kernels import attention as attn_kernels  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, current_path, using_path  # noqa: E402
from strata.mlx_backend.engine import MlxEngine  # noqa: E402
from strata.mlx_backend.model import MlxModelState  # noqa: E402
from strata.generate import _steps  # noqa: E402
from strata.reference.sampling import SamplerConfig  # noqa: E402
from strata.testing.mlx_params import SEED_SHAPE, random_params  # noqa: E402

# the shape: the seed without a shared expert
SHAPE = replace(SEED_SHAPE, shared_ffn_size=0, shared_expert_gated=False)
SMALL = replace(SHAPE, n_layers=2, hidden_size=256, n_experts=16, n_experts_per_token=4, expert_ffn_size=64,
                n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512, max_context=512)


def state_at(cfg, length: int, seed: int, dtype=mx.float32) -> MlxModelState:
    """Every layer's KV buffers [KVH, S_MAX, HD] with random keys / values at positions < length."""
    rng = mx.random.key(seed)
    layers = []
    for l in range(cfg.n_layers):
        kk, kv = mx.random.split(mx.random.split(rng, cfg.n_layers)[l])
        shape = (cfg.n_kv_heads, cfg.max_context, cfg.head_dim)
        live = (mx.arange(cfg.max_context) < length)[None, :, None]
        k = mx.where(live, mx.random.normal(shape, key=kk), 0.0).astype(dtype)
        v = mx.where(live, mx.random.normal(shape, key=kv), 0.0).astype(dtype)
        mx.eval(k, v)
        layers.append(MlxLayerKV(k, v, length))
    return MlxModelState(tuple(layers))


# name -> (the kernel plan's preset, float16 KV caches); "split" is the default plan's name in the
# rows and JSON lines before the presets (kept so their keys compare)
FORMS = {
    "split": ("default", False),
    "default": ("default", False),
    "unchained": ("unchained", False),  # one launch a kernel (Metal's form) on this GPU
    "no_views": ("no_views", False),  # whole arrays given to MLX: a CUDA graph commit after each expert kernel
    "kv16": ("default", True),  # float16 KV caches (KVPrecision.F16: half the cache's bytes)
}


def decode_ms(p, length: int, tokens: int, *, form: str, traced: bool) -> dict:
    """Median ms/token of `tokens` compiled decode steps from a made context of `length`."""
    plan, _ = FORMS[form]
    with using_plan(PRESETS[plan]):  # the step traces (and replays) under the form's plan
        return _decode_ms(p, length, tokens, form=form, traced=traced)


def _decode_ms(p, length: int, tokens: int, *, form: str, traced: bool) -> dict:
    state = state_at(p.cfg, length, seed=length, dtype=mx.float16 if FORMS[form][1] else mx.float32)
    step = CompiledDecode(p, state, traced=traced)
    rng = np.random.default_rng(length)
    times = []
    before = sum(LAUNCHES.values())
    for i in range(tokens + 1):
        t0 = time.perf_counter()
        logits, state = step(state, int(rng.integers(0, p.cfg.vocab_size)))
        np.array(logits[-1], dtype=np.float32)
        times.append(time.perf_counter() - t0)
    first = times.pop(0)  # the trace
    # the same steps with no host wait between them (the next token fixed, as a device-side
    # sampler would allow): what the host's encoding and the GPU sustain, without the round trip
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits, state = step(state, 1)
        mx.async_eval(logits)
    mx.eval(logits)
    pipelined = (time.perf_counter() - t0) / tokens
    launches = sum(LAUNCHES.values()) - before
    loops = generate_loops(p, state, step, tokens)
    return {"ms": float(np.median(times)) * 1e3, "first_ms": first * 1e3, "min_ms": float(np.min(times)) * 1e3,
            "pipelined_ms": pipelined * 1e3, **loops,
            "wrapper_launches": launches,
            "split": attn_kernels.split_applies(length + 1, 1)}


def generate_loops(p, state: MlxModelState, step: CompiledDecode, tokens: int) -> dict:
    """ms/token of generate's own token source (strata.generate._steps, greedy) over an MlxEngine
    holding this context, from the same position twice: pipelined (the next token chosen on the
    device, step n + 1 enqueued before token n is read: what `generate` does now) and the host
    loop (each token's logits read, argmax on the host: the plan's pipelined off), real argmax
    tokens both; and whether the two made the same tokens. Per token: the time from token 0 (from
    one host decode, as a prefill's logits) to the last, over the `tokens` steps decoded between
    (the pipeline's first step, not overlapped, included)."""
    eng = MlxEngine(p)
    planned = current_plan()  # the form's plan (decode_ms put it in force), its pipelined set below
    eng.state, eng._step = state, step  # the made context; the step already traced on its buffers
    eng._tokens = [0] * state.length  # the session's positions (their ids do not matter: the rows are made)
    start, out = state.length, {}
    # "warm" first, untimed: the device selection's first call compiles its fused kernels (NVRTC,
    # seconds; the H200's mid-session run timed it inside the pipelined row: 289 ms a token)
    for name, flag, count in (("warm", True, 3), ("pipelined", True, tokens), ("host", False, tokens)):
        eng.plan = replace(planned, pipelined=flag)
        try:
            eng.trim(start)
            source = _steps(eng, eng.decode(1), SamplerConfig(), None, p.cfg.max_context, [])
            stamps, made = [], []
            for n in range(count + 1):
                token, _ = source.next(n)
                stamps.append(time.perf_counter())
                made.append(token)
                if n < count:
                    source.advance(token, n, room=count - n)
                else:
                    source.finish(n)
        finally:
            eng.plan = None
        if name != "warm":
            out[f"generate_{name}_ms"] = (stamps[-1] - stamps[0]) / count * 1e3
            out[f"generate_{name}_tokens"] = made
    out["generate_same_tokens"] = out.pop("generate_pipelined_tokens") == out.pop("generate_host_tokens")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="tiny shape on the emulated kernels, uncompiled")
    ap.add_argument("--contexts", default="8,2048")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--also", default="", help="more CONTEXT/FORM runs after those, e.g. 8/no_views")
    ap.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    ap.add_argument("--forms", default="split", help="comma list of " + ", ".join(FORMS))
    args = ap.parse_args()
    cfg = SMALL if args.small else SHAPE
    if args.layers:
        cfg = replace(cfg, n_layers=args.layers)
    contexts = [int(c) for c in args.contexts.split(",")]
    forms = known_forms(ap, "--forms", [f for f in args.forms.split(",") if f], FORMS)
    also = [(int(a.split("/")[0]), a.split("/")[1]) for a in args.also.split(",") if a]
    known_forms(ap, "--also", [f for _, f in also], FORMS)
    path = KernelPath.EMULATED if args.small else current_path()
    if path is KernelPath.OPS:
        ap.error("no MLX GPU here: the compiled step needs the GPU kernel path (--small runs the emulated kernels)")
    traced = path is KernelPath.GPU
    res: dict = {"device": device_name(), "mlx": mx.__version__, "path": path.value, "traced": traced,
                 "layers": cfg.n_layers, "hidden": cfg.hidden_size, "heads": [cfg.n_heads, cfg.n_kv_heads, cfg.head_dim],
                 "split_from": attn_kernels.SPLIT_FROM, "split_chunk": attn_kernels.SPLIT_CHUNK, "ms": {}}
    rows: list = []
    with using_path(path):
        t0 = time.time()
        p = random_params(cfg, seed=0, pred_q8=False, distinct_records=resident_distinct(cfg))
        res["build_s"] = time.time() - t0
        print(f"built the model in {res['build_s']:.1f} s", flush=True)
        runs = [(c, f) for c in contexts for f in forms]
        runs += also
        for ctx, form in runs:
            if args.small:
                ctx = min(ctx, cfg.max_context - args.tokens - 2)
            with part(f"ctx{ctx}_{form}", res, rows):
                r = decode_ms(p, ctx, 2 if args.small else args.tokens, form=form, traced=traced)
                key, n = f"{ctx}/{form}", 2
                while key in res["ms"]:  # a form run again (an order control): kept beside the first
                    key, n = f"{ctx}/{form}#{n}", n + 1
                res["ms"][key] = r
                rows.append((f"context {ctx}, {form}", f"{r['ms']:.2f} ms/token",
                             f"min {r['min_ms']:.2f}; no host wait {r['pipelined_ms']:.2f}; trace "
                             f"{r['first_ms']:.0f} ms; split used: {r['split']}"))
                rows.append((f"context {ctx}, {form}, generate", f"{r['generate_pipelined_ms']:.2f} ms/token",
                             f"pipelined (device argmax); host loop {r['generate_host_ms']:.2f}; same tokens: "
                             f"{r['generate_same_tokens']}"))
    first = min(contexts[0], cfg.max_context - args.tokens - 2) if args.small else contexts[0]
    base = {f: res["ms"].get(f"{first}/{f}", {}).get("ms") for f in FORMS}
    for key, r in res["ms"].items():
        ctx, form = key.split("#")[0].split("/")
        if base.get(form):
            r["ratio_to_first_context"] = r["ms"] / base[form]
    print(f"## decode vs context on {res['device']} (path {path.value}, MLX {mx.__version__}; {cfg.n_layers} layers, "
          f"D={cfg.hidden_size}, heads {cfg.n_heads}/{cfg.n_kv_heads}x{cfg.head_dim}; split past "
          f"{attn_kernels.SPLIT_FROM} positions, chunks of {attn_kernels.SPLIT_CHUNK})")
    for name, val, note in rows:
        print(f"{name:<28} {val:>16}  {note}")
    for key, r in res["ms"].items():
        if "ratio_to_first_context" in r:
            print(f"{key:<28} {r['ratio_to_first_context']:>14.2f}x  of context {contexts[0]} (target <= 1.3x at 2048)")
    print("JSON " + json.dumps(res, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
