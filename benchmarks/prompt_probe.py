"""Where a prompt's time goes on the MLX prompt path (issue 19), step by step, so the next fix is
chosen by data. At the seed shape without a shared expert (48 layers, 256 experts top-10, D 2560,
F 576, 16 q / 4 kv heads of 128, f16 dense, Q2_0 experts), for each grouped form (--forms,
default q2tiles then padded), in this order, each part printed as a `JSON-PART` line as it ends:

1. the whole prompt at each of --lengths: the first call (JIT compiles: reported apart, with the
   custom-kernel specialisations it launched first) and the median of --repeat later calls, each
   on a fresh KV state; the last position's logits kept (every form is compared with the first);
2. one synchronised pass at the largest length: each layer evaluated alone (ms), and its routing's
   largest group against the mean (what the padded forms' E x cap rows pay for); the inputs of
   layer --layer-at's expert step kept;
3. one layer at the largest length, each step evaluated alone on evaluated inputs (attention's
   four steps, the router, routing, each step of the form's expert path, the decode's fused
   expert kernel on the same pairs), on the inputs of 2. (the prompt's real routing).

`--tile-forms rows,cols,breg,breg2` runs the q2tiles form once per body of the tile kernel (q2_tiles.TileForm),
named `q2tiles:rows`, `q2tiles:cols`, ... (default: each step's fastest body, q2_tiles.BEST).

`--ncu` runs one layer per form on a one-layer model, each after a marker kernel
(`strata_probe_marker`), for `ncu --metrics gpu__time_duration.sum` (benchmarks/ncu_summary.py
prints each kernel's GPU time per segment between markers).

`--variants` (a comma list, e.g. `all,none,-topk,-sort,-norm,-qkv`) times the whole prompt at the
largest length with the prompt path's kernel flags (FLAGS: the top-k and pair-sort kernels, the
row kernels) all on (`all`), all off (`none`), all on but one (`-name`), or all on and an opt-in
one (`+name`, OPT_IN: the QKV GEMM on one term), in one process, right
after the first form's whole prompts; logits compared with the first variant's. With `--ncu`,
the first variant's flags.

--budget-s bounds the run: a part that would not fit is skipped and says so. Prints a table and
one JSON line (`JSON {...}`).

    python3 benchmarks/prompt_probe.py --lengths 512,2048 --budget-s 120        # the H200
    python3 benchmarks/prompt_probe.py --small --lengths 64,128 --path emulated  # smoke test (CPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import median_time, ncu_marker  # noqa: E402
from strata.mlx_backend import grouped, grouped_tiles, lowp, prompt_rows  # noqa: E402
from strata.mlx_backend import jit_cache  # noqa: E402,F401  (jit_cache: the PTX cache default)
from strata.mlx_backend import prompt as prompt_mod  # noqa: E402
from strata.mlx_backend.attention import rms_norm  # noqa: E402
from strata.mlx_backend.experts import experts_route, gated_hidden  # noqa: E402
from strata.mlx_backend.grouped import GroupedGemm, dequantized_experts, grouped_experts, route_prompt  # noqa: E402
from strata.mlx_backend.grouped_tiles import tile_table  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path  # noqa: E402
from strata.mlx_backend.kernels import q2_tiles as q2_tiles_mod  # noqa: E402
from strata.mlx_backend.kernels.q2_tiles import BM, TileForm, q2_tiles  # noqa: E402
from strata.mlx_backend.lowp import lowp_matmul  # noqa: E402
from strata.mlx_backend.model import MlxModelState, embed  # noqa: E402
from strata.mlx_backend.prompt import _layer, prompt_forward  # noqa: E402
from strata.mlx_backend.prompt_attention import _rope, prompt_attention  # noqa: E402
from strata.reference.experts import expert_act  # noqa: E402
from strata.testing.mlx_params import SEED_SHAPE, random_params  # noqa: E402

SMALL = replace(SEED_SHAPE, n_layers=4, hidden_size=256, n_experts=32, n_experts_per_token=4, expert_ffn_size=64,
                n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512)
T0 = time.time()


@dataclass(frozen=True)
class Form:
    """A grouped form, and for Q2_TILES which body of the tile kernel (None: q2_tiles.BEST's by step)."""

    gemm: GroupedGemm
    tile: TileForm | None = None

    @property
    def value(self) -> str:
        return self.gemm.value + (f":{self.tile.value}" if self.tile else "")

    def select(self) -> None:
        grouped.GEMM = self.gemm
        q2_tiles_mod.FORM = self.tile  # None: each step's fastest body (q2_tiles.BEST)


def part(obj: dict) -> None:
    print("JSON-PART " + json.dumps({**obj, "t": round(time.time() - T0, 1)}), flush=True)


# The prompt path's kernel flags --variants switches (module, constant), by name.
FLAGS = {"topk": (grouped, "TOPK_KERNEL"), "weights": (grouped, "WEIGHTS_KERNEL"),
         "sort": (grouped_tiles, "COUNTING_SORT"), "norm": (prompt_rows, "NORM_KERNEL"),
         "qkv": (prompt_rows, "QKV_KERNEL"), "oproj": (prompt_rows, "O_AS_IS")}


# Opt-in flags (off by default): `+name` is every FLAGS flag on and this one too.
OPT_IN = {"qkv1": (prompt_rows, "QKV_ONE_TERM")}


def set_variant(name: str) -> None:
    """all: every flag on; none: every flag off; -x: every flag on but x; +y: all, and opt-in y."""
    if name not in ("all", "none") and name.lstrip("-") not in FLAGS and name.lstrip("+") not in OPT_IN:
        raise SystemExit(f"prompt_probe: variant {name!r} (all, none, -{' / -'.join(FLAGS)} or "
                         f"+{' / +'.join(OPT_IN)})")
    for flag, (mod, const) in FLAGS.items():
        setattr(mod, const, name != "none" and name != f"-{flag}")
    for flag, (mod, const) in OPT_IN.items():
        setattr(mod, const, name == f"+{flag}")


def variants(p, form, names: list[str], n: int, reps: int, seen: set, left) -> dict:
    """--variants: the whole prompt of n tokens (the first --forms form) per flag variant, logits
    against the first variant's."""
    out, first = {}, None
    try:
        for name in names:
            if left() < 8:
                out[name] = {"skipped": f"{left():.0f} s left"}
                part({"variant": name, **out[name]})
                continue
            set_variant(name)
            try:
                w = whole_prompts(p, form, [n], reps, seen)[n]
            except Exception as exc:  # reported, not fatal: the next variant still runs
                out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                part({"variant": name, **out[name]})
                continue
            row = {k: v for k, v in w.items() if k != "logits"}
            if first is None:
                first = w["logits"]
            else:
                row["rel_l2_vs_first"] = float(np.linalg.norm(w["logits"] - first) / np.linalg.norm(first))
                row["same_argmax"] = bool(np.argmax(w["logits"]) == np.argmax(first))
            out[name] = row
            part({"variant": name, "ms": row["s"] * 1e3, **{k: row[k] for k in ("rel_l2_vs_first", "same_argmax")
                                                             if k in row}})
    finally:
        set_variant("all")
    return out


def _fresh(cfg) -> MlxModelState:
    st = MlxModelState.empty(cfg)
    mx.eval([a for s in st.layers for a in (s.keys, s.values)])
    return st


def whole_prompts(p, form: Form, lengths: list[int], reps: int, seen: set) -> dict:
    """1.: first call (s, new kernel specialisations) and the median of later calls per length."""
    form.select()
    out = {}
    rng = np.random.default_rng(0)
    for n in lengths:
        tokens = rng.integers(0, p.cfg.vocab_size, n)
        logits = []

        def one():
            logits[:] = [np.array(prompt_forward(p, _fresh(p.cfg), tokens)[0][-1])]

        with recording() as specs:
            t = time.perf_counter()
            one()
            first = time.perf_counter() - t
        new = {(s.name, i, tpl) for s, i, _, tpl in specs} - seen
        seen.update(new)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            one()
            ts.append(time.perf_counter() - t)
        out[n] = {"first_s": first, "new_kernels": len(new), "s": statistics.median(ts), "runs_s": ts,
                  "tok_s": n / statistics.median(ts), "peak_gb": mx.get_peak_memory() / 1e9, "logits": logits[0]}
        mx.reset_peak_memory()
        part({"form": form.value, "tokens": n, **{k: v for k, v in out[n].items() if k != "logits"}})
    return out


def synced_pass(p, form: Form, n: int, layer_at: int) -> tuple[dict, tuple]:
    """2.: each layer evaluated alone (ms) and its routing's largest group / mean group; the
    expert step's inputs (records, h, experts, weights) of layer `layer_at`."""
    form.select()
    cfg = p.cfg
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, n)
    seen_routes: list = []
    real = prompt_mod.grouped_experts

    def spy(records, rec, h, experts, weights, **kw):
        seen_routes.append((records, h, experts, weights))
        return real(records, rec, h, experts, weights, **kw)

    prompt_mod.grouped_experts = spy
    try:
        state = _fresh(cfg)
        x = embed(p, tokens)
        mx.eval(x)
        ms = []
        for layer in range(cfg.n_layers):
            t = time.perf_counter()
            x, _ = _layer(p, layer, state.layers[layer], x, window=False)
            mx.eval(x)
            ms.append((time.perf_counter() - t) * 1e3)
    finally:
        prompt_mod.grouped_experts = real
    imbalance = []
    for _, _, experts, _ in seen_routes:
        c = np.bincount(np.array(experts).reshape(-1), minlength=cfg.n_experts)
        imbalance.append({"max": int(c.max()), "mean": float(c.mean()), "unused": int((c == 0).sum())})
    out = {"layer_ms": ms, "sum_ms": sum(ms), "routing": imbalance}
    part({"form": form.value, "tokens": n, "synced_layers_ms": [round(v, 2) for v in ms], "sum_ms": sum(ms),
          "largest_group": [r["max"] for r in imbalance], "mean_group": imbalance[0]["mean"] if imbalance else None})
    kept = seen_routes[min(layer_at, len(seen_routes) - 1)] if seen_routes else None
    return out, kept


def layer_steps(p, forms: list[Form], kept, reps: int) -> dict:
    """3.: one layer's steps, each evaluated alone (ms)."""
    cfg, lw, rec = p.cfg, p.layers[0], p.rec
    records, h, experts, weights = kept
    n, k = experts.shape
    x = h * 1.0  # a residual of the right scale for the attention steps
    mx.eval(x)
    steps: dict[str, float] = {}

    def time_ms(name, fn):
        steps[name] = median_time(lambda: mx.eval(fn()), warmup=1, reps=reps) * 1e3

    time_ms("eval of one small op (overhead floor)", lambda: x[:1, :8] + 1.0)
    kv = MlxModelState.empty(cfg).layers[0]
    hd, qr, kr = cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    xn = rms_norm(x, lw.attn.norm, cfg.rms_norm_eps)
    time_ms("attention: norm + QKV matmul (two terms)", lambda: lowp_matmul(rms_norm(x, lw.attn.norm, cfg.rms_norm_eps),
                                                                            lw.attn.wqkv, p.dtype))
    qkv = lowp_matmul(xn, lw.attn.wqkv, p.dtype)
    mx.eval(qkv)

    def qk():
        q = qkv[:, :qr].reshape(n, cfg.n_heads, hd).transpose(1, 0, 2)
        kk = qkv[:, qr:qr + kr].reshape(n, cfg.n_kv_heads, hd).transpose(1, 0, 2)
        q, kk = rms_norm(q, lw.attn.q_norm, cfg.rms_norm_eps), rms_norm(kk, lw.attn.k_norm, cfg.rms_norm_eps)
        return _rope(cfg, q, 0), _rope(cfg, kk, 0)
    time_ms("attention: q/k norms + RoPE (float32 ops)", lambda: qk())
    q, kk = qk()
    v = qkv[:, qr + kr:qr + 2 * kr].reshape(n, cfg.n_kv_heads, hd).transpose(1, 0, 2)
    mx.eval(q, kk, v)
    time_ms("attention: sdpa (float16, causal)", lambda: mx.fast.scaled_dot_product_attention(
        q[None].astype(p.dtype), kk[None].astype(p.dtype), v[None].astype(p.dtype), scale=float(hd ** -0.5),
        mask="causal"))
    o = mx.random.normal((n, qr))
    mx.eval(o)
    time_ms("attention: output projection (two terms)", lambda: lowp_matmul(o, lw.attn.wo, p.dtype))
    time_ms("attention: whole (prompt_attention)", lambda: prompt_attention(
        cfg, lw.attn, type(kv)(kv.keys, kv.values, 0), x, dtype=p.dtype)[0])
    time_ms("router: ffn norm + float32 matmul", lambda: rms_norm(x, lw.ffn_norm, cfg.rms_norm_eps) @ lw.router.T)
    z = h @ lw.router.T
    mx.eval(z)
    time_ms("routing: top-k + weights", lambda: route_prompt(z, lw.rule))
    act = expert_act(cfg)
    for form in forms:
        f = form.value
        form.select()
        time_ms(f"experts ({f}): whole", lambda form=form: grouped_experts(records, rec, h, experts, weights,
                                                                            dtype=p.dtype, act=act, gemm=form.gemm))
        if form.gemm is GroupedGemm.Q2_TILES:
            flat = experts.reshape(-1)
            time_ms(f"experts ({f}): argsort pairs", lambda: mx.argsort(flat))
            order = mx.argsort(flat).astype(mx.int32)
            mx.eval(order)
            time_ms(f"experts ({f}): tile table", lambda: tile_table(flat[order], records.shape[0], BM // 2))
            tiles = tile_table(flat[order], records.shape[0], BM // (2 if lowp.SPLIT else 1))
            xt, w = h, weights.reshape(-1)
            mx.eval(tiles, xt, w)
            gu_fn = lambda: q2_tiles(xt, order // k, order, w, tiles, n * k, records, rec, ("gate", "up"),  # noqa: E731
                                     gather=True, scatter=False)
            time_ms(f"experts ({f}): gate|up kernel", gu_fn)
            time_ms(f"experts ({f}): gate|up kernel with silu(g) u (grouped_tiles.FUSED_HIDDEN)", lambda: q2_tiles(
                xt, order // k, order, w, tiles, n * k, records, rec, ("gate", "up"), gather=True, scatter=False,
                hidden=True))
            gu = gu_fn()
            mx.eval(gu)
            ff = rec.expert_ffn
            time_ms(f"experts ({f}): gated hidden", lambda: gated_hidden(act, gu[:, :ff], gu[:, ff:]))
            hid = gated_hidden(act, gu[:, :ff], gu[:, ff:])
            mx.eval(hid)
            down_fn = lambda: q2_tiles(hid, order, order, w, tiles, n * k, records, rec, ("down",),  # noqa: E731
                                       gather=False, scatter=True)
            time_ms(f"experts ({f}): down kernel (weighted, scattered)", down_fn)
            y = down_fn()
            mx.eval(y)
            time_ms(f"experts ({f}): sum over ranks", lambda: y.reshape(n, k, -1).sum(axis=1))
            time_ms(f"experts ({f}): gate|up kernel, 64 columns a block", lambda: q2_tiles(
                xt, order // k, order, w, tiles, n * k, records, rec, ("gate", "up"), gather=True, scatter=False,
                bn=64))
            time_ms(f"experts ({f}): down kernel, 64 columns a block", lambda: q2_tiles(
                hid, order, order, w, tiles, n * k, records, rec, ("down",), gather=False, scatter=True, bn=64))
        if form.gemm is GroupedGemm.PADDED:
            time_ms(f"experts ({f}): dequantize E experts", lambda: dequantized_experts(records, rec, p.dtype))
            flat = experts.reshape(-1)
            counts = mx.zeros((records.shape[0],), mx.int32).at[flat].add(1)
            mx.eval(counts)
            time_ms(f"experts ({f}): cap host sync (counts.max().item())", lambda: mx.array(int(counts.max().item())))
            time_ms(f"experts ({f}): [N, D] float32 row gather", lambda: h[mx.argsort(flat) // k])
    base_z = z
    time_ms("experts (decode's fused kernel, same routing rule)", lambda: experts_route(
        p.arena.array, rec, h, base_z, 0, lw.rule, None, act)[0])
    for form in forms:
        form.select()
        st = MlxModelState.empty(cfg).layers[0]
        mx.eval(st.keys, st.values)
        time_ms(f"whole layer ({form.value})", lambda st=st: _layer(p, 0, type(st)(st.keys, st.values, 0), x,
                                                                    window=False)[0])
    part({"tokens": n, "layer_steps_ms": {s: round(v, 3) for s, v in steps.items()}})
    return steps


def crossing(p, forms: list[Form], lengths: list[int], reps: int) -> dict:
    """One layer's routed experts at a few token counts: each grouped form against the decode's
    fused kernel on the same pairs (where grouped.GROUPED_MIN_PAIRS belongs), ms."""
    cfg, lw, rec = p.cfg, p.layers[0], p.rec
    records = p.arena.array[:cfg.n_experts]
    out = {}
    for n in lengths:
        x = mx.random.normal((n, cfg.hidden_size), key=mx.random.key(n))
        h = rms_norm(x, lw.ffn_norm, cfg.rms_norm_eps)
        z = h @ lw.router.T
        experts, weights = route_prompt(z, lw.rule)
        mx.eval(h, z, experts, weights)
        row = {"fused": median_time(lambda: mx.eval(experts_route(p.arena.array, rec, h, z, 0, lw.rule, None,
                                                                  expert_act(cfg))[0]), warmup=1, reps=reps) * 1e3}
        for form in forms:
            form.select()
            row[form.value] = median_time(lambda form=form: mx.eval(grouped_experts(
                records, rec, h, experts, weights, dtype=p.dtype, act=expert_act(cfg), gemm=form.gemm)),
                warmup=1, reps=reps) * 1e3
        out[n] = row
        part({"crossing_tokens": n, "pairs_per_expert": n * cfg.n_experts_per_token / cfg.n_experts,
              "experts_ms": {k: round(v, 3) for k, v in row.items()}})
    return out


def ncu_layer(p, forms: list[Form], n: int) -> None:
    """--ncu: one layer (attention, router, experts) per form, each after a marker kernel; every
    form warmed up first (JIT), so segment i (between markers i and i + 1) is form i's layer."""
    cfg = p.cfg
    x = mx.random.normal((n, cfg.hidden_size))
    st = MlxModelState.empty(cfg).layers[0]
    mx.eval(x, st.keys, st.values)

    def layer():
        mx.eval(_layer(p, 0, type(st)(st.keys, st.values, 0), x, window=False)[0])

    for form in forms:  # warm (JIT)
        form.select()
        layer()
    mark = ncu_marker()
    for i, form in enumerate(forms):
        mark()
        form.select()
        layer()
        print(f"ncu segment {i + 1}: one layer at {n} tokens, experts {form.value}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--forms", default="q2tiles,padded")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layer-at", type=int, default=24, help="the layer whose routing the one-layer steps use")
    ap.add_argument("--crossing", default="32,128,256", help="token counts of the grouped / fused crossing")
    ap.add_argument("--budget-s", type=float, default=140.0)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--path", choices=["gpu", "emulated"], default="gpu")
    ap.add_argument("--tile-forms", default="",
                    help="q2tiles once per tile-kernel body: rows,cols,breg,breg2,bregdeep (best: q2_tiles.BEST's by step)")
    ap.add_argument("--ncu", action="store_true", help="one layer per form, each after a marker kernel")
    ap.add_argument("--variants", default="", help="flag variants of the whole prompt: all, none, -" + ", -".join(FLAGS)
                    + ", +" + ", +".join(OPT_IN))
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    for name in names:
        set_variant(name)  # a bad name fails here, before the model is built
    set_variant("all")
    cfg = replace(SMALL if args.small else SEED_SHAPE, shared_ffn_size=0, shared_expert_gated=False)
    lengths = [int(v) for v in args.lengths.split(",")]
    tile_forms = ([None if v == "best" else TileForm(v) for v in args.tile_forms.split(",")] if args.tile_forms
                  else [None])
    forms = [Form(g, t) for g in (GroupedGemm(v) for v in args.forms.split(","))
             for t in (tile_forms if g is GroupedGemm.Q2_TILES else [None])]
    cfg = replace(cfg, max_context=max(cfg.max_context, max(lengths) + 8), n_layers=1 if args.ncu else cfg.n_layers)
    grouped.GROUPED_MIN_PAIRS = 0  # every layer grouped: the probe times the grouped forms (the fused kernel apart)
    path = KernelPath.GPU if args.path == "gpu" else KernelPath.EMULATED
    with using_path(path):
        t = time.perf_counter()
        p = random_params(cfg, seed=0, pred_q8=False)
        res = {"device": str(mx.default_device()), "mlx": mx.__version__, "build_s": time.perf_counter() - t,
               "layers": cfg.n_layers, "split": lowp.SPLIT, "forms": {}}
        part({"build_s": res["build_s"]})
        if args.ncu:
            if names:
                set_variant(names[0])  # --ncu: the flags of the first variant
            ncu_layer(p, forms, max(lengths))
            return
        seen: set = set()
        left = lambda: args.budget_s - (time.time() - T0)  # noqa: E731
        kept = None
        first_logits = None
        for i, form in enumerate(forms):
            r = res["forms"][form.value] = {}
            if left() < (10 if i == 0 or form.gemm is GroupedGemm.Q2_TILES else 40):  # a q2tiles form: ~5 s
                r["skipped"] = f"{left():.0f} s left"
                part({"form": form.value, "skipped": r["skipped"]})
                continue
            try:
                whole = whole_prompts(p, form, lengths, args.repeat, seen)
                r["whole"] = {n: {k: v for k, v in w.items() if k != "logits"} for n, w in whole.items()}
                if first_logits is None:
                    first_logits = {n: w["logits"] for n, w in whole.items()}
                    if names:  # the flag variants of the first form, while its kernels are warm
                        res["variants"] = variants(p, form, names, max(lengths), args.repeat, seen, left)
                else:
                    for n, w in whole.items():
                        ref = first_logits[n]
                        r["whole"][n]["rel_l2_vs_first_form"] = float(np.linalg.norm(w["logits"] - ref)
                                                                      / np.linalg.norm(ref))
                        r["whole"][n]["same_argmax"] = bool(np.argmax(w["logits"]) == np.argmax(ref))
                    part({"form": form.value, "agreement": {n: {k: r["whole"][n][k] for k in (
                        "rel_l2_vs_first_form", "same_argmax")} for n in whole}})
                if left() > 20:
                    r["synced"], kept_here = synced_pass(p, form, max(lengths), args.layer_at)
                    kept = kept or kept_here
            except Exception as exc:  # reported, not fatal: the next form still runs
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
                part({"form": form.value, "error": r["error"]})
        if kept is not None and left() > 15:
            try:
                res["layer_steps_ms"] = layer_steps(p, [f for f in forms if "error" not in res["forms"][f.value]
                                                        and "skipped" not in res["forms"][f.value]], kept, args.repeat)
            except Exception as exc:
                res["layer_steps_error"] = f"{type(exc).__name__}: {exc}"[:300]
                part({"layer_steps_error": res["layer_steps_error"]})
        if left() > 12:
            ok = [f for f in forms if "error" not in res["forms"][f.value] and "skipped" not in res["forms"][f.value]]
            try:
                res["crossing_ms"] = crossing(p, ok, [int(v) for v in args.crossing.split(",")], args.repeat)
            except Exception as exc:
                res["crossing_error"] = f"{type(exc).__name__}: {exc}"[:300]
                part({"crossing_error": res["crossing_error"]})
    tiles_forms = [f for f in forms if f.gemm is GroupedGemm.Q2_TILES and "whole" in res["forms"][f.value]]
    if tiles_forms and left() > 12:
        with using_path(path):  # the activations rounded to float16 once (lowp.SPLIT off): half the expert flops
            lowp.SPLIT = False
            try:
                once = whole_prompts(p, tiles_forms[-1], [max(lengths)], args.repeat, seen)
                res["q2tiles_rounded_once"] = {n: {k: v for k, v in w.items() if k != "logits"}
                                               for n, w in once.items()}
            finally:
                lowp.SPLIT = True
    print(f"\n## prompt probe: {res['device']}, MLX {res['mlx']}, {cfg.n_layers} layers, two-term activations "
          f"{res['split']}, median of {args.repeat}")
    print("| form | tokens | first call (JIT) s | new kernels | later calls ms | tok/s | rel L2 vs first form |")
    print("|---|---|---|---|---|---|---|")
    for f, r in res["forms"].items():
        for n, w in r.get("whole", {}).items():
            print(f"| {f} | {n} | {w['first_s']:.2f} | {w['new_kernels']} | {w['s'] * 1e3:.1f} | {w['tok_s']:.0f} | "
                  f"{w.get('rel_l2_vs_first_form', '-')} |")
        if "synced" in r:
            s = r["synced"]
            print(f"| {f} | synced layers | sum {s['sum_ms']:.1f} ms | | min {min(s['layer_ms']):.2f} / max "
                  f"{max(s['layer_ms']):.2f} ms a layer | | largest group {max(g['max'] for g in s['routing'])} "
                  f"(mean {s['routing'][0]['mean']:.1f}) |")
        for key in ("error", "skipped"):
            if key in r:
                print(f"| {f} | {key}: {r[key]} |")
    if "variants" in res:
        flags = ", ".join(f"{k}: {m.__name__.rsplit('.', 1)[-1]}.{c}" for k, (m, c) in FLAGS.items())
        print(f"\n| variant ({flags}) | {max(lengths)} tokens ms | tok/s | rel L2 vs first | same argmax |\n"
              "|---|---|---|---|---|")
        for name, row in res["variants"].items():
            if "s" in row:
                print(f"| {name} | {row['s'] * 1e3:.1f} | {row['tok_s']:.0f} | {row.get('rel_l2_vs_first', '-')} | "
                      f"{row.get('same_argmax', '-')} |")
            else:
                print(f"| {name} | {row.get('skipped') or row.get('error')} |")
    if "layer_steps_ms" in res:
        print("\n| one layer's step (evaluated alone) | ms |\n|---|---|")
        for s, v in res["layer_steps_ms"].items():
            print(f"| {s} | {v:.3f} |")
    if "crossing_ms" in res:
        print("\n| tokens | experts of one layer, ms: " + " | ".join(next(iter(res["crossing_ms"].values()))) + " |")
        for n, row in res["crossing_ms"].items():
            print(f"| {n} | " + " | ".join(f"{v:.3f}" for v in row.values()) + " |")
    for n, w in res.get("q2tiles_rounded_once", {}).items():
        print(f"| q2tiles rounded once | {n} | {w['first_s']:.2f} | {w['new_kernels']} | {w['s'] * 1e3:.1f} | "
              f"{w['tok_s']:.0f} |")
    print("JSON " + json.dumps(dict(bench="prompt_probe", **res), default=str))


if __name__ == "__main__":
    main()
