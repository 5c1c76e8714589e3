"""Kernel-level checks beyond the twins: the fused expert kernel at the reference engine's expert size, the
GPU routing variant against host routing, determinism (a moving result is a race), the arena's
host writes reaching the kernels with no copy, arenas past 2 and 4 GiB (index math and MLX's int32
shapes), no host arrays in a decoded token's kernel inputs, and the launch budget per decoded
layer.

GPU tests are marked `gpu` and skip where MLX has no GPU; the emulated ones run the same shared
bodies on the CPU (medium sizes: several words per lane, several chunks per expert).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.formats.expert_record import RECORD_ALIGN, RecordLayout, unpack_record
from strata.formats.quant_types import QuantType
from strata.mlx_backend import model as mlx_model
from strata.mlx_backend import arena as arena_module
from strata.mlx_backend.arena import MLX_MAX_DIM, ArenaView, MlxArena, arena_geometry
from strata.mlx_backend.experts import routed_partials
from strata.mlx_backend.kernels import attend_project, emulate, moe
from strata.mlx_backend.kernels import shared as shared_kernel
from strata.mlx_backend.kernels.launch import HOST_INPUTS, LAUNCHES, KernelPath, gpu_dialect, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.routing import route_batch
from strata.testing.mlx_params import SEED_SHAPE, random_params, random_records
from strata.model_config import RoutingOrder
from strata.reference.experts import routed_experts
from strata.reference.routing import RouterRule
from tests.kernel_paths import KERNEL_PATHS, emulated

SEED_EXPERT = (SEED_SHAPE.hidden_size, SEED_SHAPE.expert_ffn_size)  # 2560 x 576: 1.3824 MB of Q2_0
MEDIUM_EXPERT = (1024, 96)  # two words per lane, three chunks per expert


def _case(path, seed: int, k: int = 10, tokens: int = 2):
    d, f = SEED_EXPERT if path is KernelPath.GPU else MEDIUM_EXPERT
    rec = RecordLayout(QuantType.Q2_0, d, f)
    records = random_records(rec, 24, mx.random.key(seed))
    rng = np.random.default_rng(seed)
    slots = np.stack([rng.choice(24, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    slots[0, -1] = -1  # a skipped rank
    weights = rng.random((tokens, k)).astype(np.float32)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    host = np.array(records)
    ref = np.stack([routed_experts([unpack_record(host[s], rec) for s in slots[t] if s >= 0],
                                   weights[t][slots[t] >= 0], x[t]) for t in range(tokens)])
    return rec, records, x, slots, weights, ref


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_fused_experts_against_reference(path, seed):
    with using_path(path):
        rec, records, x, slots, weights, ref = _case(path, seed)
        for fc in (32, 96 if rec.expert_ffn == 96 else 64):
            got = moe.moe_slots(records, rec, mx.array(x), slots, weights, fc=fc).sum(axis=1)
            assert_backends_agree(ref, got, "FAST", what=f"fused experts FC={fc}")
        for threads in (128, 512):  # the block shapes the benchmark compares
            got = moe.moe_slots(records, rec, mx.array(x), slots, weights, threads=threads).sum(axis=1)
            assert_backends_agree(ref, got, "FAST", what=f"fused experts NT={threads}")
        # h read from registers or from threadgroup memory: the same arithmetic, bit for bit
        in_regs, in_smem = (np.array(moe.moe_slots(records, rec, mx.array(x), slots, weights, hx_shared=hx))
                            for hx in (False, True))
        np.testing.assert_array_equal(in_regs, in_smem)
        # the down step's codes in vector loads or word by word: the same words, bit for bit
        for fc in (32, 64) if rec.expert_ffn % 64 == 0 else (32,):
            vec, words = (np.array(moe.moe_slots(records, rec, mx.array(x), slots, weights, fc=fc, vector_loads=vl))
                          for vl in (True, False))
            np.testing.assert_array_equal(vec, words)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_many_token_block_shape(path):
    """A launch of MANY_TOKENS tokens takes the many-token block shape (FC = 64, 512 threads, h
    from threadgroup memory), a decode token the (32, 256) one; both agree with the reference,
    with host slots and GPU routing, and the shared expert's blocks in the same grid run at 512
    threads too."""
    tokens = moe.MANY_TOKENS
    d, f = SEED_EXPERT if path is KernelPath.GPU else (512, 128)
    rec = RecordLayout(QuantType.Q2_0, d, f)
    assert moe.block_shape(rec, tokens) == moe.MANY_TOKENS_SHAPE and moe.block_shape(rec, 1).fc == 32
    assert moe.block_shape(RecordLayout(QuantType.Q2_0, d, 96), tokens).fc == 32  # 64 must divide F
    with using_path(path):
        records = random_records(rec, 12, mx.random.key(5))
        rng = np.random.default_rng(5)
        k = 3
        slots = np.stack([rng.choice(12, k, replace=False) for _ in range(tokens)]).astype(np.int32)
        weights = rng.random((tokens, k)).astype(np.float32)
        x = rng.standard_normal((tokens, d)).astype(np.float32)
        host = np.array(records)
        ref = np.stack([routed_experts([unpack_record(host[s], rec) for s in slots[t]], weights[t], x[t])
                        for t in range(tokens)])
        xm = mx.array(x)
        many = moe.moe_slots(records, rec, xm, slots, weights)
        assert many.shape == (tokens, k * f // 64, d)
        assert_backends_agree(ref, many.sum(axis=1), "FAST", what="fused experts, many-token shape")
        fs = 64
        gate, up, down = (mx.array((rng.standard_normal(s) * 0.05).astype(np.float16)) for s in ((fs, d), (fs, d), (d, fs)))
        routed, shared = moe.moe_slots(records, rec, xm, slots, weights, shared=(gate, up, down))
        np.testing.assert_array_equal(np.array(routed), np.array(many))
        np.testing.assert_array_equal(np.array(shared), np.array(shared_kernel.shared_partials(xm, gate, up, down)))
        z = rng.standard_normal((tokens, 12)).astype(np.float32)
        on_gpu = moe.moe_route(records, rec, xm, mx.array(z), 0, k, RoutingOrder.SOFTMAX_TOPK, True)
        top = np.argsort(-z, axis=1, kind="stable")[:, :k]
        p = np.exp(z - z.max(axis=1, keepdims=True))
        w = np.take_along_axis(p, top, axis=1)
        w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
        ref_z = np.stack([routed_experts([unpack_record(host[s], rec) for s in top[t]], w[t], x[t]) for t in range(tokens)])
        assert_backends_agree(ref_z, on_gpu.sum(axis=1), "FAST", what="fused experts, many-token shape, GPU routing")


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_subnormal_code_form_matches_the_exponent_form(path):
    """DN = 1 (an AND and an FMA per code, codes as subnormal floats) against DN = 0 (codes under
    1.0f's exponent, then a subtract) and the reference. On the GPU the two forms are the same
    arithmetic (every product exact, the same FMA order): bit for bit on ordinary activations
    (tokens 1..); token 0 carries extreme values (1e-18, 3e4), where the H200 showed 119 of 921,600
    outputs differing by up to 8e-6 relative (a 1-ulp gate difference amplified by silu far in its
    tail is the likely path): both forms are held to the reference there. The emulator's DN = 0
    adds its products apart (g++ does not contract), so there the bound is the reference's."""
    with using_path(path):
        rec, records, x, slots, weights, ref = _case(path, 9)
        x[0, :5] = [3e-18, -7e-19, 2e4, -3e4, 0.0]  # tiny (near 2^-62), an outlier, and zero
        with np.errstate(over="ignore"):  # silu of a large negative gate: exp(-g) is inf, the value -0
            ref = np.stack([routed_experts([unpack_record(np.array(records)[s], rec) for s in slots[t] if s >= 0],
                                           weights[t][slots[t] >= 0], x[t]) for t in range(len(x))])
        exp_form = np.array(moe.moe_slots(records, rec, mx.array(x), slots, weights, denormals=False))
        sub_form = np.array(moe.moe_slots(records, rec, mx.array(x), slots, weights, denormals=True))
        assert_backends_agree(ref, sub_form.sum(axis=1), "FAST", what="subnormal code form")
        assert_backends_agree(ref, exp_form.sum(axis=1), "FAST", what="exponent code form")
        if path is KernelPath.GPU and gpu_dialect() is Dialect.CUDA:
            np.testing.assert_array_equal(sub_form[1:], exp_form[1:])


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_shared_expert_blocks_in_the_routed_launch(path):
    """The shared expert's blocks riding in the routed kernel's grid give the standalone kernels'
    partials, bit for bit (the same bodies on the same inputs), with host slots and GPU routing."""
    with using_path(path):
        rec, records, x, slots, weights, _ = _case(path, 7, k=4, tokens=3)
        d, fs = rec.hidden, 2 * 64
        rng = np.random.default_rng(7)
        gate, up, down = (mx.array((rng.standard_normal(s) * 0.05).astype(np.float16)) for s in ((fs, d), (fs, d), (d, fs)))
        xm = mx.array(x)
        routed, shared = moe.moe_slots(records, rec, xm, slots, weights, shared=(gate, up, down))
        np.testing.assert_array_equal(np.array(routed), np.array(moe.moe_slots(records, rec, xm, slots, weights)))
        np.testing.assert_array_equal(np.array(shared), np.array(shared_kernel.shared_partials(xm, gate, up, down)))
        z = mx.array(rng.standard_normal((3, 24)).astype(np.float32))
        routed, shared2 = moe.moe_route(records, rec, xm, z, 0, 4, RoutingOrder.SOFTMAX_TOPK, True, shared=(gate, up, down))
        np.testing.assert_array_equal(np.array(shared2), np.array(shared))
        np.testing.assert_array_equal(np.array(routed),
                                      np.array(moe.moe_route(records, rec, xm, z, 0, 4, RoutingOrder.SOFTMAX_TOPK, True)))
        hf = lambda w: np.asarray(w, np.float64)  # noqa: E731
        h = (lambda g, u: g / (1 + np.exp(-g)) * u)(x @ hf(gate).T, x @ hf(up).T)
        assert_backends_agree(h @ hf(down).T, np.array(shared).sum(axis=1), "FAST", what="shared expert")


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_gpu_routing_matches_host_routing(path):
    with using_path(path):
        rec, records, x, _, _, _ = _case(path, 3, k=4, tokens=3)
        rng = np.random.default_rng(3)
        z = rng.standard_normal((3, 24)).astype(np.float32)
        z[1, 5] = z[1, 7]  # an exact tie: the lower id wins on both sides
        for order, norm in ((RoutingOrder.SOFTMAX_TOPK, True), (RoutingOrder.SOFTMAX_TOPK, False),
                            (RoutingOrder.TOPK_SOFTMAX, False)):
            rule = RouterRule(4, order, norm)
            sels = route_batch(z, rule)
            slots = np.stack([s.experts for s in sels]).astype(np.int32)
            weights = np.stack([s.weights for s in sels]).astype(np.float32)
            want = moe.moe_slots(records, rec, mx.array(x), slots, weights).sum(axis=1)
            got = moe.moe_route(records, rec, mx.array(x), mx.array(z), 0, 4, order, norm).sum(axis=1)
            assert_backends_agree(np.array(want), got, "FAST", what=f"{order.value} norm={norm}")


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_kernels_are_deterministic():
    """The same inputs give the same bits: no race between blocks or warps."""
    with using_path(KernelPath.GPU):
        rec, records, x, slots, weights, _ = _case(KernelPath.GPU, 5)
        a = np.array(moe.moe_slots(records, rec, mx.array(x), slots, weights))
        for _ in range(3):
            np.testing.assert_array_equal(np.array(moe.moe_slots(records, rec, mx.array(x), slots, weights)), a)
        cfg = replace(SEED_SHAPE, n_layers=2, vocab_size=512)
        p = random_params(cfg, seed=1, pred_q8=False)
        out = [np.array(mlx_model.forward(p, mlx_model.MlxModelState.empty(cfg), np.array([3, 1, 4]))[0]) for _ in range(2)]
        np.testing.assert_array_equal(out[0], out[1])


@pytest.mark.parametrize("path", [pytest.param(KernelPath.OPS, id="ops")] + KERNEL_PATHS)
def test_arena_host_writes_reach_the_kernels_without_a_copy(path):
    """A pread into slot_buffer() is what the next kernel reads: no stale copy, no arena copy,
    even while a view of the arena is alive (MLX would copy the whole buffer on a slice update)."""
    with using_path(path):
        rec, records, x, _, _, _ = _case(path, 7, k=2, tokens=1)
        host = np.array(records)
        arena = MlxArena(4, rec.padded_bytes)
        alias = arena.array[1:3]  # a live view of the arena
        ptr = np.array(arena.array, copy=False).ctypes.data
        slots, weights = np.array([[2, 0]], np.int32), np.array([[0.7, 0.3]], np.float32)
        for a, b in ((0, 1), (5, 9)):
            arena.slot_buffer(2)[:] = host[a]
            arena.slot_buffer(0)[:] = host[b]
            arena.publish(2)
            arena.publish(0)
            ref = routed_experts([unpack_record(host[a], rec), unpack_record(host[b], rec)], weights[0], x[0])
            got = routed_partials(arena.array, rec, mx.array(x), slots, weights).sum(axis=1)
            assert_backends_agree(ref[None], got, "FAST", what=f"experts {a},{b} via the arena")
        assert np.array(arena.array, copy=False).ctypes.data == ptr
        assert np.array(alias).shape == (2, rec.padded_bytes)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_disk_reads_into_the_arena_reach_the_gpu(tmp_path, direct):
    """The streaming path's reads: a pread (O_DIRECT or buffered) into an arena slot the GPU has
    already read, while the GPU reads the next slot, then the GPU reads it again and must see the
    new bytes, round after round. (On
    MLX's CUDA build the arena is managed memory; a DMA into it must not leave the GPU a stale
    copy. The engine tests failed on the H200 with O_DIRECT only, twice.)"""
    if gpu_dialect() is None:
        pytest.skip("no MLX GPU here")
    slot_bytes, n_records, cap = 1 << 20, 6, 3
    rng = np.random.default_rng(1)
    records = rng.integers(0, 256, (n_records, slot_bytes), dtype=np.uint8)
    path = tmp_path / "records.bin"
    records.tofile(path)
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    try:
        fd = os.open(path, flags)
        arena = MlxArena(cap, slot_bytes)
        os.preadv(fd, [arena.slot_buffer(0)], 0)
    except (OSError, AttributeError) as e:
        pytest.skip(f"no O_DIRECT reads here: {e}")
    weights = mx.array(rng.integers(1, 7, slot_bytes).astype(np.uint32))  # a position-dependent checksum
    try:
        for round_ in range(24):
            slot, rec = round_ % cap, (round_ * 5) % n_records
            mx.eval((arena.array[slot].astype(mx.uint32) * weights).sum())  # the GPU reads the slot first
            other = arena.array[(slot + 1) % cap].astype(mx.uint32)
            busy = [(other * (weights + i)).sum() for i in range(16)]
            mx.async_eval(busy)  # ... and reads its neighbour (same 2 MB page) while the read lands
            assert os.preadv(fd, [arena.slot_buffer(slot)], rec * slot_bytes) == slot_bytes
            mx.eval(busy)
            got = int((arena.array[slot].astype(mx.uint32) * weights).sum().item())
            want = int((records[rec].astype(np.uint64) * np.array(weights, np.uint64)).sum() % (1 << 32))
            assert got == want, f"round {round_}: slot {slot} holds stale bytes on the GPU after a read of record {rec}"
    finally:
        os.close(fd)


@pytest.mark.parametrize("base", [0, 3016, 4095, 1 << 40])
def test_arena_geometry_past_int32(base):
    """The H200 runs' streaming arena: 3072 seed-size slots = 4.25 GB, which one MLX dimension
    (int32) cannot hold (a flat allocation failed: "Integer value 4253028352 is outside the
    supported range"), nor an as_strided view of it (it flattens: "[flatten] Shape dimension
    4254408704"). Every dimension fits; slot 0 is page-aligned where the allocation is, or where
    an offset view is possible; the view stays inside the allocation. Computed, not allocated."""
    cap, slot = 3072, RecordLayout(QuantType.Q2_0, *SEED_EXPERT).padded_bytes
    geo = arena_geometry(cap, slot, base)
    rows, cols = geo.alloc_shape
    assert geo.nbytes + RECORD_ALIGN == 4253028352 and geo.nbytes > 2**31
    assert 0 < rows <= MLX_MAX_DIM and 0 < cols <= MLX_MAX_DIM
    assert geo.offset + geo.nbytes <= rows * cols
    if base % RECORD_ALIGN == 0:
        assert geo.view is ArenaView.ROWS and geo.offset == 0
    else:
        assert geo.view is ArenaView.UNALIGNED and geo.offset == 0
    small = arena_geometry(8, slot, base)
    assert small.view is (ArenaView.ROWS if base % RECORD_ALIGN == 0 else ArenaView.OFFSET)
    assert (base + small.offset) % RECORD_ALIGN == 0 and small.offset + small.nbytes <= 9 * slot
    with pytest.raises(ValueError, match="int32"):
        arena_geometry(MLX_MAX_DIM, slot, base)


def test_arena_too_large_for_an_offset_view_still_works(monkeypatch):
    """An arena over FLAT_LIMIT bytes on a misaligned allocation is a plain row slice: host writes
    reach MLX's view of it (here FLAT_LIMIT is lowered so a small arena takes that path)."""
    monkeypatch.setattr(arena_module, "FLAT_LIMIT", 0)
    arena = MlxArena(4, RECORD_ALIGN)
    assert arena.view in (ArenaView.ROWS, ArenaView.UNALIGNED)
    pattern = np.arange(RECORD_ALIGN, dtype=np.uint32).astype(np.uint8)
    arena.slot_buffer(2)[:] = pattern
    np.testing.assert_array_equal(np.array(mx.take(arena.array, mx.array([2]), axis=0))[0], pattern)


@emulated
def test_fused_kernel_reads_slots_past_4_gib():
    """Slots whose byte offsets pass 2**31 and 2**32 (the kernel indexes the arena with 64-bit
    offsets): an arena of reserved, untouched memory; only the two slots read are written."""
    rec = RecordLayout(QuantType.Q2_0, *MEDIUM_EXPERT)
    cap = (1 << 32) // rec.padded_bytes + 3
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    mm = mmap.mmap(-1, cap * rec.padded_bytes, flags=flags)
    arena = np.frombuffer(mm, np.uint8).reshape(cap, rec.padded_bytes)
    far = np.array([[cap - 1, (1 << 31) // rec.padded_bytes + 1]], np.int32)
    assert int(far[0, 0]) * rec.padded_bytes > 2**32 and int(far[0, 1]) * rec.padded_bytes > 2**31
    host = np.array(random_records(rec, 2, mx.random.key(11)))
    arena[far[0, 0]], arena[far[0, 1]] = host[0], host[1]
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, rec.hidden)).astype(np.float32)
    weights = np.array([[0.6, 0.4]], np.float32)
    pad = lambda a: np.concatenate([a.reshape(-1), np.zeros(8 - a.size, a.dtype)])  # noqa: E731
    fc = moe.block_shape(rec, 1).fc
    nch = rec.expert_ffn // fc
    none = np.zeros(8, np.float16)  # no shared expert
    out = emulate.run(moe.SLOTS_SOURCE, [arena, x, pad(far), pad(weights), none, none, none],
                      [(1, 2 * nch, rec.hidden), (1, 1, rec.hidden)], [np.float32, np.float32],
                      (2 * nch * moe.THREADS, 1, 1), (moe.THREADS, 1, 1), moe.full_template(rec, 2, fc))[0]
    ref = routed_experts([unpack_record(host[0], rec), unpack_record(host[1], rec)], weights[0], x[0])
    assert_backends_agree(ref[None], out.sum(axis=1), "FAST", what="slots past 4 GiB")
    del arena


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_decoded_token_sends_no_host_arrays_to_kernels(path):
    """A decoded token (all experts resident, routing on the device) launches 5 kernels per layer
    (QKV, attention with its output projection, router, experts, combine; 4 or 3 where the QKV GEMV
    and the router chain into the attention's launch) plus the embedding and the head, and none of them reads an
    array made from host memory (on MLX CUDA such an input is managed memory the GPU must fault in:
    tens of us per launch)."""
    cfg = replace(SEED_SHAPE, n_layers=2, hidden_size=256, n_experts=16, n_experts_per_token=4, expert_ffn_size=64,
                  shared_ffn_size=64, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512, max_context=64)
    with using_path(path):
        p = random_params(cfg, seed=2, pred_q8=False)
        _, state = mlx_model.forward(p, mlx_model.MlxModelState.empty(cfg), np.array([7, 3]))
        launches, host = sum(LAUNCHES.values()), sum(HOST_INPUTS.values())
        logits, _ = mlx_model.forward(p, state, np.array([5]))
        mx.eval(logits)
        per_layer = 5 - attend_project.chains_qkv(1, 3, p.layers[0].attn.wo) - attend_project.chains_router(
            1, 3, p.layers[0].attn.wo)  # the QKV GEMV, then the router, chained into the attention's launch
        assert sum(LAUNCHES.values()) - launches == per_layer * cfg.n_layers + 2
        assert sum(HOST_INPUTS.values()) == host, dict(HOST_INPUTS)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_decode_launches_per_layer_within_budget():
    """SPEC target: at most 6 kernel launches per decoded layer (all-resident, GPU routing), and
    2 per token beside them (the embedding, the normed head). Counted from the lazy graph of one
    token: the difference between a 4-layer and a 2-layer model is 2 layers' worth."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from _measure import graph_launches

    counts = {}
    with using_path(KernelPath.GPU):
        for n in (2, 4):
            cfg = replace(SEED_SHAPE, n_layers=n, n_experts=32, vocab_size=512)
            p = random_params(cfg, seed=0, pred_q8=False)
            state = mlx_model.MlxModelState.empty(cfg)
            prompt_logits, state = mlx_model.forward(p, state, np.array([1, 2]))
            mx.eval(prompt_logits)  # the decoded token's graph alone is counted
            logits, _ = mlx_model.forward(p, state, np.array([5]), eval_every=0)  # the whole graph, lazy
            before = sum(LAUNCHES.values())
            counts[n] = sum(graph_launches(logits).values())
            mx.eval(logits)
            assert sum(LAUNCHES.values()) == before
    per_layer = (counts[4] - counts[2]) / 2
    assert per_layer <= 6, f"{per_layer} launches per layer ({counts})"
    assert counts[2] - 2 * per_layer <= 2, f"{counts[2] - 2 * per_layer} launches per token beside the layers"
