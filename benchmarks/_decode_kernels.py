"""A decoded token's kernels one by one at the issue's shape (the seed without a shared expert:
48 layers of D 2560, 256 experts top-10 of F 576, 16 q / 4 kv heads of 128, float16 dense, Q2_0
experts): `benchmarks/kernels.py --decode` (wall time per launch in chains of 48 launches an
evaluation, a token's worth, host dispatch included) and `benchmarks/kernels.py --ncu decode`
(the launches ncu times: a decoded token in the kernel plan's presets, and the two expert
launches' other block shapes).

Each chain's inputs cycle over LAYERS layers' weights (26 MB of dense weights a layer, 10 of 256
experts picked afresh): each launch reads from HBM, as in decode, not from the 60 MB L2.
Bytes per launch (what each must read at least): QKV 15.7 MB, output projection 10.5 MB,
router 2.6 MB (float32), experts 13.8 MB (10 Q2_0 records), of which gate/up 9.2 and down 4.6.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np

from _measure import median_time, ncu_marker, part
from strata.mlx_backend.kernel_plan import PRESETS, using_plan
from strata.mlx_backend.attention import MlxLayerKV, rope_table_cached
from strata.mlx_backend.kernels import attention as attn_kernels
from strata.mlx_backend.kernels import combine as combine_kernel
from strata.mlx_backend.kernels import attend_project, decode_routing, dense_gemv, moe, moe_decode
from strata.mlx_backend.kernels import router as router_kernel
from strata.mlx_backend.kernels.launch import KernelPath, current_path, gpu_dialect
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.model import MlxModelState, forward, layer_forward
from strata.testing.mlx_params import SEED_SHAPE, random_params

SHAPE = replace(SEED_SHAPE, shared_ffn_size=0, shared_expert_gated=False)
SMALL = replace(SHAPE, hidden_size=256, n_experts=16, n_experts_per_token=4, expert_ffn_size=64, n_heads=4,
                n_kv_heads=2, head_dim=64, vocab_size=512, max_context=64)
LAYERS = 12  # weights cycled through a chain: 12 x (26 MB dense + 256 x 1.38 MB experts) > the L2
PER_CALL = 48
# (gate/up units a warp, down rows a warp) of kernels/moe_decode.py: the default first
SHAPES = ((moe_decode.GATEUP_UNITS_PER_WARP, moe_decode.DOWN_ROWS_PER_WARP), (2, 1), (1, 1), (4, 2), (2, 2))
NCU_SHAPES = ((2, 1), (4, 2))  # each a kernel specialisation more to compile (seconds each in a fresh process)


def _inputs(cfg, n: int, seed: int):
    rng = np.random.default_rng(seed)
    dev = lambda a: mx.array(a) + 0  # noqa: E731  device memory (an op's output), not host-made
    xs = [dev(rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)) for _ in range(n)]
    zs = [dev(rng.standard_normal((1, cfg.n_experts)).astype(np.float32)) for _ in range(n)]
    os_ = [dev(rng.standard_normal((1, cfg.n_heads * cfg.head_dim)).astype(np.float32)) for _ in range(n)]
    mx.eval(*xs, *zs, *os_)
    return xs, zs, os_


# the decoded token's expert step in each form (label, routed_residual keywords): the form before
# this work first (its output the others are compared with), then today's defaults and the forms
# beside them; the diagnostics compute no routing (the first k experts) or no products: what the
# ranking and the arithmetic cost, their outputs not the layer's
_R = decode_routing.Ranking
EXPERT_FORMS = (
    ("default: bitonic ranking, 2 units a warp + down_warps", {}),
    ("loop ranking", {"rounds": _R.LOOP}),
    ("bitonic ranking, 4 units a warp + down_warps", {"upw": 4}),
    ("default, 8 rows a down block -> 16", {"down_rows": 16}),
    ("diagnostic: no ranking", {"rounds": _R.NONE}),
    ("diagnostic: no arithmetic in gate/up", {"no_arithmetic": True}),
    ("diagnostic: no ranking, no arithmetic in gate/up", {"rounds": _R.NONE, "no_arithmetic": True}),
)


def ncu_expert_launches(small: bool = False) -> None:
    """The expert step of one decoded token in every form of EXPERT_FORMS, twice each (two
    layers' records), in that order: 4 launches a form for ncu; each form's output against the
    first's (FAST's 2e-5: the forms differ in summation order only)."""
    cfg = replace(SMALL if small else SHAPE, n_layers=2)
    p = random_params(cfg, seed=0, pred_q8=False)
    (x,), (z,), _ = _inputs(cfg, 1, 1)
    rule = p.layers[0].rule
    first = None
    for label, kw in EXPERT_FORMS:
        outs = [moe_decode.routed_residual(p.arena.array, p.rec, x, x, z, layer * cfg.n_experts, rule.k, rule.order,
                                           rule.norm_topk_prob, **kw) for layer in range(2)]
        mx.eval(*outs)
        got = np.stack([np.array(o, np.float64) for o in outs])
        first = got if first is None else first
        err = np.linalg.norm(got - first) / np.linalg.norm(first)
        print(f"expert form {label}: 4 launches; rel L2 to the first form {err:.2e}"
              + (" (a diagnostic: not the layer's output)" if label.startswith("diagnostic") else ""), flush=True)


def ncu_decode_launches(small: bool = False) -> None:
    """Two layers: one decoded token (the first position) in each of the kernel plan's presets
    that changes a launch (default, unchained), then the expert launches' other block shapes and
    ranking forms."""
    cfg = replace(SMALL if small else SHAPE, n_layers=2)
    p = random_params(cfg, seed=0, pred_q8=False)
    out = {}
    for name in ("default", "unchained"):
        with using_plan(PRESETS[name]):
            logits, _ = forward(p, MlxModelState.empty(cfg), np.array([5]))  # the first position: no prompt to profile
            out[name] = np.array(logits, np.float64)
    err = np.linalg.norm(out["default"] - out["unchained"]) / np.linalg.norm(out["unchained"])
    print(f"decoded logits, default vs unchained: rel L2 {err:.2e} (budget FORWARD 1e-4)", flush=True)
    (x,), (z,), (o,) = _inputs(cfg, 1, 1)
    lw, rule = p.layers[0], p.layers[0].rule
    for upw, rw in NCU_SHAPES:
        mx.eval(moe_decode.routed_residual(p.arena.array, p.rec, x, x, z, 0, rule.k, rule.order, rule.norm_topk_prob,
                                           upw=upw, rw=rw))
    for form in decode_routing.ROUTING_FORMS:  # the other ranking forms
        if form is not decode_routing.RANK_FORM:
            mx.eval(moe_decode.routed_residual(p.arena.array, p.rec, x, x, z, 0, rule.k, rule.order,
                                               rule.norm_topk_prob, rounds=form))
    mx.eval(dense_gemv.dense_gemv(lw.attn.wqkv, x, lw.attn.norm, cfg.rms_norm_eps), dense_gemv.dense_gemv(lw.attn.wo, o))
    qkv = dense_gemv.dense_gemv(lw.attn.wqkv, x, lw.attn.norm, cfg.rms_norm_eps)
    cos, sin = rope_table_cached(cfg)
    kv = MlxLayerKV.empty(cfg)
    mx.eval(attend_project.attend_project(qkv, lw.attn.q_norm, lw.attn.k_norm, cos, sin, kv.keys, kv.values,
                                          lw.attn.wo, 8, cfg.rms_norm_eps, cfg.n_heads, prefetch=8))  # half the row first


# a decoded token's layer with its launches chained (the default: QKV walked by KV group +
# attention + router in one launch, 3 a layer) and without (Metal's form: 5 a layer)
CHAIN_PLANS = ("default", "unchained")


def ncu_chain_forms(small: bool = False, layers: int = 4) -> dict[str, float]:
    """One decoded token (context 8) of a `layers`-layer model in each plan of CHAIN_PLANS, twice
    over (the first pass holds each kernel's first launch), each token between two marker
    launches (`strata_probe_marker`: benchmarks/ncu_summary.py's segments); the logits of each
    plan against the last's (the same argmax, rel L2 within FORWARD's 1e-4), returned by name."""
    cfg = replace(SMALL if small else SHAPE, n_layers=layers)
    p = random_params(cfg, seed=0, pred_q8=False)
    # no markers off CUDA's kernel path (the emulated smoke test: the plans' logits only)
    cuda = gpu_dialect() is Dialect.CUDA and current_path() is KernelPath.GPU
    mark = ncu_marker() if cuda else (lambda: None)

    out = {}
    for rep in range(2):
        for name in CHAIN_PLANS:
            with using_plan(PRESETS[name]):
                logits, state = forward(p, MlxModelState.empty(cfg), np.arange(7) + 3)
                mx.eval(logits)
                mark()
                logits, _ = forward(p, state, np.array([5]))
                mx.eval(logits)
                mark()
            out.setdefault(name, np.array(logits, np.float64))
            print(f"ncu segment (a prompt of 7, then this token): pass {rep + 1}, {name}", flush=True)
    ref = out[CHAIN_PLANS[-1]]
    errs = {}
    for label, got in out.items():
        errs[label] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        print(f"{label}: rel L2 to the last form {errs[label]:.2e}, the same argmax {int(got.argmax()) == int(ref.argmax())}")
    return errs


def decode_part(res: dict, rows: list, *, small: bool = False) -> None:
    """Per-launch wall time of each decode kernel in chains of PER_CALL launches."""
    cfg = replace(SMALL if small else SHAPE, n_layers=2 if small else LAYERS)
    p = random_params(cfg, seed=0, pred_q8=False)
    n = PER_CALL
    xs, zs, os_ = _inputs(cfg, n, 2)
    lws = [p.layers[i % cfg.n_layers] for i in range(n)]
    bases = [(i % cfg.n_layers) * cfg.n_experts for i in range(n)]
    k, eps = cfg.n_experts_per_token, cfg.rms_norm_eps
    cos, sin = rope_table_cached(cfg)
    kvs = [MlxLayerKV.empty(cfg) for _ in range(cfg.n_layers)]
    rule = lws[0].rule
    one = mx.zeros((1, 1, cfg.hidden_size))
    mx.eval(one)

    def qkv():
        return [dense_gemv.dense_gemv(lws[i].attn.wqkv, xs[i], lws[i].attn.norm, eps) for i in range(n)]

    qkv_out = qkv()
    mx.eval(*qkv_out)
    cases = {
        "qkv GEMV": (lambda: qkv(), 1),
        "attend (context 8)": (lambda: [attn_kernels.attend(qkv_out[i], lws[i].attn.q_norm, lws[i].attn.k_norm, cos, sin,
                                                            kvs[i % cfg.n_layers].keys,
                                                            kvs[i % cfg.n_layers].values, 8, eps, cfg.n_heads)
                                        for i in range(n)], 1),
        "attend + output projection (one launch, context 8)": (lambda: [attend_project.attend_project(
            qkv_out[i], lws[i].attn.q_norm, lws[i].attn.k_norm, cos, sin, kvs[i % cfg.n_layers].keys,
            kvs[i % cfg.n_layers].values, lws[i].attn.wo, 8, eps, cfg.n_heads) for i in range(n)], 1),
        "output GEMV": (lambda: [dense_gemv.dense_gemv(lws[i].attn.wo, os_[i]) for i in range(n)], 1),
        "router": (lambda: [router_kernel.router(xs[i], one, lws[i].ffn_norm, lws[i].router, None, None, eps)[2]
                            for i in range(n)], 1),
        "experts fused + combine (8 tokens and more)": (lambda: [combine_kernel.combine(
            xs[i], moe.moe_route(p.arena.array, p.rec, xs[i], zs[i], bases[i], k, rule.order, rule.norm_topk_prob),
            None, xs[i], None) for i in range(n)], 2),
    }
    for upw, rw in SHAPES:
        cases[f"experts gate/up + down, UPW {upw} RW {rw}"] = (lambda upw=upw, rw=rw: [moe_decode.routed_residual(
            p.arena.array, p.rec, xs[i], xs[i], zs[i], bases[i], k, rule.order, rule.norm_topk_prob, upw=upw, rw=rw)
            for i in range(n)], 2)
    at8 = [MlxLayerKV(kv.keys, kv.values, 8) for kv in kvs]  # context 8 (the buffers' zeros as keys: speed only)
    cases["whole layer (5 launches)"] = (lambda: [layer_forward(p, i % cfg.n_layers, at8[i % cfg.n_layers], xs[i])[0]
                                                  for i in range(n)], 5)
    for name, (fn, launches) in cases.items():
        with part("decode_" + name.split(" (")[0].replace(" ", "_").replace("/", "").replace(",", ""), res, rows):
            t = median_time(lambda fn=fn: mx.eval(*fn()), warmup=2, reps=7) / n
            res[f"decode {name} us"] = t * 1e6
            rows.append((f"{name}", f"{t * 1e6:.1f} us/call", f"{launches} launch(es) a call, {n} calls an evaluation"))
