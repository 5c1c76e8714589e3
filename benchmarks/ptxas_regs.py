"""Registers, spills and shared memory of the decode expert kernels at the issue's shape, from
nvcc/ptxas for sm_90 (no GPU needed): each form's CUDA source as MLX would compile it.

    python benchmarks/ptxas_regs.py            # a table and one JSON line
    python benchmarks/ptxas_regs.py --attention-chain   # the chained attention launch's forms

The launches are captured, not run (`launch` replaced by a recorder), so any machine with nvcc
prints what an H200 would get; occupancy follows from registers x threads (65536 a SM). The
chained form (moe_decode.CHAIN_EXPERTS: gate/up and down as one launch) is built on the emulated
path, where phases run (a C++ compiler is enough), and captured the same way.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.formats.expert_record import RecordLayout  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend.kernels import decode_routing, moe_decode, phases  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, using_path  # noqa: E402
from strata.mlx_backend.kernels.preludes import Dialect  # noqa: E402
from strata.mlx_backend.kernels.source import full_source  # noqa: E402
from strata.model_config import RoutingOrder  # noqa: E402

D, F, E, K = 2560, 576, 256, 10


def _capture(fn) -> list:
    """Run fn with every kernel module's `launch` recording (source, dtypes, template, threads)."""
    seen = []

    def fake(src, inputs, shapes, dtypes, *, blocks, threads, template):
        names = [str(np.dtype(str(a.dtype).split(".")[-1])) if not isinstance(a, np.ndarray) else str(a.dtype)
                 for a in inputs]
        seen.append((src, tuple(names), tuple(str(d).split(".")[-1] for d in dtypes), tuple(template), threads, blocks))
        return [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]

    # phases: the launches run from a spec (gate/up, the down step in warps) and the chains
    mods = (moe_decode, phases)
    saved = [m.launch for m in mods]
    for m in mods:
        m.launch = fake
    try:
        fn()
    finally:
        for m, s in zip(mods, saved):
            m.launch = s
    return seen


def _ptxas(code: str, tmp: Path) -> dict:
    inc = tmp / "inc" / "mlx" / "backend" / "cuda" / "device"
    inc.mkdir(parents=True, exist_ok=True)
    (inc / "utils.cuh").write_text("#include <cuda_fp16.h>\n#include <cuda/std/limits>\n")
    f = tmp / "k.cu"
    f.write_text(code)
    proc = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(tmp / "k.cubin"), "-w", "-Xptxas", "-v",
                           "-I", str(tmp / "inc"), str(f)], capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr[-800:]}
    m = re.search(r"Used (\d+) registers", proc.stderr)
    spill = re.search(r"(\d+) bytes spill stores", proc.stderr)
    smem = re.search(r"(\d+) bytes smem", proc.stderr)
    return {"registers": int(m.group(1)) if m else None, "spill_stores": int(spill.group(1)) if spill else 0,
            "smem": int(smem.group(1)) if smem else 0}


def attention_chains() -> list:
    """The chained attention launch of a decoded layer at the issue's shape (16 q / 4 KV heads of
    128), captured in each form: the plain chain, the QKV walk by KV group at 4 and 16 W_o groups
    loaded first, the walk led by the previous layer's deferred down step (moe_decode.DeferredDown),
    both with the top k ranked as the last phase (route_rank.py: moe_decode.RANK_ONCE), and past
    SPLIT_FROM the split attention's chain (kernels/attend_split.py)."""
    from strata.mlx_backend.kernels import attend_project, attend_split

    h, kvh, hd, s, f16 = 16, 4, 128, 64, mx.float16
    rec = RecordLayout(QuantType.Q2_0, D, F)
    arena = mx.zeros((4, rec.padded_bytes), mx.uint8)
    x, z = mx.zeros((1, D)), mx.zeros((1, E))

    def route(x_in, rank_k=0):
        attend_project.qkv_attend_route(
            mx.zeros(((h + 2 * kvh) * hd, D), f16), x_in, mx.zeros((D,), f16), None, mx.zeros((hd,), f16),
            mx.zeros((hd,), f16), mx.zeros((s, hd // 2)), mx.zeros((s, hd // 2)), mx.zeros((kvh, s, hd)),
            mx.zeros((kvh, s, hd)), mx.zeros((D, h * hd), f16), mx.zeros((D,), f16), mx.zeros((E, D)), 3, 1e-6, h,
            rank_k=rank_k)

    def split_route(x_in):
        sl = 512
        attend_split.qkv_split_route(
            mx.zeros(((h + 2 * kvh) * hd, D), f16), x_in, mx.zeros((D,), f16), None, mx.zeros((hd,), f16),
            mx.zeros((hd,), f16), mx.zeros((sl, hd // 2)), mx.zeros((sl, hd // 2)), mx.zeros((kvh, sl, hd)),
            mx.zeros((kvh, sl, hd)), mx.zeros((D, h * hd), f16), mx.zeros((D,), f16), mx.zeros((E, D)), 300, 1e-6, h)

    def forms():
        saved = attend_project.QKV_BY_GROUP, attend_project.GROUP_PREFETCH
        deferring = moe_decode.DEFER_DOWN
        moe_decode.DEFER_DOWN = True  # the deferred forms, whatever the default
        try:
            with using_path(KernelPath.EMULATED):
                for walk, pf in ((False, 16), (True, 4), (True, 16)):
                    attend_project.QKV_BY_GROUP, attend_project.GROUP_PREFETCH = walk, pf
                    route(x)
                attend_project.QKV_BY_GROUP, attend_project.GROUP_PREFETCH = saved
                down = moe_decode.routed_residual(arena, rec, x, x, z, 0, K, RoutingOrder.SOFTMAX_TOPK, True,
                                                  defer=True)
                route(down)
                route(x, rank_k=K)
                route(moe_decode.routed_residual(arena, rec, x, x, z, 0, K, RoutingOrder.SOFTMAX_TOPK, True,
                                                 defer=True), rank_k=K)
                split_route(x)  # past SPLIT_FROM (kernels/attend_split.py's chain)
        finally:
            attend_project.QKV_BY_GROUP, attend_project.GROUP_PREFETCH = saved
            moe_decode.DEFER_DOWN = deferring

    return [c for c in _capture(forms) if c[0].name.startswith("strata_chain_")]


def main() -> int:
    if shutil.which("nvcc") is None:
        print("ptxas_regs: no nvcc here")
        return 1
    if "--attention-chain" in sys.argv[1:]:
        print("| chained attention launch | W_o groups first | blocks | registers | spill stores | smem bytes | "
              "blocks an SM (registers) |\n|---|---|---|---|---|---|---|")
        with tempfile.TemporaryDirectory() as td:
            for src, ins, outs, template, threads, blocks in attention_chains():
                r = _ptxas(full_source(src, Dialect.CUDA, ins, outs, template), Path(td))
                regs = r.get("registers")
                print(f"| {src.name} | {dict(template).get('B_PREF', dict(template).get('C_PREF'))} | {blocks[0]} | "
                      f"{regs} | {r.get('spill_stores')} | {r.get('smem')} | "
                      f"{65536 // (regs * threads) if regs else None} |" + (f" {r['error'][:200]}" if "error" in r else ""))
        return 0
    rec = RecordLayout(QuantType.Q2_0, D, F)
    arena = mx.zeros((4, rec.padded_bytes), mx.uint8)
    x, z = mx.zeros((1, D)), mx.zeros((1, E))

    def forms():
        for ranking in decode_routing.ROUTING_FORMS:
            for upw in (4, 2):
                moe_decode.routed_residual(arena, rec, x, x, z, 0, K, RoutingOrder.SOFTMAX_TOPK, True, rounds=ranking,
                                           upw=upw, down_warps=ranking is decode_routing.Ranking.BITONIC and upw == 4)
        for upw in (4, 2):
            moe_decode.routed_residual(arena, rec, x, x, z, 0, K, RoutingOrder.SOFTMAX_TOPK, True, upw=upw,
                                       rounds=decode_routing.Ranking.BITONIC, weights_early=True, down_warps=True,
                                       down_rows=16)
            moe_decode.routed_residual(arena, rec, x, x, z, 0, K, RoutingOrder.SOFTMAX_TOPK, True, upw=upw,
                                       vector_loads=True)
        # the top k given (ranked once in the attention's launch: moe_decode.RANK_ONCE)
        ranked = decode_routing.RankedLogits(z, mx.zeros((1, K), mx.int32))
        moe_decode.routed_residual(arena, rec, x, x, ranked, 0, K, RoutingOrder.SOFTMAX_TOPK, True)

    def chained():  # on the emulated path, where phases.available() (the launch itself is captured)
        with using_path(KernelPath.EMULATED):
            moe_decode.routed_residual(arena, rec, x, x, z, 0, K, RoutingOrder.SOFTMAX_TOPK, True)

    def every_form():
        saved = moe_decode.CHAIN_EXPERTS
        try:
            moe_decode.CHAIN_EXPERTS = False  # the two launches' forms, whatever the default
            forms()
            moe_decode.CHAIN_EXPERTS = True
            chained()
        finally:
            moe_decode.CHAIN_EXPERTS = saved

    seen = _capture(every_form)
    rows, out, done = [], {}, set()
    with tempfile.TemporaryDirectory() as td:
        for src, ins, outs, template, threads, blocks in seen:
            key = (src.name, template)
            if key in done:
                continue
            done.add(key)
            code = full_source(src, Dialect.CUDA, ins, outs, template)
            r = _ptxas(code, Path(td))
            t = dict(template)
            label = f"{src.name} blocks {blocks[0]} x {threads}" + (
                f" ROUNDS {t['ROUNDS']} UPW {t['UPW']} WE {t['WE']} VL {t['VL']}" if "ROUNDS" in t else "") + (
                f" (gate/up {t['CHAIN_S1']} blocks)" if "CHAIN_S1" in t else "")
            regs = r.get("registers")
            occ = (65536 // (regs * threads)) if regs else None
            rows.append((label, regs, r.get("spill_stores"), r.get("smem"), occ, r.get("error", "")[:200]))
            out[label] = {**r, "blocks_an_sm_by_registers": occ}
    print("| kernel | registers | spill stores | smem bytes | blocks an SM (registers) |")
    print("|---|---|---|---|---|")
    for label, regs, sp, sm, occ, err in rows:
        print(f"| {label} | {regs} | {sp} | {sm} | {occ} |" + (f" {err}" if err else ""))
    print(json.dumps({"ptxas_regs": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
