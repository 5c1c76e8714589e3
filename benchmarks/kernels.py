"""Kernel benchmarks (GPU): copy bandwidth; host dispatch and round trip; the fused routed-expert
kernel vs mx.gather_qmm for k = 10 of 256 experts at the reference engine's expert size (~1.38 MB Q2_0);
the Q8_0 router-guess GEMV. Prints a table, then one JSON line.

Two numbers first (METHOD.md): a layer's k = 10 experts are 10 x 1.3824 MB = 13.8 MB of Q2_0,
~3.5 us at 4 TB/s, while one custom-kernel call costs ~8 us of host dispatch: a single decode
call measures dispatch, not the kernel. So the kernel is timed on the GPU side by giving one
launch many tokens (T tokens, each its own 10 experts from a pool of 12 layers x 256 experts,
4.2 GB, so nothing is served from the 60 MB L2), and separately per decode-shaped call.

Kernel inputs are staged in device memory before timing (`on_device`): on MLX's CUDA build an
array made from host memory is managed memory the GPU faults in at its first read, which is a
cost of the call, not of the kernel; the dispatch rows measure it separately ("fresh host input").

    python benchmarks/kernels.py            # full size (GPU)
    python benchmarks/kernels.py --small    # smoke test (any machine)
    python benchmarks/kernels.py --ncu      # a few launches for ncu to time (the expert kernel at 1 and
                                            # 64 tokens, gather_qmm, every kernel of a decoded token)
    python benchmarks/kernels.py --native   # the native kernel instead: MLX's types (affine 4/8-bit, MXFP4),
                                            # fused vs gather_qmm (benchmarks/_native_experts.py)
    python benchmarks/kernels.py --ncu native  # its launches for ncu
    python benchmarks/kernels.py --ggml [--expert-type Q4_K,Q6_K]  # llama.cpp's types kept as stored: the
                                            # fused expert kernel per type, the dense GEMV (benchmarks/_ggml_experts.py)
    python benchmarks/kernels.py --ncu ggml [--expert-type Q4_K]   # their launches for ncu (1 and 64 tokens)
    python benchmarks/kernels.py --decode   # a decoded token's kernels one by one (wall time, 48 a chain)
    python benchmarks/kernels.py --ncu decode  # a decoded token's launches for ncu, chained and not
    ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 benchmarks/kernels.py --ncu chains \
        | python3 benchmarks/ncu_summary.py     # a decoded token chained and unchained, by kernel
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

from _measure import copy_bandwidth, device_name, dispatch_costs, median_time, part, print_rows  # noqa: E402
from _native_experts import native_part, ncu_launches  # noqa: E402
from _ggml_experts import ggml_part, ncu_ggml_launches, parse_types  # noqa: E402
from _decode_kernels import decode_part, ncu_chain_forms, ncu_decode_launches, ncu_expert_launches  # noqa: E402
from strata.formats.expert_record import RecordLayout, unpack_record  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend.experts import silu, slot_planes  # noqa: E402
from strata.mlx_backend.kernels import combine as combine_kernel  # noqa: E402
from strata.mlx_backend.kernels import moe, q8_gemv  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, current_path  # noqa: E402
from strata.mlx_backend.model import MlxModelState, forward  # noqa: E402
from strata.testing.mlx_params import SEED_SHAPE, q8_router, random_params, random_records  # noqa: E402
from strata.model_config import RoutingOrder  # noqa: E402
from strata.reference.experts import routed_experts  # noqa: E402

GROUP = 32
# (FC hidden units, NT threads, DN code form, HX h in threadgroup memory, VL vector loads) of the fused
# expert kernel; the first is the decode default, the third the many-token one (moe.block_shape).
# Run 1 of 2026-11-29 (H200): NT = 128 and FC = 64 were 24% and 42% slower than (32, 256).
# Run B: the subnormal code form 604 us vs 681 (ncu 550 vs 625); NT = 512 629 us. Run C, HX: h in
# registers (76 registers, 3 blocks per SM) 578 us (ncu 529) vs threadgroup memory (58: 4 blocks) 604.
DN = moe.subnormal_codes()
# Run C's ncu: L2 throughput 70% (the top unit) against DRAM 39%; the down step's reads are the
# cause: a block reads FC/4 = 8 bytes of codes and 2 of scales per down row, each from its own
# 32-byte sector, so the down planes cost 4x (codes) and 16x (scales) their bytes in L2 sectors,
# 76% of a block's sectors. FC = 64 halves that (16 and 4 bytes per row); at NT = 512 the gate/up
# rows per warp and the down rows per thread stay those of (32, 256), and h is read from
# threadgroup memory (HX) or held in 64 registers.
# Run 1 of the third session (ncu): (64, 512, HX) 483 us, (64, 512) 584 (113 registers), (64, 256, HX) 493,
# (32, 256) 533. VL: the down step's codes in one 8- or 16-byte load per row, or FC/16 4-byte loads.
VARIANTS = ((32, moe.THREADS, DN, False, True), (32, moe.THREADS, DN, False, False),
            (64, 512, DN, True, True), (64, 512, DN, True, False))


def on_device(a) -> mx.array:
    """a as an array in device memory (an op's output), evaluated: what a kernel reads without a
    page fault on MLX CUDA (host-made arrays are managed memory the GPU faults in)."""
    out = mx.array(a) + 0 if isinstance(a, np.ndarray) else a + 0
    mx.eval(out)
    return out


def kernel_dispatch(n: int = 1000) -> dict:
    """Host seconds per custom-kernel call in a lazy chain of n (the combine kernel on 8 values):
    with every input in device memory, and with one fresh host array per call (what a per-call
    scalar from the host costs on MLX CUDA); the host time to build one call (no evaluation);
    and a round trip whose value comes from a custom kernel (managed memory) rather than an op."""
    y0, xs = on_device(np.zeros(8, np.float32)), on_device(np.zeros((1, 8, 8), np.float32))

    def chain(fresh: bool):
        def run():
            y = y0
            for _ in range(n):
                sh = np.zeros((1, 1, 8), np.float32) if fresh else None  # a shared-expert partial from the host
                y = combine_kernel.combine(y.reshape(1, 8), xs, sh, y.reshape(1, 8), None).reshape(8)
            mx.eval(y)
        return run

    out = {"kernel_s": median_time(chain(False), warmup=2, reps=5) / n,
           "kernel_host_input_s": median_time(chain(True), warmup=2, reps=5) / n}

    def build():
        y = y0
        for _ in range(n):
            y = combine_kernel.combine(y.reshape(1, 8), xs, None, y.reshape(1, 8), None).reshape(8)
        return y
    t0 = time.perf_counter()
    y = build()
    out["launch_build_s"] = (time.perf_counter() - t0) / n
    mx.eval(y)

    def trips():
        y = y0
        for _ in range(200):
            y = combine_kernel.combine(y.reshape(1, 8), xs, None, y.reshape(1, 8), None).reshape(8)
            np.array(y)
    out["round_trip_kernel_s"] = median_time(trips, warmup=1, reps=5) / 200
    return out


def natural_stack(records: mx.array, rec: RecordLayout):
    """mlx-lm's layout for gather_qmm: contiguous per-projection w, float16 scales and biases."""
    st = slot_planes(records, rec)
    out = []
    for w, s, b in (st.gate, st.up, st.down):
        out.append((mx.contiguous(w), s.astype(mx.float16), b.astype(mx.float16)))
    mx.eval(*[a for t in out for a in t])
    return out


def gather_qmm_experts(stack, x16: mx.array, idx: mx.array, weights: mx.array) -> mx.array:
    """mlx-lm's SwitchGLU on the stack: 3 gather_qmm + SwiGLU + the weighted sum. -> [T, D]"""
    (gw, gs, gb), (uw, us, ub), (dw, ds, db) = stack
    xe = x16[:, None, None, :]
    g = mx.gather_qmm(xe, gw, gs, gb, rhs_indices=idx, transpose=True, group_size=GROUP, bits=2)
    u = mx.gather_qmm(xe, uw, us, ub, rhs_indices=idx, transpose=True, group_size=GROUP, bits=2)
    y = mx.gather_qmm(silu(g) * u, dw, ds, db, rhs_indices=idx, transpose=True, group_size=GROUP, bits=2)
    return (y[:, :, 0, :].astype(mx.float32) * weights[..., None]).sum(axis=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="tiny sizes: a smoke test on any machine")
    ap.add_argument("--ncu", choices=("all", "moe", "decode", "native", "experts", "chains", "ggml"), nargs="?",
                    const="all",
                    default=None,
                    help="only a few launches for ncu to time: the expert kernel at 1 and 64 tokens and "
                         "gather_qmm (moe), every kernel of a decoded token (decode), or both (all); the "
                         "native kernel and gather_qmm per MLX type (native); a decoded token's expert step "
                         "in each form (experts: _decode_kernels.EXPERT_FORMS); a decoded token of 4 layers "
                         "chained and unchained (chains: _decode_kernels.CHAIN_PLANS); the ggml expert kernel at "
                         "1 and 64 tokens per --expert-type and the dense GEMV (ggml)")
    ap.add_argument("--native", action="store_true", help="copy bandwidth and the native kernel (MLX's types) only")
    ap.add_argument("--decode", action="store_true", help="a decoded token's kernels one by one only (_decode_kernels.py)")
    ap.add_argument("--ggml", action="store_true",
                    help="copy bandwidth, the fused expert kernel of llama.cpp's types and their dense GEMV only")
    ap.add_argument("--expert-type", default=None, metavar="TYPES",
                    help="with --ggml / --ncu ggml: a comma list of expert types (Q4_K,Q6_K,Q8_0,Q5_K,IQ4_NL,IQ4_XS,"
                         "MXFP4,Q5_1,Q5_0,Q3_K,Q2_K,IQ3_S,IQ2_XXS; default all)")
    args = ap.parse_args()
    gpu = current_path() is KernelPath.GPU
    if args.ncu == "ggml":
        if not gpu:
            print("--ncu needs the GPU path")
            return 1
        ncu_ggml_launches(parse_types(args.expert_type))
        return 0
    if args.ggml:
        return ggml_only(args.small, gpu, parse_types(args.expert_type))
    if args.decode:
        return decode_only(args.small)
    if args.ncu == "experts":
        if not gpu:
            print("--ncu needs the GPU path")
            return 1
        ncu_expert_launches()
        return 0
    if args.ncu == "chains":
        if not gpu:
            print("--ncu needs the GPU path")
            return 1
        ncu_chain_forms(args.small)
        return 0
    if args.ncu == "native":
        if not gpu:
            print("--ncu needs the GPU path")
            return 1
        ncu_launches()
        return 0
    if args.native:
        return native_only(args.small, gpu)
    small = args.small
    d, f = (256, 64) if small else (2560, 576)
    e, k, pools = (32, 4, 2) if small else (256, 10, 12)
    rec = RecordLayout(QuantType.Q2_0, d, f)
    rng = np.random.default_rng(0)
    records = random_records(rec, pools * e, mx.random.key(1))  # [pools*E, SLOT]
    expert_bytes = rec.record_bytes
    res: dict = {"device": device_name(), "path": current_path().value, "D": d, "F": f, "E": e, "k": k,
                 "expert_bytes": expert_bytes}

    def slots_for(t: int) -> np.ndarray:
        return np.stack([(i % pools) * e + rng.choice(e, k, replace=False) for i in range(t)]).astype(np.int32)

    if args.ncu:
        if not gpu:
            print("--ncu needs the GPU path")
            return 1
        if args.ncu in ("all", "moe"):  # 3 single-token launches, then one 64-token launch per block shape
            stack = natural_stack(records, rec)
            mx.eval(records.sum())  # every record read once before the profiled launches
            x = on_device(np.random.default_rng(1).standard_normal((1, d)).astype(np.float32))
            w = on_device(np.full((1, k), 0.1, np.float32))
            for i in range(3):
                s = slots_for(1)
                sd = on_device(s)
                mx.eval(moe.moe_slots(records, rec, x, sd, w))
                mx.eval(gather_qmm_experts(stack, x.astype(mx.float16), sd, w))
            x64 = on_device(np.random.default_rng(2).standard_normal((64, d)).astype(np.float32))
            w64 = on_device(np.full((64, k), 0.1, np.float32))
            for fc, nt, dn, hx, vl in VARIANTS:
                mx.eval(moe.moe_slots(records, rec, x64, on_device(slots_for(64)), w64, fc=fc, threads=nt, denormals=dn,
                                      hx_shared=hx, vector_loads=vl))
        if args.ncu == "moe":
            return 0
        # every kernel of a decoded token (2 layers of the shape), chained and not: the per-kernel GPU times
        ncu_decode_launches()
        return 0

    rows = []
    bw = copy_bandwidth((64 << 20) if small else (2 << 30))
    res["copy_GBps"] = bw["copy_Bps"] / 1e9
    res["read_GBps"] = bw["read_Bps"] / 1e9
    rows.append(("copy bandwidth (read+write)", f"{res['copy_GBps']:.0f} GB/s", f"{bw['bytes'] / 2**30:.2f} GiB"))
    rows.append(("read bandwidth (sum)", f"{res['read_GBps']:.0f} GB/s", ""))
    disp = dispatch_costs()
    res.update({"dispatch_op_us": disp["op_s"] * 1e6, "round_trip_us": disp["round_trip_s"] * 1e6})
    rows.append(("host dispatch per MLX op", f"{disp['op_s'] * 1e6:.1f} us", "chain of 1000 tiny ops"))
    if gpu:
        kd = kernel_dispatch()
        res.update({"dispatch_kernel_us": kd["kernel_s"] * 1e6, "dispatch_kernel_host_input_us": kd["kernel_host_input_s"] * 1e6,
                    "launch_build_us": kd["launch_build_s"] * 1e6, "round_trip_kernel_us": kd["round_trip_kernel_s"] * 1e6})
        rows.append(("host dispatch per custom kernel", f"{kd['kernel_s'] * 1e6:.1f} us", "chain of 1000, inputs on the device"))
        rows.append(("  ... with a fresh host array per call", f"{kd['kernel_host_input_s'] * 1e6:.1f} us",
                     "managed memory the GPU faults in"))
        rows.append(("  host time to build one call", f"{kd['launch_build_s'] * 1e6:.1f} us", "Python + MLX graph, no eval"))
    rows.append(("host round trip", f"{disp['round_trip_s'] * 1e6:.1f} us", "tiny op + value to host"))
    if gpu:
        rows.append(("host round trip, value from a custom kernel", f"{res['round_trip_kernel_us']:.1f} us",
                     "kernel output (managed) to host"))

    # ---------------------------------------------------------------- correctness at this size
    with part("correctness", res, rows):
        stack = natural_stack(records, rec)
        x1 = mx.random.normal((1, d))
        s1 = slots_for(1)
        w1 = rng.random((1, k)).astype(np.float32)
        # only the k records come to the host: touching the whole pool from the host would move it
        # into managed memory (MLX CUDA) and change what the timings below measure
        picked = np.array(mx.take(records, mx.array(s1[0]), axis=0))
        ref = routed_experts([unpack_record(r, rec) for r in picked], w1[0], np.array(x1)[0])
        got_q = np.array(gather_qmm_experts(stack, x1.astype(mx.float16), mx.array(s1), mx.array(w1)))[0]
        err = lambda a: float(np.linalg.norm(a - ref) / np.linalg.norm(ref))  # noqa: E731
        res["gather_qmm_rel_err"] = err(got_q)
        if gpu:
            got_k = np.array(moe.moe_slots(records, rec, x1, s1, w1).sum(axis=1))[0]
            res["fused_rel_err"] = err(got_k)
            rows.append(("fused kernel vs reference (rel L2)", f"{res['fused_rel_err']:.2e}", "seed-size expert, k=10"))
        rows.append(("gather_qmm (f16 x) vs reference (rel L2)", f"{res['gather_qmm_rel_err']:.2e}", ""))


    # ---------------------------------------------------------------- GPU-side: many tokens per launch
    with part("batched", res, rows):
        tok = 8 if small else 64
        reps = 10
        xs = [mx.random.normal((tok, d)) for _ in range(reps)]
        ss = [slots_for(tok) for _ in range(reps)]
        ws = [np.full((tok, k), 0.1, np.float32) for _ in range(reps)]
        ssd, wsd = [on_device(a) for a in ss], [on_device(a) for a in ws]
        moved = tok * k * expert_bytes  # bytes of Q2_0 each call must read
        mx.eval(*xs)
        variants = {}
        if gpu:
            for fc, nt, dn, hx, vl in VARIANTS:
                if f % fc:
                    continue
                def fused(fc=fc, nt=nt, dn=dn, hx=hx, vl=vl):
                    mx.eval([moe.moe_slots(records, rec, xs[i], ssd[i], wsd[i], fc=fc, threads=nt, denormals=dn,
                                           hx_shared=hx, vector_loads=vl) for i in range(reps)])
                variants[f"fused FC={fc} NT={nt} DN={int(dn)} HX={int(hx)} VL={int(vl)}"] = median_time(fused, warmup=2, reps=5) / reps
        idxs, wms = ssd, wsd
        x16 = [x.astype(mx.float16) for x in xs]
        mx.eval(*idxs, *wms, *x16)

        def gq():
            mx.eval([gather_qmm_experts(stack, x16[i], idxs[i], wms[i]) for i in range(reps)])
        variants["gather_qmm"] = median_time(gq, warmup=2, reps=5) / reps
        gq_bytes = tok * k * sum(a.nbytes // a.shape[0] for t in stack for a in t)
        for name, t in variants.items():
            nb = gq_bytes if name == "gather_qmm" else moved
            res[f"{name}_us"] = t * 1e6
            res[f"{name}_GBps"] = nb / t / 1e9
            rows.append((f"{name}: {tok} tokens x k={k} per launch", f"{t * 1e6:.0f} us",
                         f"{nb / t / 1e9:.0f} GB/s = {nb / t / bw['copy_Bps'] * 100:.0f}% of copy"))


    # ---------------------------------------------------------------- decode-shaped: one token per call
    with part("per_call", res, rows):
        n_layers = 48
        one_x = [mx.random.normal((1, d)) for _ in range(n_layers)]
        one_s = [on_device(slots_for(1)) for _ in range(n_layers)]
        one_w = on_device(np.full((1, k), 0.1, np.float32))
        mx.eval(*one_x)
        per_call = {}
        if gpu:
            per_call["fused"] = median_time(lambda: mx.eval([moe.moe_slots(records, rec, one_x[i], one_s[i], one_w)
                                                             for i in range(n_layers)])) / n_layers
        one_i, one_wm = one_s, one_w
        per_call["gather_qmm"] = median_time(lambda: mx.eval([gather_qmm_experts(stack, one_x[i].astype(mx.float16), one_i[i], one_wm)
                                                              for i in range(n_layers)])) / n_layers
        for name, t in per_call.items():
            res[f"{name}_per_layer_us"] = t * 1e6
            rows.append((f"{name}: 1 token, 48 calls per eval", f"{t * 1e6:.1f} us/layer", "host dispatch included"))
        if gpu:  # what the all-resident decode launches: routing on the device from the logits
            zs = [on_device(np.random.default_rng(i).standard_normal((1, e)).astype(np.float32)) for i in range(n_layers)]
            t = median_time(lambda: mx.eval([moe.moe_route(records, rec, one_x[i], zs[i], (i % pools) * e, k,
                                                           RoutingOrder.SOFTMAX_TOPK, True) for i in range(n_layers)])) / n_layers
            res["fused_route_per_layer_us"] = t * 1e6
            rows.append(("fused, routing on the GPU: 1 token, 48 calls", f"{t * 1e6:.1f} us/layer", "host dispatch included"))


    # ---------------------------------------------------------------- Q8_0 guess GEMV (E x D)
    with part("q8", res, rows):
        if gpu:
            g = q8_router(e, d, mx.random.key(3))
            hx = [mx.random.normal((1, d)) for _ in range(n_layers)]
            mx.eval(g.codes, g.raw_scales, *hx)  # (device-made: no host arrays)
            t = median_time(lambda: mx.eval([q8_gemv.q8_gemv(g.codes, g.raw_scales, hx[i]) for i in range(n_layers)])) / n_layers
            res["q8_gemv_per_call_us"] = t * 1e6
            rows.append((f"Q8_0 GEMV {e}x{d} (router guess)", f"{t * 1e6:.1f} us/call", f"{g.codes.nbytes / 1e6:.2f} MB"))


    _table(res, rows)
    fused_best = max((res[k2] for k2 in res if k2.startswith("fused FC") and k2.endswith("_GBps")), default=None)
    if fused_best is not None:
        res["fused_best_fraction_of_copy"] = fused_best * 1e9 / bw["copy_Bps"]
        print(f"target: fused >= 50% of copy bandwidth: {res['fused_best_fraction_of_copy'] * 100:.0f}%")
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


def _table(res: dict, rows: list) -> None:
    print(f"\n## kernels on {res['device']} (path {res['path']}, MLX {mx.__version__})")
    print_rows(rows)


def decode_only(small: bool) -> int:
    """A decoded token's kernels one by one: a table and one JSON line."""
    res: dict = {"device": device_name(), "path": current_path().value}
    rows: list = []
    if current_path() is not KernelPath.GPU and not small:
        print("--decode needs the GPU path (--small runs a tiny shape anywhere a kernel path is)")
        return 1
    decode_part(res, rows, small=small)
    _table(res, rows)
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


def ggml_only(small: bool, gpu: bool, types) -> int:
    """Copy bandwidth, then the ggml part: a table and one JSON line."""
    res: dict = {"device": device_name(), "path": current_path().value}
    bw = copy_bandwidth((64 << 20) if small else (2 << 30))
    res["copy_GBps"] = bw["copy_Bps"] / 1e9
    rows = [("copy bandwidth (read+write)", f"{res['copy_GBps']:.0f} GB/s", f"{bw['bytes'] / 2**30:.2f} GiB")]
    ggml_part(res, rows, bw["copy_Bps"], small=small, gpu=gpu, types=types)
    _table(res, rows)
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


def native_only(small: bool, gpu: bool) -> int:
    """Copy bandwidth, then the native part: a table and one JSON line."""
    res: dict = {"device": device_name(), "path": current_path().value}
    bw = copy_bandwidth((64 << 20) if small else (2 << 30))
    res["copy_GBps"] = bw["copy_Bps"] / 1e9
    rows = [("copy bandwidth (read+write)", f"{res['copy_GBps']:.0f} GB/s", f"{bw['bytes'] / 2**30:.2f} GiB")]
    native_part(res, rows, bw["copy_Bps"], small=small, gpu=gpu)
    _table(res, rows)
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"[kernels.py {time.time() - t0:.1f} s]")
    sys.exit(rc)
