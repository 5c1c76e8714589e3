"""The MLA decode kernels (GPU): the absorbed decode step's time against its bytes at DeepSeek-V3's
attention shape (128 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128, q_lora_rank 1536, hidden 7168), at several context lengths; the whole decoded
mixer (the a- and q-projections, the three kernels, the output projection) at one length; the
MLX-ops absorbed form for comparison. Prints a table, then one JSON line.

What a step moves (kernels/mla.py `absorbed_bytes`): W_uk and W_uv (float16, 2 x 16.8 MB), the
latent cache (float32, 2304 bytes a position: 9.4 MB at 4096 positions, 75.5 MB at 32768), the
flash-decoding partials (written and read). What it computes (`absorbed_flops`): 2 H c (n + v)
for the absorption and 2 H S (2c + r) for the scores and the latent sums: 139 k flops a cached
position, ~60 flops a cache byte, so at long contexts the step is bound by the SMs' float32 FMAs
(no tensor cores here), not by HBM; the table gives both rates.

Timing: LAYERS steps per evaluation, each with its own weights and cache (past the 60 MB L2), so
the wall time per step includes the gaps between launches; ncu gives the GPU time alone
(`--ncu`, device_run.sh's ncu_mla stage).

    python benchmarks/mla.py            # full size (GPU)
    python benchmarks/mla.py --small    # smoke test: small heads, the emulated path on a CPU
    python benchmarks/mla.py --ncu      # one step at 512, 2048, 8192 positions and one mixer, for ncu
    python benchmarks/mla.py --variants # the attend kernel's step shapes (PB, HPW) at every length

`--ncu` prints, per launch, the bytes it moves (an `NCU` line: the step's position count and its
query, attend and output kernels' bytes), so ncu's gpu__time_duration of each kernel over its
bytes is its share of copy. `--variants` times the step with each (PB, HPW) at every length, the
data a default is chosen by (VARIANTS).
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

from _measure import copy_bandwidth, device_name, kernel_bench_path, median_time, part, print_rows  # noqa: E402
from strata.mlx_backend import mla as mmla  # noqa: E402
from strata.mlx_backend.kernels import mla as mla_kernel  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, using_path  # noqa: E402
from strata.model_config import ModelConfig  # noqa: E402
from strata.reference.mla import MLA_NORM_EPS, softmax_scale  # noqa: E402
from strata.testing.mlx_params import DEEPSEEK_V3_SHAPE, random_mla  # noqa: E402

CONTEXTS = (512, 2048, 8192, 32768)  # positions attended by the timed step
LAYERS = 8  # steps per timed evaluation, each over its own weights and cache
MIXER_LAYERS = 4  # decoded mixers per evaluation (374 MB of weights each)
SMALL = DEEPSEEK_V3_SHAPE.with_fields(hidden_size=256, n_heads=4, n_kv_heads=4, q_lora_rank=64, kv_lora_rank=64,
                qk_rope_head_dim=16, qk_nope_head_dim=32, head_dim=48, v_head_dim=32, max_context=512)
SMALL_CONTEXTS = (16, 300)
NCU_CONTEXTS = (512, 2048, 8192)  # the steps --ncu launches, in order (each one query, attend, output)
# (PB, HPW, VW) step shapes --variants times at every length, the default first (on the H200 at
# 8192 positions PB 2 HPW 2 took 282 us against the default's 309: docs/perf.md); the lengths in
# the order they are run (the first pays every variant's compile; a run cut short keeps 8192's)
VARIANTS = ((mla_kernel.POSITIONS_PER_STEP, mla_kernel.HEADS_PER_WARP, mla_kernel.VECTOR_WIDTH), (2, 2, 1), (4, 1, 4),
            (2, 2, 4), (4, 2, 4))
VARIANT_CONTEXTS = (8192, 2048, 512, 32768)


def kernel_bytes(h: int, c: int, r: int, n: int, v: int, positions: int, splits: int) -> dict:
    """HBM bytes of each of the step's three kernels (`absorbed_bytes` split by kernel): the query
    kernel reads W_uk, the raw query and the new row's inputs and writes qcat and the cache row; the
    attend kernel reads qcat and the cached rows (once from HBM; the block's warps share them
    through L1/L2) and writes the partials; the output kernel reads them and W_uv, writes out."""
    nb = mla_kernel.absorbed_bytes(h, c, r, n, v, positions, splits)
    qcat = 4 * h * (c + r)
    query = 2 * h * n * c + 4 * h * (n + r) + 4 * 2 * (c + r) + qcat
    attend = qcat + nb["cache"] + nb["partials"] // 2
    output = nb["partials"] // 2 + 2 * h * v * c + 4 * h * v
    return {"query": query, "attend": attend, "output": output, "total": query + attend + output}


def _shape(cfg: ModelConfig) -> tuple[int, int, int, int, int]:
    return cfg.n_heads, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim


def _inputs(cfg: ModelConfig, n: int, s_max: int, seed: int):
    """n layers' weights, caches (s_max rows of normal latents and rope keys) and raw q / kva rows."""
    h, c, r, nope, _ = _shape(cfg)
    keys = mx.random.split(mx.random.key(seed), 4 * n)
    ws = [random_mla(cfg, keys[4 * i]) for i in range(n)]
    caches = [mx.random.normal((s_max, c + r), key=keys[4 * i + 1]) for i in range(n)]
    qs = [mx.random.normal((1, h * (nope + r)), key=keys[4 * i + 2]) for i in range(n)]
    kvas = [mx.random.normal((1, c + r), key=keys[4 * i + 3]) for i in range(n)]
    mx.eval(*[a for w in ws for a in w.arrays()], *caches, *qs, *kvas)
    return ws, caches, qs, kvas


def _step(cfg: ModelConfig, w: mmla.MlaWeights, cache: mx.array, q: mx.array, kva: mx.array, pos: int,
          **kw) -> mx.array:
    cos, sin = mmla.rope_table(cfg)
    return mla_kernel.mla_decode(q, kva, w.w_uk, w.w_uv, w.kv_a_norm, cos, sin, cache, pos, eps=MLA_NORM_EPS,
                                 scale=softmax_scale(cfg), **kw)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="small heads; on a CPU the emulated path (a smoke test)")
    ap.add_argument("--ncu", action="store_true", help="one step at each of NCU_CONTEXTS and one mixer, for ncu")
    ap.add_argument("--variants", action="store_true", help="only the (PB, HPW, VW) step shapes at every length")
    args = ap.parse_args()
    path = kernel_bench_path(args.small)
    if path is None:
        return 1
    contexts = (SMALL_CONTEXTS if args.small else NCU_CONTEXTS if args.ncu else VARIANT_CONTEXTS if args.variants
                else CONTEXTS)
    cfg = replace(SMALL if args.small else DEEPSEEK_V3_SHAPE, max_context=max(contexts))
    h, c, r, nope, v = _shape(cfg)
    n_layers, n_mixer = (2, 1) if args.small else (LAYERS, MIXER_LAYERS)
    res: dict = {"device": device_name(), "path": path.value, "heads": h, "kv_lora_rank": c, "rope": r, "nope": nope,
                 "v": v, "q_lora_rank": cfg.mla.q_lora_rank, "hidden": cfg.hidden_size, "cache_dtype": "float32",
                 "cache_bytes_per_position": 4 * (c + r), "by_context": {}}
    rows: list = []
    with using_path(path):
        ws, caches, qs, kvas = _inputs(cfg, n_layers, cfg.max_context, seed=0)
        if args.ncu:  # a step at each length, then one decoded mixer, each evaluated alone
            for i, s in enumerate(contexts):
                ns = mla_kernel.MAX_SPLITS
                kb = kernel_bytes(h, c, r, nope, v, s, ns)
                print(f"NCU launch {3 * i}..{3 * i + 2}: step over {s} positions ({ns} splits): bytes query "
                      f"{kb['query']} attend {kb['attend']} output {kb['output']} total {kb['total']}", flush=True)
                mx.eval(_step(cfg, ws[i % n_layers], caches[i % n_layers], qs[0], kvas[0], s - 1))
            s = contexts[1]
            kv = mmla.MlxLatentKV(caches[0], s - 1)
            print(f"NCU then one decoded mixer at {s} positions (its GEMVs: strata_dense_gemv; weights "
                  f"{sum(a.nbytes for a in ws[0].arrays())} bytes)", flush=True)
            mx.eval(mmla.mla_partials(cfg, ws[0], kv, mx.random.normal((1, cfg.hidden_size)))[0])
            return 0
        bw = copy_bandwidth((64 << 20) if args.small else (2 << 30))
        res["copy_GBps"] = bw["copy_Bps"] / 1e9
        rows.append(("copy bandwidth (read+write)", f"{res['copy_GBps']:.0f} GB/s", ""))
        reps = dict(warmup=1, reps=3) if args.small else {}
        if args.variants:  # this table only
            with part("variants", res, rows):
                step_variants(cfg, contexts, ws, caches, qs, kvas, reps, bw, res, rows)
            return report(path, res, rows)

        for s in contexts:
            with part(f"kernels_{s}", res, rows):
                ns = mla_kernel.MAX_SPLITS
                nb = mla_kernel.absorbed_bytes(h, c, r, nope, v, s, ns)
                fl = mla_kernel.absorbed_flops(h, c, r, nope, v, s)
                t = median_time(lambda: mx.eval([_step(cfg, ws[i], caches[i], qs[i], kvas[i], s - 1)
                                                 for i in range(n_layers)]), **reps) / n_layers
                res["by_context"][str(s)] = {
                    "us": t * 1e6, "splits": ns, "bytes": nb["total"], "cache_bytes": nb["cache"],
                    "weight_bytes": nb["weights"], "partial_bytes": nb["partials"], "GBps": nb["total"] / t / 1e9,
                    "fraction_of_copy": nb["total"] / t / bw["copy_Bps"], "GFLOPs": fl / t / 1e9,
                    "floor_us": nb["total"] / bw["copy_Bps"] * 1e6}
                rows.append((f"MLA kernels, {s} positions ({ns} splits), {n_layers} per eval", f"{t * 1e6:.1f} us/step",
                             f"{nb['total'] / 1e6:.1f} MB (cache {nb['cache'] / 1e6:.1f}): {nb['total'] / t / 1e9:.0f} GB/s "
                             f"= {nb['total'] / t / bw['copy_Bps'] * 100:.0f}% of copy; {fl / t / 1e12:.2f} TFLOP/s"))

        with part("ops", res, rows):  # the MLX-ops absorbed form at the second length (its T = 1 step, no kernel)
            s = contexts[1]
            kv_ops = [mmla.MlxLatentKV(caches[i], s - 1) for i in range(n_layers)]
            x = [mx.random.normal((1, cfg.hidden_size)) for _ in range(n_layers)]
            mx.eval(*x)
            with using_path(KernelPath.OPS):
                ws32 = ws if args.small else ws[:2]  # its float32 casts of W_o, W_kvb: 2 layers are plenty
                t = median_time(lambda: mx.eval([mmla.mla(cfg, ws32[i], kv_ops[i], x[i], absorbed=True)[0]
                                                 for i in range(len(ws32))]), **reps) / len(ws32)
            res["ops_mixer_us"] = t * 1e6
            rows.append((f"MLX ops: the absorbed mixer at {s} positions", f"{t * 1e6:.1f} us/layer", "float32 ops, no kernel"))

        with part("mixer", res, rows):  # the decoded mixer at the second length: 6 launches + the W_o block sum
            s = contexts[1]
            wm = ws[:n_mixer]
            wbytes = sum(a.nbytes for a in wm[0].arrays())
            nb = mla_kernel.absorbed_bytes(h, c, r, nope, v, s, mla_kernel.MAX_SPLITS)
            x = [mx.random.normal((1, cfg.hidden_size)) for _ in range(n_mixer)]
            mx.eval(*x)
            before = sum(LAUNCHES.values())
            mx.eval(mmla.mla_partials(cfg, wm[0], mmla.MlxLatentKV(caches[0], s - 1), x[0])[0])
            res["mixer_launches"] = sum(LAUNCHES.values()) - before
            t = median_time(lambda: mx.eval([mmla.mla_partials(cfg, wm[i], mmla.MlxLatentKV(caches[i], s - 1), x[i])[0]
                                             for i in range(n_mixer)]), **reps) / n_mixer
            mb = wbytes + nb["cache"] + nb["partials"]
            res.update({"mixer_us": t * 1e6, "mixer_bytes": mb, "mixer_GBps": mb / t / 1e9,
                        "mixer_fraction_of_copy": mb / t / bw["copy_Bps"], "mixer_context": s})
            rows.append((f"decoded MLA mixer ({res['mixer_launches']} launches) at {s} positions", f"{t * 1e6:.1f} us/layer",
                         f"{mb / 1e6:.1f} MB: {mb / t / 1e9:.0f} GB/s = {mb / t / bw['copy_Bps'] * 100:.0f}% of copy"))

        with part("sweep", res, rows):  # the attend kernel's step shapes, at the third length (last: the most builds)
            s = contexts[2 if len(contexts) > 2 else -1]
            ns0 = mla_kernel.MAX_SPLITS
            res["sweep_context"], res["sweep"] = s, {}
            variants = [(1, 1, ns0), (2, 1, ns0), (8, 1, ns0), (2, 2, ns0), (4, 2, ns0), (2, 4, ns0)]
            variants += [(mla_kernel.POSITIONS_PER_STEP, 1, ns) for ns in (4, 8, 32) if ns != ns0]
            for pb, hpw, ns in variants:
                t = median_time(lambda: mx.eval([_step(cfg, ws[i], caches[i], qs[i], kvas[i], s - 1, splits=ns,
                                                       positions_per_step=pb, heads_per_warp=hpw)
                                                 for i in range(n_layers)]), **reps) / n_layers
                res["sweep"][f"pb{pb}_hpw{hpw}_ns{ns}"] = t * 1e6
                print(f"SWEEP pb{pb}_hpw{hpw}_ns{ns} {t * 1e6:.1f} us/step", flush=True)  # a run cut short keeps these
                rows.append((f"  {s} positions, PB {pb}, HPW {hpw}, NS {ns}", f"{t * 1e6:.1f} us/step", ""))

    return report(path, res, rows)


def report(path: KernelPath, res: dict, rows: list) -> int:
    print(f"\n## MLA decode kernels on {res['device']} (path {res['path']}, MLX {mx.__version__}; H {res['heads']}, "
          f"c {res['kv_lora_rank']}, r {res['rope']}, n {res['nope']}, v {res['v']})")
    if path is KernelPath.EMULATED:
        print("(emulated: the CPU emulator's times, not a GPU's; this run checks the benchmark runs)")
    print_rows(rows)
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


def step_variants(cfg: ModelConfig, contexts, ws, caches, qs, kvas, reps: dict, bw: dict, res: dict, rows: list) -> None:
    """The step with each VARIANTS (PB, HPW, VW) at every length (the splits by the length, as
    the engine chooses them): us a step, and each variant against the default at that length."""
    h, c, r, nope, v = _shape(cfg)
    n = len(ws)
    res["variants"] = {}
    for s in contexts:
        ns = mla_kernel.MAX_SPLITS
        nb = mla_kernel.absorbed_bytes(h, c, r, nope, v, s, ns)["total"]
        base = None
        for pb, hpw, vw in VARIANTS:
            t = median_time(lambda: mx.eval([_step(cfg, ws[i], caches[i], qs[i], kvas[i], s - 1, positions_per_step=pb,
                                                   heads_per_warp=hpw, vector_width=vw) for i in range(n)]), **reps) / n
            base = base or t
            res["variants"][f"{s}_pb{pb}_hpw{hpw}_vw{vw}"] = t * 1e6
            print(f"VARIANT {s} positions pb{pb}_hpw{hpw}_vw{vw} {t * 1e6:.1f} us/step", flush=True)  # a cut run keeps these
            rows.append((f"{s} positions ({ns} splits), PB {pb}, HPW {hpw}, VW {vw}", f"{t * 1e6:.1f} us/step",
                         f"x{t / base:.3f} of the default; {nb / t / bw['copy_Bps'] * 100:.0f}% of copy"))


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"[mla.py {time.time() - t0:.1f} s]")
    sys.exit(rc)
