"""The fused expert kernel for MLX's own types (kernels/moe_native.py) against gather_qmm on the
same experts: `benchmarks/kernels.py --native` (device_run.sh's `native` stage) and its
`--ncu native` launches (the `ncu_moe` stage).

Method (Q2_0's, kernels.py): many tokens per launch (64, each with its own k experts) so the
GPU time, not the ~8 us of host dispatch, is measured; every launch reads tokens x k distinct
records (a fresh permutation of a pool of exactly that many, GBs: nothing served from the 60 MB
L2); bytes = tokens x k x record bytes. Two expert shapes: gpt-oss's (D = F = 2880, k = 4; its
experts are MXFP4) and the reference engine's (2560 x 576, k = 10: Q2_0's own benchmark shape).
gather_qmm runs mlx-lm's SwitchGLU on the records' planes with activations in the scales' type
(bfloat16 for MXFP4: MLX's CUDA gather_qmm has no MXFP4 kernel for float32 activations).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from _measure import median_time, part
from strata.formats.expert_record import RecordLayout, unpack_record
from strata.formats.mlx_affine import AFFINE_SPECS
from strata.formats.quant_types import QuantType
from strata.mlx_backend.experts import native_slot_planes, silu
from strata.mlx_backend.kernels import moe_native
from strata.mlx_backend.kernels.launch import KernelPath, using_path
from strata.reference.experts import routed_experts
from strata.testing.native_records import random_native_records

TYPES = (QuantType.MXFP4, QuantType.A4G64_BF16, QuantType.A8G64_BF16)  # the two first (a run may be cut short)
SHAPES = {"gpt-oss": (2880, 2880, 4), "seed": (2560, 576, 10)}  # D, F, k
SMALL_SHAPES = {"small": (256, 64, 4)}
TOKENS, SMALL_TOKENS = 64, 8
REPS = 10  # launches per timed evaluation
GATHER_REPS = 3
PER_CALL = 48  # decode-shaped calls per evaluation (a 48-layer token's worth)


def _x_dtype(qtype: QuantType):
    return mx.float16 if qtype in AFFINE_SPECS and not AFFINE_SPECS[qtype].bfloat16 else mx.bfloat16


def natural_stack(records: mx.array, rec: RecordLayout):
    """mlx-lm's layout for gather_qmm: contiguous per-projection (w, scales, biases) of the records."""
    st = native_slot_planes(records, rec)
    out = [tuple(None if a is None else mx.contiguous(a) for a in p) for p in (st.gate, st.up, st.down)]
    mx.eval(*[a for p in out for a in p if a is not None])
    return out, st


def gather_qmm_experts(stack, st, x: mx.array, idx: mx.array, weights: mx.array) -> mx.array:
    """mlx-lm's SwitchGLU: 3 gather_qmm + SwiGLU + the weighted sum. x [T, D] -> [T, D] float32"""
    xe = x[:, None, None, :]
    qmm = lambda a, p: mx.gather_qmm(a, *p, rhs_indices=idx, transpose=True, group_size=st.group,  # noqa: E731
                                     bits=st.bits, mode=st.mode)
    g, u = qmm(xe, stack[0]), qmm(xe, stack[1])
    y = qmm(silu(g) * u, stack[2])
    return (y[:, :, 0, :].astype(mx.float32) * weights[..., None]).sum(axis=1)


def _setup(qtype: QuantType, d: int, f: int, k: int, tokens: int, seed: int):
    rec = RecordLayout(qtype, d, f)
    records = random_native_records(rec, tokens * k, mx.random.key(seed))
    return rec, records


def native_part(res: dict, rows: list, copy_Bps: float, *, small: bool, gpu: bool) -> None:
    """Per type and shape: correctness on one token, then GPU time of `tokens` x k per launch."""
    tokens = SMALL_TOKENS if small else TOKENS
    for shape, (d, f, k) in (SMALL_SHAPES if small else SHAPES).items():
        for qtype in TYPES:
            name = f"native {qtype.name} {shape}"
            with part(name, res, rows):
                rec, records = _setup(qtype, d, f, k, tokens, int(qtype))
                stack, st = natural_stack(records, rec)
                rng = np.random.default_rng(int(qtype))
                n = tokens * k
                xdt = _x_dtype(qtype)
                # correctness: one token, only its k records to the host
                x1 = mx.random.normal((1, d), key=mx.random.key(2))
                s1 = rng.permutation(n)[:k].reshape(1, k).astype(np.int32)
                w1 = rng.random((1, k)).astype(np.float32)
                picked = np.array(mx.take(records, mx.array(s1[0]), axis=0))
                ref = routed_experts([unpack_record(r, rec) for r in picked], w1[0], np.array(x1)[0])
                err = lambda a: float(np.linalg.norm(np.asarray(a) - ref) / np.linalg.norm(ref))  # noqa: E731
                res[f"{name} gather_qmm_rel_err"] = err(np.array(gather_qmm_experts(
                    stack, st, x1.astype(xdt), mx.array(s1), mx.array(w1)))[0])
                if gpu or small:  # the emulator at full size would take minutes
                    with using_path(KernelPath.GPU if gpu else KernelPath.EMULATED):
                        res[f"{name} fused_rel_err"] = err(np.array(moe_native.moe_slots(
                            records, rec, x1, s1, w1).sum(axis=1))[0])
                fused_err = res.get(f"{name} fused_rel_err")
                rows.append((f"{name}: fused vs reference (rel L2)", "-" if fused_err is None else f"{fused_err:.1e}",
                             f"gather_qmm ({str(xdt).split('.')[-1]} x) {res[f'{name} gather_qmm_rel_err']:.1e}"))
                # many tokens per launch: each launch a fresh permutation of the n records
                xs = [mx.random.normal((tokens, d), key=mx.random.key(10 + i)) for i in range(REPS)]
                ss = [mx.array(rng.permutation(n).reshape(tokens, k).astype(np.int32)) + 0 for _ in range(REPS)]
                wt = mx.full((tokens, k), 0.1, mx.float32) + 0
                xh = [x.astype(xdt) for x in xs]
                mx.eval(*xs, *ss, wt, *xh)
                moved = n * rec.record_bytes
                timed = {}
                res[f"{name} default_fc"] = moe_native.block_shape(rec, tokens).fc
                if gpu:  # FC = 64 and 32 (256 threads each), lane steps a loop (the default) or unrolled
                    for fc in (64, 32):
                        default = False
                        for unroll in (default, not default):
                            what = f"fused FC={fc}" + ("" if unroll == default else f" unroll={int(unroll)}")
                            timed[what] = median_time(lambda fc=fc, u=unroll: mx.eval([moe_native.moe_slots(
                                records, rec, xs[i], ss[i], wt, fc=fc, hx_shared=fc == 64, unroll=u) for i in range(REPS)]),
                                warmup=2, reps=5) / REPS
                # fewer launches: MLX's CUDA gather_qmm may group by expert on the host (256 groups here)
                timed["gather_qmm"] = median_time(lambda: mx.eval([gather_qmm_experts(stack, st, xh[i], ss[i], wt)
                                                                   for i in range(GATHER_REPS)]), warmup=1, reps=3) / GATHER_REPS
                for what, t in timed.items():
                    key = f"{name} {what}"
                    res[f"{key}_us"], res[f"{key}_GBps"] = t * 1e6, moved / t / 1e9
                    res[f"{key}_fraction_of_copy"] = moved / t / copy_Bps
                    rows.append((f"{key}: {tokens} tokens x k={k} per launch", f"{t * 1e6:.0f} us",
                                 f"{moved / t / 1e9:.0f} GB/s = {moved / t / copy_Bps * 100:.0f}% of copy "
                                 f"({moved / 1e6:.0f} MB)"))
                # decode-shaped: one token per call, PER_CALL calls per evaluation (host dispatch included)
                one_x = [xs[i % REPS][:1] + 0 for i in range(PER_CALL)]
                one_s = [ss[i % REPS][:1] + 0 for i in range(PER_CALL)]
                one_w = wt[:1] + 0
                mx.eval(*one_x, *one_s, one_w)
                per_call = {}
                if gpu:
                    per_call["fused"] = median_time(lambda: mx.eval([moe_native.moe_slots(
                        records, rec, one_x[i], one_s[i], one_w) for i in range(PER_CALL)])) / PER_CALL
                one_xh = [a.astype(xdt) for a in one_x]
                per_call["gather_qmm"] = median_time(lambda: mx.eval([gather_qmm_experts(
                    stack, st, one_xh[i], one_s[i], one_w) for i in range(PER_CALL)])) / PER_CALL
                for what, t in per_call.items():
                    res[f"{name} {what}_per_call_us"] = t * 1e6
                    rows.append((f"{name} {what}: 1 token, {PER_CALL} calls per eval", f"{t * 1e6:.1f} us/call",
                                 f"{k * rec.record_bytes / t / 1e9:.0f} GB/s"))


def ncu_launches() -> None:
    """For ncu (GPU): per type (the first two) at gpt-oss's shape, a warm-up of each, then one fused
    64-token launch of each lane-step form (loop, unrolled) and one gather_qmm step (3 gather_qmm
    and its elementwise kernels), each evaluated alone; a line before each names it (ncu's
    ==PROF== lines follow in launch order)."""
    d, f, k = SHAPES["gpt-oss"]
    for qtype in TYPES[:2]:  # MXFP4 and 4-bit: ncu profiles every kernel, the records' making too
        rec, records = _setup(qtype, d, f, k, TOKENS, int(qtype))
        stack, st = natural_stack(records, rec)
        rng = np.random.default_rng(0)
        x = mx.random.normal((TOKENS, d)) + 0
        xh = x.astype(_x_dtype(qtype))
        wt = mx.full((TOKENS, k), 0.1, mx.float32) + 0
        ss = [mx.array(rng.permutation(TOKENS * k).reshape(TOKENS, k).astype(np.int32)) + 0 for _ in range(2)]
        mx.eval(x, xh, wt, *ss, records.sum())
        for i, label in enumerate(("warm-up", "profiled")):
            for unroll in (False, True):  # both lane-step forms, so one run settles the default
                print(f"NCU {qtype.name} fused unroll={int(unroll)} {label}", flush=True)
                mx.eval(moe_native.moe_slots(records, rec, x, ss[i], wt, unroll=unroll))
            print(f"NCU {qtype.name} gather_qmm {label}", flush=True)
            mx.eval(gather_qmm_experts(stack, st, xh, ss[i], wt))
        del records, stack, st
