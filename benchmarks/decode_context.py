"""Compiled all-resident decode against the context length (issue 19): ms/token at contexts 8 and
2048 with the attention split over the context (the default past SPLIT_FROM positions:
kernels/attend_split.py; `split_chunks` the three-launch split before it) and with one block per
head (the form before the split), at the seed shape without a shared expert (48
layers, 256 experts top-10, hidden 2560, expert ffn 576, 16 q / 4 kv heads of 128, float16
dense, Q2_0 experts). Target: context 2048 within 1.3x of context 8.

The context is made, not prefilled: each attention layer's KV buffers hold random keys and values
at the first L positions (the prompt path is not what this measures, and a 2048-token prefill
would cost more than the whole measurement). Two numbers first: at 2048 the float32 KV cache is
2 x 4 heads x 2048 x 128 x 4 B = 8.4 MB a layer, 0.40 GB a token: ~0.12 ms at the H200's ~3.4
TB/s, against ~2.6 GB of weights and experts a token.

    python benchmarks/decode_context.py                    # seed shape (GPU)
    python benchmarks/decode_context.py --small            # smoke test (any machine: the emulated
                                                           #   kernels, uncompiled, tiny shape)
    python benchmarks/decode_context.py --contexts 8,512,2048,4000

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

from _measure import device_name, known_forms, part, switches_set  # noqa: E402
from decode_memory import resident_distinct  # noqa: E402
from strata.mlx_backend.attention import MlxLayerKV  # noqa: E402
from strata.mlx_backend import compiled as compiled_step  # noqa: E402
from strata.mlx_backend.compiled import CompiledDecode  # noqa: E402
from strata.mlx_backend import decode_experts  # noqa: E402
from strata.mlx_backend.kernels import attention as attn_kernels  # noqa: E402
from strata.mlx_backend.kernels import attend_project, attend_split, dense_gemv, folded_outputs, included_source  # noqa: E402
from strata.mlx_backend.kernels import launch  # noqa: E402
from strata.mlx_backend.kernels import decode_routing, moe_decode, moe_down_warps  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, current_path, using_path  # noqa: E402
from strata.mlx_backend import device_pipeline, greedy  # noqa: E402
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


# name -> (split past SPLIT_FROM, large kernel inputs as views: launch.GRAPH_VIEWS, positions per
# block when split: 0 for SPLIT_CHUNK)
FORMS = {
    "split": (True, True, 0),
    "split_ch32": (True, True, 32),
    "split_ch64": (True, True, 64),
    "split_ch256": (True, True, 256),
    "one_block": (False, True, 0),  # one block per head at every length (the form before the split)
    "no_views": (True, False, 0),  # whole arrays given to MLX: a CUDA graph commit after each expert kernel
    "kv16": (True, True, 0),  # split, with float16 KV caches (KVPrecision.F16: half the cache's bytes)
    "fused_experts": (True, True, 0),  # the fused expert kernel + combine (before kernels/moe_decode.py)
    "late_loads": (True, True, 0),  # the dense GEMVs' weight loads after their prologue (before EARLY_LOADS)
    "unfused_attention": (True, True, 0),  # attend and the output GEMV as two launches (before attend_project)
    "before19b": (True, True, 0),  # all three above: the decode step before the one-token work
    "bitonic": (True, True, 0),  # the gate/up launch ranks by warp sorts (decode_routing.Ranking.BITONIC)
    # a diagnostic, not a routing: the first k experts, no ranking (what the gate/up launch's ranking costs)
    "unranked": (True, True, 0),
    "down_warps": (True, True, 0),  # the down launch a warp per expert (kernels/moe_down_warps.py)
    "experts19": (True, True, 0),  # both, the weights weighed early (moe_decode.WEIGHTS_EARLY)
    "experts19_upw2": (True, True, 0),  # those, 2 gate/up units a warp (360 blocks)
    "experts19_nt128": (True, True, 0),  # experts19 with 128 threads a gate/up block (360 blocks)
    "vector_loads": (True, True, 0),  # gate/up's codes in 16-byte loads, down's in 8-byte ones (VECTOR_LOADS)
    "before_experts19": (True, True, 0),  # the expert step as before those (loop ranking, DOWN, weights late)
    # past SPLIT_FROM: attend split by chunks, its merge, the W_o GEMV (before kernels/attend_split.py)
    "split_chunks": (True, True, 0),
    "split_ns32": (True, True, 0),  # attend_split with 32 / 128 splits (64 by default)
    "split_ns128": (True, True, 0),
    "split_from32": (True, True, 0),  # the split from 33 positions on (SPLIT_FROM 32): where it starts to pay
    "chain_qkv": (True, True, 0),  # the QKV GEMV, attend and W_o as one launch (CHAIN_QKV; the default since)
    "unchained": (True, True, 0),  # the QKV GEMV and the router launches of their own (CHAIN_QKV off)
    "unrouted": (True, True, 0),  # the router a launch of its own (attend_project.CHAIN_ROUTER off)
    "route_rl10": (True, True, 0),  # the chained router's lanes 10 units in flight (ROUTE_ROW_LOADS; 5 by default)
    "unsummed": (True, True, 0),  # the router adds attend_project's H partials (SUM_PARTS off)
    "chain_pf8": (True, True, 0),  # 8 / 16 16-byte groups of W_o loaded before the chained wait (CHAIN_PREFETCH; 4 by default)
    "chain_pf16": (True, True, 0),
    "traced_views": (True, True, 0),  # the large inputs' views made inside the trace (compiled.CONSTANT_VIEWS off)
    "chain_experts": (True, True, 0),  # the gate/up and down launches as one (moe_decode.CHAIN_EXPERTS: 2 a layer)
    "plain_chain": (True, True, 0),  # the chain's QKV GEMV all at once, not by KV group (QKV_BY_GROUP off)
    "groups_pf4": (True, True, 0),  # the walk with 4 W_o groups loaded before the wait (GROUP_PREFETCH; 16 by default)
    "deferred": (True, True, 0),  # a layer's down step run by the next layer's launch (moe_decode.DEFER_DOWN: 2 a layer)
    "deferred_r16": (True, True, 0),  # that at 16 rows a block (moe_decode.DEFER_ROWS; 8 by default)
    "ranked": (True, True, 0),  # the top k ranked once, the attention launch's last phase (moe_decode.RANK_ONCE)
    "ranked_deferred": (True, True, 0),  # that and the deferred down step (2 launches a layer)
    "pick": (True, True, 0),  # the greedy selection as one launch of ours (greedy.PICK_KERNEL)
    "all_cuts": (True, True, 0),  # ranked_deferred and pick: 100 graph nodes a token at the seed shape (159)
    "unfolded": (True, True, 0),  # every output its own array (folded_outputs.FOLD_OUTPUTS off: 722 a token, not 482)
    "packed": (True, True, 0),  # the expert step's h handed on in one buffer (moe_decode.PACK_EXPERT_STEP; the default since)
    "unpacked": (True, True, 0),  # gate/up's outputs as arrays of their own for the down step (PACK_EXPERT_STEP off)
    # past SPLIT_FROM: the QKV GEMV, the split attention, its merge and the router as one launch (attend_split.CHAIN_SPLIT)
    "split_chain": (True, True, 0),
    "split_chain_ns32": (True, True, 0),  # the split chain with 32 splits (224 of its first two phases' blocks, not 352)
    # 5 rows a warp step in the split attention (attend_split.POSITIONS_PER_STEP; 4 by default): a split of
    # 33 positions (2049 over 64) in one step of 8 warps, not two for warp 0; alone and in the split chain
    "split_pb5": (True, True, 0),
    "split_chain_pb5": (True, True, 0),
    # a step's scores summed at once, each divided and exponentiated by one lane (attend_split.SPREAD)
    "split_spread": (True, True, 0),
    "split_pb5_spread": (True, True, 0),
    "split_chain_spread": (True, True, 0),
    "split_chain_pb5_spread": (True, True, 0),
    # every CUDA source handed to MLX whole (included_source.INCLUDED off: ~42 KB a layer hashed each
    # evaluation, not ~5)
    "inline_sources": (True, True, 0),
    # the kernels' constants made lazily, nodes of the compiled step where a trace made them
    # (launch.LEAF_CONSTANTS off: 100 other nodes a token, not 41)
    "lazy_constants": (True, True, 0),
    # h and z as arrays of their own between the attention launch and gate/up (moe_decode.HAND_ON off)
    "unhanded": (True, True, 0),
    # the defaults' two switches off: the six launches a layer past SPLIT_FROM (attend_split.CHAIN_SPLIT
    # off), and those with each score summed by its own warp_sum (SPREAD off too: the form before both)
    "split_six": (True, True, 0),
    "split_six_unspread": (True, True, 0),
}
# forms that flip a module switch for their run: (module, name, value) each
SWITCHES = {
    "fused_experts": ((decode_experts, "TWO_LAUNCHES", False),),
    "late_loads": ((dense_gemv, "EARLY_LOADS", False),),
    "unfused_attention": ((attend_project, "FUSED", False),),
    "before19b": ((decode_experts, "TWO_LAUNCHES", False), (dense_gemv, "EARLY_LOADS", False),
                  (attend_project, "FUSED", False)),
    "bitonic": ((decode_routing, "RANK_FORM", decode_routing.Ranking.BITONIC),),
    "unranked": ((decode_routing, "RANK_FORM", decode_routing.Ranking.NONE),),
    "down_warps": ((moe_decode, "DOWN_WARPS", True),),
    "experts19": ((decode_routing, "RANK_FORM", decode_routing.Ranking.BITONIC), (moe_decode, "DOWN_WARPS", True),
                  (moe_decode, "WEIGHTS_EARLY", True)),
    "experts19_upw2": ((decode_routing, "RANK_FORM", decode_routing.Ranking.BITONIC), (moe_decode, "DOWN_WARPS", True),
                       (moe_decode, "WEIGHTS_EARLY", True), (moe_decode, "GATEUP_UNITS_PER_WARP", 2)),
    "experts19_nt128": ((decode_routing, "RANK_FORM", decode_routing.Ranking.BITONIC), (moe_decode, "DOWN_WARPS", True),
                        (moe_decode, "WEIGHTS_EARLY", True), (moe_decode, "GATEUP_THREADS", 128)),
    "vector_loads": ((moe_decode, "GATEUP_VECTOR_LOADS", True), (moe_down_warps, "VECTOR_LOADS", True)),
    "before_experts19": ((decode_routing, "RANK_FORM", decode_routing.Ranking.LOOP), (moe_decode, "DOWN_WARPS", False),
                         (moe_decode, "WEIGHTS_EARLY", False), (moe_decode, "GATEUP_UNITS_PER_WARP", 4),
                         (moe_decode, "GATEUP_THREADS", 256), (moe_decode, "GATEUP_VECTOR_LOADS", False),
                         (moe_down_warps, "VECTOR_LOADS", False)),
    "split_chunks": ((attend_split, "FUSED", False),),
    "split_ns32": ((attend_split, "SPLITS", 32),),
    "split_ns128": ((attend_split, "SPLITS", 128),),
    "split_from32": ((attn_kernels, "SPLIT_FROM", 32),),
    "chain_qkv": ((attend_project, "CHAIN_QKV", True),),
    "unchained": ((attend_project, "CHAIN_QKV", False),),
    "unrouted": ((attend_project, "CHAIN_ROUTER", False),),
    "route_rl10": ((attend_project, "ROUTE_ROW_LOADS", 10),),
    "unsummed": ((attend_project, "SUM_PARTS", False),),
    "chain_pf8": ((attend_project, "CHAIN_PREFETCH", 8),),
    "chain_pf16": ((attend_project, "CHAIN_PREFETCH", 16),),
    "traced_views": ((compiled_step, "CONSTANT_VIEWS", False),),
    "chain_experts": ((moe_decode, "CHAIN_EXPERTS", True),),
    "plain_chain": ((attend_project, "QKV_BY_GROUP", False),),
    "groups_pf4": ((attend_project, "GROUP_PREFETCH", 4),),
    "deferred": ((moe_decode, "DEFER_DOWN", True),),
    "deferred_r16": ((moe_decode, "DEFER_DOWN", True), (moe_decode, "DEFER_ROWS", 16)),
    "ranked": ((moe_decode, "RANK_ONCE", True),),
    "ranked_deferred": ((moe_decode, "RANK_ONCE", True), (moe_decode, "DEFER_DOWN", True)),
    "pick": ((greedy, "PICK_KERNEL", True),),
    "all_cuts": ((moe_decode, "RANK_ONCE", True), (moe_decode, "DEFER_DOWN", True), (greedy, "PICK_KERNEL", True)),
    "unfolded": ((folded_outputs, "FOLD_OUTPUTS", False),),
    "packed": ((moe_decode, "PACK_EXPERT_STEP", True),),
    "unpacked": ((moe_decode, "PACK_EXPERT_STEP", False),),
    "split_chain": ((attend_split, "CHAIN_SPLIT", True),),
    "split_chain_ns32": ((attend_split, "CHAIN_SPLIT", True), (attend_split, "SPLITS", 32)),
    "split_pb5": ((attend_split, "POSITIONS_PER_STEP", 5),),
    "split_chain_pb5": ((attend_split, "CHAIN_SPLIT", True), (attend_split, "POSITIONS_PER_STEP", 5)),
    "split_spread": ((attend_split, "SPREAD", True),),
    "split_pb5_spread": ((attend_split, "POSITIONS_PER_STEP", 5), (attend_split, "SPREAD", True)),
    "split_six": ((attend_split, "CHAIN_SPLIT", False),),
    "split_six_unspread": ((attend_split, "CHAIN_SPLIT", False), (attend_split, "SPREAD", False)),
    "split_chain_spread": ((attend_split, "CHAIN_SPLIT", True), (attend_split, "SPREAD", True)),
    "split_chain_pb5_spread": ((attend_split, "CHAIN_SPLIT", True), (attend_split, "POSITIONS_PER_STEP", 5),
                               (attend_split, "SPREAD", True)),
    # every CUDA source handed to MLX whole, hashed in full each evaluation (the default before
    # included_source.py)
    "inline_sources": ((included_source, "INCLUDED", False),),
    # the kernels' constants made lazily (launch.LEAF_CONSTANTS off): those a trace makes replayed by
    # the compiled step on every call (an add per device_const, the index table's arange, a slice a
    # layer for the slot base), as before
    "lazy_constants": ((launch, "LEAF_CONSTANTS", False),),
    # h and z as the attention launch's own outputs, gate/up reading them as arrays (moe_decode.HAND_ON off)
    "unhanded": ((moe_decode, "HAND_ON", False),),
}


def switched(form: str):
    """SWITCHES' module switches of `form` (none for a form without) set, then restored."""
    return switches_set(SWITCHES.get(form, ()))


def decode_ms(p, length: int, tokens: int, *, form: str, traced: bool) -> dict:
    """Median ms/token of `tokens` compiled decode steps from a made context of `length`."""
    split, views, chunk = FORMS[form]
    saved = attn_kernels.SPLIT_FROM, launch.GRAPH_VIEWS, attn_kernels.SPLIT_CHUNK
    attn_kernels.SPLIT_FROM = saved[0] if split else 1 << 30
    launch.GRAPH_VIEWS = views
    attn_kernels.SPLIT_CHUNK = chunk or saved[2]
    try:
        with switched(form):  # after the above: a switch may set SPLIT_FROM too
            return _decode_ms(p, length, tokens, form=form, traced=traced)
    finally:
        attn_kernels.SPLIT_FROM, launch.GRAPH_VIEWS, attn_kernels.SPLIT_CHUNK = saved


def _decode_ms(p, length: int, tokens: int, *, form: str, traced: bool) -> dict:
    state = state_at(p.cfg, length, seed=length, dtype=mx.float16 if form == "kv16" else mx.float32)
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
    loop (each token's logits read, argmax on the host: device_pipeline.PIPELINED off), real argmax
    tokens both; and whether the two made the same tokens. Per token: the time from token 0 (from
    one host decode, as a prefill's logits) to the last, over the `tokens` steps decoded between
    (the pipeline's first step, not overlapped, included)."""
    eng = MlxEngine(p)
    eng.state, eng._step = state, step  # the made context; the step already traced on its buffers
    eng._tokens = [0] * state.length  # the session's positions (their ids do not matter: the rows are made)
    start, out = state.length, {}
    # "warm" first, untimed: the device selection's first call compiles its fused kernels (NVRTC,
    # seconds; the H200's mid-session run timed it inside the pipelined row: 289 ms a token)
    for name, flag, count in (("warm", True, 3), ("pipelined", True, tokens), ("host", False, tokens)):
        saved, device_pipeline.PIPELINED = device_pipeline.PIPELINED, flag
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
            device_pipeline.PIPELINED = saved
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
    ap.add_argument("--forms", default="split,one_block", help="comma list of " + ", ".join(FORMS))
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
