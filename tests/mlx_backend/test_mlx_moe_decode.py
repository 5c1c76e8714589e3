"""The decoded token's routed experts in two launches (kernels/moe_decode.py: gate/up, then down
with the residual) against the reference: the routing (experts exactly, weights to reordering),
the residual sum (FAST), both code forms, the other block shapes bit for bit, the model's decode
through them (FORWARD against the fused kernel's forward, the same 6 launches a layer) and the
engine's choice (`decode_experts.applies`). Emulated (medium sizes: several words a lane, several
blocks an expert) and on the GPU (the seed shape's expert; marked `gpu`)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.formats.expert_record import RecordLayout, unpack_record
from strata.formats.quant_types import QuantType
from strata.mlx_backend import decode_experts
from strata.mlx_backend import model as mlx_model
from strata.mlx_backend.kernels import attend_project, decode_routing, moe_decode, moe_down_warps
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, using_path
from strata.mlx_backend.routing import route_batch
from strata.model_config import RoutingOrder
from strata.mlx_backend.experts import SharedWeights
from strata.reference.experts import SWIGLU, routed_experts, shared_expert
from strata.reference.routing import RouterRule
from strata.testing.mlx_params import SEED_SHAPE, random_params, random_records
from tests.kernel_paths import KERNEL_PATHS

# the GPU runs the reference check and the shared expert: each other case's specialisations would
# cost NVRTC compiles (seconds each) and test the same body
EMULATED = KERNEL_PATHS[:1]


def _with_path(cases, *, gpu_too):
    """(path, *case) params: every case emulated, the cases gpu_too keeps on the GPU too (its marks kept)."""
    return [pytest.param(kp.values[0], *case, marks=kp.marks, id="-".join([kp.id] + [str(c) for c in case]))
            for kp in KERNEL_PATHS for case in cases if kp.id == "emulated" or gpu_too(case)]

SEED_EXPERT = (SEED_SHAPE.hidden_size, SEED_SHAPE.expert_ffn_size)  # 2560 x 576
MEDIUM_EXPERT = (1024, 96)  # 2 words a lane; 3 gate/up blocks an expert


def _case(path, seed: int, k: int, tokens: int, n: int = 24):
    d, f = SEED_EXPERT if path is KernelPath.GPU else MEDIUM_EXPERT
    rec = RecordLayout(QuantType.Q2_0, d, f)
    records = random_records(rec, 2 * n, mx.random.key(seed))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    x_mid = rng.standard_normal((tokens, d)).astype(np.float32)
    z = rng.standard_normal((tokens, n)).astype(np.float32)
    return rec, records, x, x_mid, z


def _want(records, rec, x, x_mid, z, rule: RouterRule, base: int):
    host = np.array(records)
    sels = route_batch(z, rule)
    out = np.stack([x_mid[t] + routed_experts([unpack_record(host[base + e], rec) for e in s.experts], s.weights, x[t])
                    for t, s in enumerate(sels)])
    return sels, out


@pytest.mark.parametrize("path,order,norm", _with_path(
    [(RoutingOrder.SOFTMAX_TOPK, True), (RoutingOrder.SOFTMAX_TOPK, False), (RoutingOrder.TOPK_SOFTMAX, False)],
    gpu_too=lambda case: case[1]))
def test_two_launches_against_the_reference(path, order, norm):
    with using_path(path):
        k, base = 6, 24
        rec, records, x, x_mid, z = _case(path, 3, k, tokens=2)
        z[1, 5] = z[1, 7]  # an exact tie: the lower id wins on both sides
        rule = RouterRule(k, order, norm)
        sels, want = _want(records, rec, x, x_mid, z, rule, base)
        hid, sel, wsel, *_ = moe_decode.gateup(records, rec, mx.array(x), mx.array(z), base, k, order, norm)
        np.testing.assert_array_equal(np.array(sel), np.stack([base + s.experts for s in sels]))
        assert_backends_agree(np.stack([s.weights for s in sels]), wsel, "ROUTING", what="weights")
        got = moe_decode.down(records, rec, mx.array(x_mid), hid, sel, wsel)
        assert_backends_agree(want, got, "FAST", what=f"{order.value} norm={norm}")


@pytest.mark.parametrize("path", EMULATED)
def test_every_ranking_form_ranks_as_the_loop_does(path):
    """The top k by argmax rounds and by warp sorts: the same slots, weights and activations, bit
    for bit, as the ranking loop: exact ties (the lower id first), -inf logits, a tie at the k-th
    place (24 logits: one warp's chunk, padded)."""
    with using_path(path):
        k = 5
        rec, records, x, _, z = _case(path, 11, k, tokens=3)
        z[0, [3, 9, 17]] = z[0].max() + 1.0  # a three-way tie for first place
        z[1, :] = -np.inf
        z[1, [4, 20, 2, 7, 11, 1]] = [0.5, 0.5, -1.0, 2.0, -1.0, -1.0]  # ties, and a tie across the k-th place
        z[2, 5] = -np.inf
        for order, norm in ((RoutingOrder.SOFTMAX_TOPK, True), (RoutingOrder.TOPK_SOFTMAX, False)):
            outs = [moe_decode.gateup(records, rec, mx.array(x), mx.array(z), 0, k, order, norm, rounds=rr)[:3]
                    for rr in decode_routing.ROUTING_FORMS]
            for other in outs[1:]:
                for a, b in zip(outs[0], other):
                    np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=order.value)
        ids = np.arange(z.shape[1])
        want = np.stack([np.lexsort((ids, -row))[:k] for row in z])  # z descending, ties to the lower id
        np.testing.assert_array_equal(np.array(outs[1][1]), want)


@pytest.mark.parametrize("path", EMULATED)
def test_warp_sorts_rank_many_chunks(path):
    """Ranking.BITONIC over more chunks of 32 logits than the block has warps (300 logits: 10
    chunks, the last one part-filled, 8 warps), ties across chunks and at the k-th place: the
    loop's slots, weights and activations bit for bit, and the reference's order."""
    with using_path(path):
        k, n = 10, 300
        rec, records, x, _, z = _case(path, 13, k, tokens=2, n=n // 2)
        z = np.random.default_rng(13).standard_normal((2, n)).astype(np.float32)
        z[0, [40, 290, 7]] = z[0].max() + 0.5  # one value in three chunks
        top = np.sort(z[1])[::-1]
        z[1, [299, 64, 33]] = top[k - 1]  # a tie across the k-th place, in three chunks
        order, norm = RoutingOrder.SOFTMAX_TOPK, True
        outs = [moe_decode.gateup(records, rec, mx.array(x), mx.array(z), 0, k, order, norm, rounds=rr)[:3]
                for rr in (decode_routing.Ranking.LOOP, decode_routing.Ranking.BITONIC)]
        for a, b in zip(*outs):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        ids = np.arange(n)
        want = np.stack([np.lexsort((ids, -row))[:k] for row in z])
        np.testing.assert_array_equal(np.array(outs[1][1]), want)


def _in_rows(arena, rec, x_mid, h, z, slot_base, k, order, norm, *, shared=None, rw=1, **kw):
    """routed_residual with moe_decode's DOWN step (a warp per output row, every expert's h staged
    in each block): its form where moe_down_warps does not apply (k past MAX_K, other units a warp)."""
    g = moe_decode.gateup(arena, rec, h, z, slot_base, k, order, norm, shared=shared, **kw)
    has, gated = shared is not None, shared is not None and shared[3] is not None
    return moe_decode.down(arena, rec, x_mid, g.hid, g.sel, g.wsel, g.sout if has else None,
                           g.sgate if gated else None, threads=kw.get("threads", moe_decode.THREADS), rw=rw,
                           denormals=kw.get("denormals"))


@pytest.mark.parametrize("path", EMULATED)
def test_block_shapes_and_code_forms(path):
    """Other units a warp and threads a block (gate/up), rows a warp (down) and the ranking forms
    compute the same sums: bit for bit, through each down step; the exponent
    code form (Metal's) agrees with the reference."""
    with using_path(path):
        k = 4
        rec, records, x, x_mid, z = _case(path, 5, k, tokens=3)
        rule = RouterRule(k, RoutingOrder.SOFTMAX_TOPK, True)
        _, want = _want(records, rec, x, x_mid, z, rule, 0)
        args = (records, rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k, rule.order, True)
        base = np.array(_in_rows(*args))
        assert_backends_agree(want, base, "FAST", what="default shape")
        for kw in ({"upw": 4}, {"upw": 2}, {"upw": 1}, {"rw": 2}, {"upw": 2, "rw": 4}):
            np.testing.assert_array_equal(np.array(_in_rows(*args, **kw)), base, err_msg=str(kw))
        warps = np.array(moe_decode.routed_residual(*args))  # moe_down_warps' sums: their own order
        assert_backends_agree(want, warps, "FAST", what="down warps")
        for kw in ({"upw": 4}, {"upw": 2}, {"rounds": decode_routing.Ranking.LOOP}, {"threads": 128, "upw": 4}):
            np.testing.assert_array_equal(np.array(moe_decode.routed_residual(*args, **kw)), warps, err_msg=str(kw))
        exp_form = moe_decode.routed_residual(*args, denormals=False)
        assert_backends_agree(want, exp_form, "FAST", what="exponent code form")


def test_applies_only_where_it_computes_the_layer():
    rec = RecordLayout(QuantType.Q2_0, *MEDIUM_EXPERT)
    rule = RouterRule(4, RoutingOrder.SOFTMAX_TOPK, True)
    with using_path(KernelPath.EMULATED):
        assert decode_experts.applies(rec, rule, None, SWIGLU, 1)
        f16 = mx.zeros((32, 1024), mx.float16)
        shared16 = SharedWeights(f16, f16, mx.zeros((1024, 32), mx.float16), None)
        assert decode_experts.applies(rec, rule, shared16, SWIGLU, 1)  # the shared expert's blocks ride along
        shared32 = SharedWeights(f16.astype(mx.float32), f16, shared16.down, None)
        assert not decode_experts.applies(rec, rule, shared32, SWIGLU, 1)  # float32 weights: the ops shared expert
        assert not decode_experts.applies(rec, rule, None, SWIGLU, decode_experts.MAX_TOKENS + 1)
        assert not decode_experts.applies(rec, RouterRule(4, RoutingOrder.SIGMOID_TOPK, True), None, SWIGLU, 1)
        assert not moe_decode.applies(rec, 4, upw=8)  # 64 hidden units a block do not divide F = 96
        assert not decode_experts.applies(RecordLayout(QuantType.Q2_0, 1024, 96 * 8), RouterRule(10, rule.order, True),
                                          None, SWIGLU, 1)  # 480 (expert, word) pairs > MAX_PAIRS
    with using_path(KernelPath.OPS):
        assert not decode_experts.applies(rec, rule, None, SWIGLU, 1)


@pytest.mark.parametrize("path,gated", _with_path([(True,), (False,)], gpu_too=lambda case: case[0]))
def test_shared_expert_rides_along(path, gated):
    """The shared expert's blocks in the gate/up launch, its partials and gate added by the down launch."""
    with using_path(path):
        k = 4
        rec, records, x, x_mid, z = _case(path, 9, k, tokens=2)
        d, fs = rec.hidden, 64
        rng = np.random.default_rng(10)
        f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731  float16-exact weights
        gate, up = (f16(rng.standard_normal((fs, d)) / np.sqrt(d)) for _ in range(2))
        down = f16(rng.standard_normal((d, fs)) / np.sqrt(fs))
        gi = f16(rng.standard_normal(d) / np.sqrt(d)) if gated else None
        rule = RouterRule(k, RoutingOrder.SOFTMAX_TOPK, True)
        _, want = _want(records, rec, x, x_mid, z, rule, 0)
        want = want + shared_expert(gate, up, down, gi, x)
        h16 = lambda a: None if a is None else mx.array(a).astype(mx.float16)  # noqa: E731
        for warps in (False, True):  # moe_decode's DOWN, moe_down_warps'
            got = (moe_decode.routed_residual if warps else _in_rows)(
                records, rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k, rule.order, True,
                shared=(h16(gate), h16(up), h16(down), h16(gi)))
            assert_backends_agree(want, got, "FAST", what=f"with the shared expert, gated={gated}, warps={warps}")


NO_SHARED = replace(SEED_SHAPE, n_layers=2, hidden_size=256, n_experts=16, n_experts_per_token=4, expert_ffn_size=64,
                    shared_ffn_size=0, shared_expert_gated=False, n_heads=4, n_kv_heads=2, head_dim=64,
                    vocab_size=512, max_context=64)


@pytest.mark.parametrize("path", EMULATED)  # on the GPU: test_mlx_kernels' decode tests take the same launches
def test_decode_through_the_two_launches(path, monkeypatch):
    """A decoded token of a model without a shared expert takes the two launches (5 a layer: QKV,
    attention with its projection, router, gate/up, down; fewer where chained) and its logits agree
    with the fused kernel's."""
    with using_path(path):
        p = random_params(NO_SHARED, seed=4, pred_q8=False)
        _, state = mlx_model.forward(p, mlx_model.MlxModelState.empty(NO_SHARED), np.array([7, 3]))
        mx.eval(state.layers[0].keys)
        downs = lambda: LAUNCHES["strata_moe_down"] + LAUNCHES["strata_moe_down_warps"]  # noqa: E731
        before, down0 = sum(LAUNCHES.values()), downs()
        two, _ = mlx_model.forward(p, state.trim(2), np.array([5]))
        mx.eval(two)
        wo = p.layers[0].attn.wo  # the QKV GEMV, then the router, chained into the attention's launch
        per_layer = 5 - attend_project.chains_qkv(1, 3, wo) - attend_project.chains_router(1, 3, wo)
        assert sum(LAUNCHES.values()) - before == per_layer * NO_SHARED.n_layers + 2
        assert downs() - down0 == NO_SHARED.n_layers
        monkeypatch.setattr(decode_experts, "applies", lambda *a: False)  # the fused expert kernel + combine
        fused, _ = mlx_model.forward(p, state.trim(2), np.array([5]))
        assert_backends_agree(fused, two, "FORWARD", what="decoded logits")


@pytest.mark.parametrize("dialect", ["metal", "cuda"])
def test_sources_compile(tmp_path, dialect, monkeypatch):
    """Both launches in both code forms, with and without the shared expert's blocks, as full Metal
    and CUDA sources (Metal: compile-checked, not run)."""
    from test_metal_compile import _check

    from strata.mlx_backend.kernels.launch import recording
    from strata.mlx_backend.kernels.preludes import Dialect

    k = 4
    with using_path(KernelPath.EMULATED), recording() as rec:
        records_rec, records, x, x_mid, z = _case(KernelPath.EMULATED, 7, k, tokens=1)
        d = records_rec.hidden
        shared = (mx.zeros((32, d), mx.float16), mx.zeros((32, d), mx.float16), mx.zeros((d, 32), mx.float16),
                  mx.zeros((d,), mx.float16))
        for dn, sh in ((True, None), (False, None), (True, shared), (False, shared)):
            mx.eval(_in_rows(records, records_rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k,
                             RoutingOrder.SOFTMAX_TOPK, True, denormals=dn, shared=sh))
        mx.eval(moe_decode.routed_residual(records, records_rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k,
                                           RoutingOrder.SOFTMAX_TOPK, True, rounds=decode_routing.Ranking.ROUNDS))
        mx.eval(moe_decode.routed_residual(records, records_rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k,
                                           RoutingOrder.SOFTMAX_TOPK, True, rounds=decode_routing.Ranking.BITONIC))
        for dn, sh in ((True, None), (False, shared)):
            mx.eval(moe_decode.routed_residual(records, records_rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k,
                                               RoutingOrder.SOFTMAX_TOPK, True, denormals=dn, shared=sh))
    assert {s[0].name for s in rec} == {"strata_moe_gateup", "strata_moe_down", "strata_moe_down_warps"}
    assert len(rec) >= 10  # the forms above, less those the defaults already ran
    errors = [e for e in (_check(tmp_path, Dialect(dialect), s) for s in rec) if e]
    assert not errors, "\n\n".join(errors)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_down_warps_against_the_reference(path):
    """moe_down_warps' down step (a warp per expert, h as gate/up pre-scaled it) after the warp
    sorts' ranking against the reference: the experts exactly, the sum FAST, in both code forms
    and other rows a block (emulated); the gate/up launch's word sums equal to h's (the shared
    expert: test_shared_expert_rides_along). On the GPU: the seed shape's expert, k = 10."""
    with using_path(path):
        k = 10 if path is KernelPath.GPU else 4
        rec, records, x, x_mid, z = _case(path, 17, k, tokens=2)
        rule = RouterRule(k, RoutingOrder.SOFTMAX_TOPK, True)
        sels, want = _want(records, rec, x, x_mid, z, rule, 0)
        args = (records, rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k, rule.order, True)
        bitonic = decode_routing.Ranking.BITONIC
        for dn in ((True,) if path is KernelPath.GPU else (True, False)):
            got = moe_decode.routed_residual(*args, denormals=dn, rounds=bitonic)
            assert_backends_agree(want, got, "FAST", what=f"down warps, denormals={dn}")
        g = moe_decode.gateup(records, rec, mx.array(x), mx.array(z), 0, k, rule.order, True, rounds=bitonic)
        np.testing.assert_array_equal(np.array(g.sel), np.stack([s.experts for s in sels]))
        if path is KernelPath.GPU:
            return
        hid = np.array(g.hid)
        sums = np.zeros(g.hws.shape, np.float32)
        for j in range(16):  # in order, as the kernel adds them
            sums += hid[..., j::16]
        np.testing.assert_array_equal(np.array(g.hws), sums)
        for rows in (4, 16, 32):
            got = moe_down_warps.down(records, rec, mx.array(x_mid), g.hpre, g.hws, g.sel, g.wsel, rows=rows)
            assert_backends_agree(want, got, "FAST", what=f"{rows} rows a block")


