"""The kernels for llama.cpp's types kept as stored: the fused expert kernel (kernels/moe_ggml.py) per
expert type and the dense GEMV (kernels/ggml_gemv.py) per dense type: `benchmarks/kernels.py --ggml
[--expert-type Q4_K,Q6_K,...]` (device_run.sh's `ggml` suite) and its `--ncu ggml` launches.

Method (Q2_0's, kernels.py): correctness of one token against the reference (the k records to the
host, dequantized by strata/reference/ggml_quants.py, float32 matmuls); then each kernel's share of
copy bandwidth two ways: many tokens per launch (64, each its own k records of a pool of exactly
that many: nothing served from the L2), which is GPU time, and decode-shaped (one token per launch,
48 launches per evaluation), which includes the ~8 us host dispatch a launch costs, so at decode
it understates the kernel: ncu's GPU time of the 1-token launches (`--ncu ggml`) is the number
the issue's target (>= 50% of copy) is read from, as for Q2_0. Bytes = tokens x k x record bytes.
Shape: the seed's D = 2560 and k = 10 with F = 768 (the seed's 576 is not whole 256-weight
super-blocks: llama.cpp would write its down in a fallback type, measured by decode.py
--expert-type) so each row is one type.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from _measure import median_time, part
from strata.formats.expert_record import RecordLayout, unpack_record
from strata.formats.quant_types import QuantType
from strata.mlx_backend.kernels import ggml_dot, ggml_gemv, moe_ggml
from strata.mlx_backend.kernels.launch import KernelPath, using_path
from strata.reference.experts import routed_experts
from strata.testing.ggml_records import random_ggml_matrix, random_ggml_records

EXPERT_TYPES = ggml_dot.TYPES  # the order
DENSE_TYPES = (QuantType.Q6_K, QuantType.Q5_K, QuantType.Q4_K, QuantType.Q8_0)
SHAPE, SMALL_SHAPE = (2560, 768, 10), (256, 256, 4)  # D, F, k
DENSE_SHAPE, SMALL_DENSE = (16384, 2560), (256, 512)  # rows, cols: a vocabulary slice / the seed's D
TOKENS, SMALL_TOKENS = 64, 8
REPS = 10  # launches per timed evaluation
PER_CALL = 48  # decode-shaped calls per evaluation (a 48-layer token's worth)


def parse_types(text: str | None) -> tuple[QuantType, ...]:
    """'Q4_K,Q6_K' -> the types (ggml's MXFP4 spelled MXFP4); None: every expert type with a kernel."""
    if not text:
        return EXPERT_TYPES
    out = []
    for name in text.split(","):
        key = name.strip().upper()
        q = QuantType.__members__.get("GGML_" + key) or QuantType.__members__.get(key)  # ggml's MXFP4, not MLX's
        if q not in EXPERT_TYPES:
            known = ", ".join(ggml_dot.ggml_block_name(t) for t in EXPERT_TYPES)
            raise SystemExit(f"--expert-type {name}: no ggml expert kernel for it (known: {known})")
        out.append(q)
    return tuple(out)


def _rate(rows: list, res: dict, key: str, what: str, t: float, moved: int, copy_Bps: float) -> None:
    res[f"{key}_us"], res[f"{key}_GBps"], res[f"{key}_fraction_of_copy"] = t * 1e6, moved / t / 1e9, moved / t / copy_Bps
    rows.append((what, f"{t * 1e6:.1f} us", f"{moved / t / 1e9:.0f} GB/s = {moved / t / copy_Bps * 100:.0f}% of copy "
                                            f"({moved / 1e6:.1f} MB)"))


def ggml_part(res: dict, rows: list, copy_Bps: float, *, small: bool, gpu: bool, types=EXPERT_TYPES) -> None:
    """Per expert type: correctness on one token, then the fused kernel's GPU time (64 tokens a
    launch) and its decode-shaped time (1 token a launch); then the dense GEMV per dense type."""
    d, f, k = SMALL_SHAPE if small else SHAPE
    tokens = SMALL_TOKENS if small else TOKENS
    for qtype in types:
        name = f"ggml {ggml_dot.ggml_block_name(qtype)}"
        with part(name, res, rows):
            rec = RecordLayout(qtype, d, f)
            n = tokens * k
            records = random_ggml_records(rec, n, mx.random.key(int(qtype)))
            rng = np.random.default_rng(int(qtype))
            x1 = mx.random.normal((1, d), key=mx.random.key(2)) * 0.05
            s1 = rng.permutation(n)[:k].reshape(1, k).astype(np.int32)
            w1 = rng.random((1, k)).astype(np.float32)
            picked = np.array(mx.take(records, mx.array(s1[0]), axis=0))
            ref = routed_experts([unpack_record(r, rec) for r in picked], w1[0], np.array(x1)[0])
            if gpu or small:  # the emulator at full size would take minutes
                with using_path(KernelPath.GPU if gpu else KernelPath.EMULATED):
                    got = np.array(moe_ggml.moe_slots(records, rec, x1, s1, w1).sum(axis=1))[0]
                err = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
                res[f"{name} rel_err"] = err
                rows.append((f"{name}: fused vs reference (rel L2)", f"{err:.1e}", f"D={d} F={f} k={k}"))
            if not gpu:
                continue
            xs = [mx.random.normal((tokens, d), key=mx.random.key(10 + i)) * 0.05 for i in range(REPS)]
            ss = [mx.array(rng.permutation(n).reshape(tokens, k).astype(np.int32)) + 0 for _ in range(REPS)]
            wt = mx.full((tokens, k), 0.1, mx.float32) + 0
            mx.eval(*xs, *ss, wt)
            t = median_time(lambda: mx.eval([moe_ggml.moe_slots(records, rec, xs[i], ss[i], wt) for i in range(REPS)]),
                            warmup=2, reps=5) / REPS
            _rate(rows, res, f"{name} fused_{tokens}", f"{name}: {tokens} tokens x k={k} per launch", t,
                  n * rec.record_bytes, copy_Bps)
            one_x = [xs[i % REPS][:1] + 0 for i in range(PER_CALL)]
            one_s = [ss[i % REPS][:1] + 0 for i in range(PER_CALL)]
            one_w = wt[:1] + 0
            mx.eval(*one_x, *one_s, one_w)
            t = median_time(lambda: mx.eval([moe_ggml.moe_slots(records, rec, one_x[i], one_s[i], one_w)
                                             for i in range(PER_CALL)])) / PER_CALL
            _rate(rows, res, f"{name} fused_decode", f"{name}: 1 token, {PER_CALL} calls per eval (dispatch in)", t,
                  k * rec.record_bytes, copy_Bps)
    r, c = SMALL_DENSE if small else DENSE_SHAPE
    for qtype in DENSE_TYPES:
        name = f"ggml GEMV {ggml_dot.ggml_block_name(qtype)}"
        with part(name, res, rows):
            w, scales = _dense(qtype, r, c, int(qtype))
            xs = [mx.random.normal((1, c), key=mx.random.key(i)) for i in range(PER_CALL)]
            mx.eval(*xs)
            if not gpu:
                with using_path(KernelPath.EMULATED):
                    mx.eval(ggml_gemv.ggml_gemv(qtype, w, xs[0], scales))
                rows.append((f"{name}: {r}x{c} ran (emulated)", "-", ""))
                continue
            t = median_time(lambda: mx.eval([ggml_gemv.ggml_gemv(qtype, w, xs[i], scales) for i in range(PER_CALL)])) / PER_CALL
            _rate(rows, res, name, f"{name} {r}x{c}: 1 token, {PER_CALL} calls per eval", t,
                  w.nbytes + (0 if scales is None else scales.nbytes), copy_Bps)


def _dense(qtype: QuantType, rows: int, cols: int, seed: int) -> tuple[mx.array, mx.array | None]:
    """A random valid matrix of `qtype` rows: (blocks uint8 [R, row bytes], Q8_0's scales or None)."""
    return random_ggml_matrix(qtype, rows, cols, mx.random.key(seed))


def ncu_ggml_launches(types=EXPERT_TYPES) -> None:
    """For ncu (GPU): per expert type at the benchmark shape, a warm-up then one 1-token launch (a
    decoded token's layer) and one 64-token launch; per dense type one GEMV; a line before each
    names it (ncu's ==PROF== lines follow in launch order)."""
    d, f, k = SHAPE
    for qtype in types:
        rec = RecordLayout(qtype, d, f)
        records = random_ggml_records(rec, TOKENS * k, mx.random.key(int(qtype)))
        rng = np.random.default_rng(0)
        x = mx.random.normal((TOKENS, d)) * 0.05 + 0
        wt = mx.full((TOKENS, k), 0.1, mx.float32) + 0
        ss = [mx.array(rng.permutation(TOKENS * k).reshape(TOKENS, k).astype(np.int32)) + 0 for _ in range(2)]
        mx.eval(x, wt, *ss)
        for i, label in enumerate(("warm-up", "profiled")):
            for t in (1, TOKENS):
                print(f"NCU {ggml_dot.ggml_block_name(qtype)} fused tokens={t} {label} "
                      f"bytes={t * k * rec.record_bytes}", flush=True)
                mx.eval(moe_ggml.moe_slots(records, rec, x[:t], ss[i][:t], wt[:t]))
        del records
    r, c = DENSE_SHAPE
    for qtype in DENSE_TYPES:
        w, scales = _dense(qtype, r, c, int(qtype))
        x = mx.random.normal((1, c)) + 0
        mx.eval(x)
        for label in ("warm-up", "profiled"):
            print(f"NCU GEMV {ggml_dot.ggml_block_name(qtype)} {label} bytes={w.nbytes}", flush=True)
            mx.eval(ggml_gemv.ggml_gemv(qtype, w, x, scales))
