"""The routed experts' two launches as one (moe_decode.CHAIN_EXPERTS: the gate/up launch's blocks,
then kernels/moe_down_chained.py's down blocks, phases.chain_all): bit for bit the two launches'
output on the emulator at the seed expert shape and small ones, with and without the shared expert
(gated and not), in each code, ranking and load form, warps taking one expert or several; the
down phase's wait after its own ranking and code loads, before its first read of h; the counters
zero again, a site a layer; the decoded step's launches a layer 3 -> 2 with the same logits; the
chained sources compiled for CUDA. On the GPU (marked `gpu`): the seed expert shape bit for bit,
and the compiled step with the chain against the uncompiled forward without it."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.formats.expert_record import RecordLayout, unpack_record
from strata.formats.quant_types import QuantType
from strata.mlx_backend import model as mlx_model
from strata.mlx_backend.compiled import CompiledDecode
from strata.mlx_backend.kernels import decode_routing, emulate, moe_decode, moe_down_chained, phases
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, gpu_dialect, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.routing import route_batch
from strata.model_config import RoutingOrder
from strata.reference.experts import routed_experts, shared_expert
from strata.reference.routing import RouterRule
from strata.testing.mlx_params import SEED_SHAPE, random_params, random_records

emulated = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the emulator")
gpu = [pytest.mark.gpu, pytest.mark.skipif(gpu_dialect() is not Dialect.CUDA, reason="no MLX CUDA GPU here")]

CHAINED = "strata_chain_moe_gateup_moe_down_chained"
APART = ("strata_moe_gateup", "strata_moe_down_warps")
SEED_EXPERT = (SEED_SHAPE.hidden_size, SEED_SHAPE.expert_ffn_size, SEED_SHAPE.n_experts_per_token)  # 2560 x 576, k 10
SMALL_EXPERT = (1024, 96, 4)  # 2 words a lane; 3 gate/up blocks an expert; 8 warps, 4 experts


def _case(d: int, f: int, n: int, seed: int, *, shared: str | None = None):
    """Records of n experts (d x f), x, x_mid, z [1, n] with an exact tie, and the shared
    expert's float16 weights (None, "ungated" or "gated") as routed_residual and the reference take them."""
    rec = RecordLayout(QuantType.Q2_0, d, f)
    records = random_records(rec, n, mx.random.key(seed))
    rng = np.random.default_rng(seed)
    x, x_mid = (rng.standard_normal((1, d)).astype(np.float32) for _ in range(2))
    z = rng.standard_normal((1, n)).astype(np.float32)
    z[0, 5] = z[0, 7]  # an exact tie: the lower id first, in both phases' rankings
    weights = None
    if shared is not None:
        fs = 64
        f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731  float16-exact weights
        gate, up = (f16(rng.standard_normal((fs, d)) / np.sqrt(d)) for _ in range(2))
        down = f16(rng.standard_normal((d, fs)) / np.sqrt(fs))
        gi = f16(rng.standard_normal(d) / np.sqrt(d)) if shared == "gated" else None
        weights = (gate, up, down, gi)
    return rec, records, x, x_mid, z, weights


def _as_f16(weights):
    return None if weights is None else tuple(None if a is None else mx.array(a).astype(mx.float16) for a in weights)


def _apart_and_chained(monkeypatch, args, **kw):
    """routed_residual(*args, **kw) with CHAIN_EXPERTS off, then on -> (both outputs, the
    launches each made by kernel name)."""
    outs, made = [], []
    for on in (False, True):
        monkeypatch.setattr(moe_decode, "CHAIN_EXPERTS", on)
        before = LAUNCHES.copy()
        outs.append(np.array(moe_decode.routed_residual(*args, **kw)))
        made.append(LAUNCHES - before)
    return outs, made


def _assert_same_bits(apart, chained, made, what: str):
    assert made[0] == Counter({n: 1 for n in APART}), f"{what}: {made[0]}"
    assert made[1] == Counter({CHAINED: 1}), f"{what}: {made[1]}"
    assert np.isfinite(chained).all(), what
    assert apart.tobytes() == chained.tobytes(), f"{what}: max |diff| {np.abs(apart - chained).max()}"


@emulated
@pytest.mark.parametrize("shape,n,shared", [(SEED_EXPERT, 64, None), (SEED_EXPERT, 64, "gated"),
                                            (SMALL_EXPERT, 24, None), (SMALL_EXPERT, 24, "ungated"),
                                            (SMALL_EXPERT, 24, "gated")],
                         ids=["seed", "seed-gated-shared", "small", "small-shared", "small-gated-shared"])
def test_chain_equals_the_two_launches_bit_for_bit(monkeypatch, shape, n, shared):
    """The seed expert (D 2560, F 576, k 10: warps 0 and 1 of the down phase take two experts) and
    a small one (k 4 over 8 warps), the shared expert's blocks riding in the gate/up phase: the same
    bits as the two launches, and the reference's sum (FAST)."""
    (d, f, k), base = shape, 0
    rec, records, x, x_mid, z, weights = _case(d, f, n, 3, shared=shared)
    rule = RouterRule(k, RoutingOrder.SOFTMAX_TOPK, True)
    with using_path(KernelPath.EMULATED):
        args = (records, rec, mx.array(x_mid), mx.array(x), mx.array(z), base, k, rule.order, True)
        (apart, chained), made = _apart_and_chained(monkeypatch, args, shared=_as_f16(weights))
    _assert_same_bits(apart, chained, made, f"{shape} shared={shared}")
    host = np.array(records)
    sel = route_batch(z, rule)[0]
    want = x_mid[0] + routed_experts([unpack_record(host[base + e], rec) for e in sel.experts], sel.weights, x[0])
    if weights is not None:
        want = want + shared_expert(*weights, x)[0]
    assert_backends_agree(want[None], chained, "FAST", what=f"chained, {shape} shared={shared}")


@emulated
@pytest.mark.parametrize("kw", [
    {"denormals": False},  # the exponent code form (hpre scaled for it)
    {"down_vector_loads": True},  # a Q2_0 block's two words in one 8-byte load
    {"down_rows": 16},  # 16 rows a down block (2 lanes a row)
    {"weights_early": True},
    {"rounds": decode_routing.Ranking.LOOP},  # both phases rank by the count loop
    {"rounds": decode_routing.Ranking.ROUNDS},
    {"threads": 128, "upw": 4},  # 4 warps a block: the down phase's warps take experts w, w + 4
], ids=lambda kw: "-".join(f"{k}={getattr(v, 'name', v)}" for k, v in kw.items()))
def test_every_form_chains_bit_for_bit(monkeypatch, kw):
    """Each of routed_residual's forms that the chain takes, at k 6 (more experts than the
    128-thread form's warps), with the shared expert (gated): the two launches' bits."""
    k = 6
    rec, records, x, x_mid, z, weights = _case(1024, 96, 24, 7, shared="gated")
    with using_path(KernelPath.EMULATED), recording() as seen:
        args = (records, rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k, RoutingOrder.SOFTMAX_TOPK, True)
        (apart, chained), made = _apart_and_chained(monkeypatch, args, shared=_as_f16(weights), **kw)
    _assert_same_bits(apart, chained, made, str(kw))
    tpl = dict(next(t for s, _, _, t in seen if s.name == CHAINED))
    assert tpl["B_NT"] == tpl["A_NT"] == kw.get("threads", moe_decode.GATEUP_THREADS)


@emulated
def test_warp_sorts_over_many_chunks_chain_bit_for_bit(monkeypatch):
    """300 logits (10 chunks of 32 for 8 warps, the last part-filled), k 10, ties across chunks
    and at the k-th place: each down block's own ranking finds the gate/up blocks' slots."""
    k, n = 10, 300
    rec, records, x, x_mid, _, _ = _case(256, 64, n, 13)
    z = np.random.default_rng(13).standard_normal((1, n)).astype(np.float32)
    top = np.sort(z[0])[::-1]
    z[0, [299, 64, 33]] = top[k - 1]  # a tie across the k-th place, in three chunks
    with using_path(KernelPath.EMULATED):
        args = (records, rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k, RoutingOrder.TOPK_SOFTMAX, False)
        (apart, chained), made = _apart_and_chained(monkeypatch, args, rounds=decode_routing.Ranking.BITONIC)
    _assert_same_bits(apart, chained, made, "300 logits")


@emulated
def test_counters_are_zero_after_the_launch_and_a_layer_each(monkeypatch):
    """Two layers' slot bases in one arena: their chains count on counters of their own, and
    leave them zero (the next token's launch of the same layer finds them so)."""
    k = 4
    rec, records, x, x_mid, z, _ = _case(1024, 96, 48, 5)
    monkeypatch.setattr(moe_decode, "CHAIN_EXPERTS", True)
    with using_path(KernelPath.EMULATED):
        outs = {}
        for base in (0, 24, 0):
            outs.setdefault(base, []).append(np.array(moe_decode.routed_residual(
                records, rec, mx.array(x_mid), mx.array(x), mx.array(z[:, :24]), base, k, RoutingOrder.SOFTMAX_TOPK,
                True)))
        layer0, layer1 = (phases.counters(records, f"experts@{b}") for b in (0, 24))
    assert layer0 is not layer1
    assert not np.array(layer0).any() and not np.array(layer1).any()
    assert outs[0][0].tobytes() == outs[0][1].tobytes()
    assert outs[0][0].tobytes() != outs[24][0].tobytes()  # the other layer's experts


@emulated
def test_the_down_phase_waits_after_its_loads_and_before_h(monkeypatch):
    """In the chained source, the down phase ranks z and issues its code and scale loads before its
    wait for the gate/up phase's count, and reads nothing that phase
    writes (h, the weights, the shared partials and gate) before it."""
    rec, records, x, x_mid, z, weights = _case(1024, 96, 24, 9, shared="gated")
    monkeypatch.setattr(moe_decode, "CHAIN_EXPERTS", True)
    with using_path(KernelPath.EMULATED), recording() as seen:
        mx.eval(moe_decode.routed_residual(records, rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, 4,
                                           RoutingOrder.SOFTMAX_TOPK, True, shared=_as_f16(weights)))
    src = next(s for s, *_ in seen if s.name == CHAINED)
    down = src.body[src.body.index("chain_vb - (uint32_t)CHAIN_S1"):]  # the down phase's branch
    wait = down.index("wait_count(")
    assert down.count("wait_count(") == 1
    for before in ("zs[e] = z[", "top[r] = qi", "qrow[wc]", "srow[wc >> 1]"):
        assert down.rindex(before) < wait, before
    for after in ("sout[", "load_f4(hp", "hs[w]", "wsel[", "gate_val["):
        assert down.index(after) > wait, after
    assert moe_down_chained.BODY[moe_down_chained.WAIT_AT:].lstrip().startswith("UNROLL for (int ie = 0")


@emulated
def test_the_chain_applies_at_one_token_on_a_chaining_path(monkeypatch):
    """CHAIN_EXPERTS off, two tokens, the DOWN step, the OPS path: the two launches (or none); on,
    at one token: the chain."""
    rec = RecordLayout(QuantType.Q2_0, 1024, 96)
    with using_path(KernelPath.EMULATED):
        monkeypatch.setattr(moe_decode, "CHAIN_EXPERTS", False)
        assert not moe_decode.chains_experts(rec, 4, 1)
        monkeypatch.setattr(moe_decode, "CHAIN_EXPERTS", True)
        assert moe_decode.chains_experts(rec, 4, 1)
        assert moe_decode.chains_experts(rec, 10, 1, threads=128, upw=4)
        assert not moe_decode.chains_experts(rec, 4, 2)
        assert not moe_decode.chains_experts(rec, 4, 1, warps=False)  # moe_decode's DOWN: not chained
        assert not moe_decode.chains_experts(rec, 4, 1, rows=3)  # moe_down_warps does not take 3 rows a block
        rec2, records, x, x_mid, z, _ = _case(1024, 96, 24, 11)
        two = np.concatenate([x, x]), np.concatenate([x_mid, x_mid]), np.concatenate([z, z])
        before = LAUNCHES.copy()
        mx.eval(moe_decode.routed_residual(records, rec2, mx.array(two[1]), mx.array(two[0]), mx.array(two[2]), 0, 4,
                                           RoutingOrder.SOFTMAX_TOPK, True))
        assert LAUNCHES - before == Counter({n: 1 for n in APART})
    with using_path(KernelPath.OPS):
        assert not moe_decode.chains_experts(rec, 4, 1)


NO_SHARED = replace(SEED_SHAPE, n_layers=2, hidden_size=256, n_experts=16, n_experts_per_token=4, expert_ffn_size=64,
                    shared_ffn_size=0, shared_expert_gated=False, n_heads=4, n_kv_heads=2, head_dim=64,
                    vocab_size=512, max_context=64)
WITH_SHARED = replace(NO_SHARED, shared_ffn_size=64, shared_expert_gated=True)
PROMPT = np.array([7, 3, 11])


def _decode(p, chained: bool, monkeypatch, *, traced: bool = False, steps: int = 2):
    """The prompt's forward, then `steps` greedy tokens through CompiledDecode (untraced on the
    emulator) with CHAIN_EXPERTS `chained` -> (logits [steps + 1, V], layer 0's keys, each step's
    launches by kernel name: a traced step's are its trace's, every token's)."""
    monkeypatch.setattr(moe_decode, "CHAIN_EXPERTS", chained)
    logits, state = mlx_model.forward(p, mlx_model.MlxModelState.empty(p.cfg), PROMPT)
    out, made = [np.array(logits[-1])], []
    step = CompiledDecode(p, state, traced=traced)
    for _ in range(steps):
        before = LAUNCHES.copy()
        logits, state = step(state, int(np.argmax(out[-1])))
        out.append(np.array(logits[-1]))
        made.append(LAUNCHES - before)
    return np.stack(out), np.array(state.layers[0].keys), made


@emulated
@pytest.mark.parametrize("cfg", [NO_SHARED, WITH_SHARED], ids=["no-shared", "gated-shared"])
def test_the_decode_step_takes_one_launch_fewer_a_layer(monkeypatch, cfg):
    """The decode step (CompiledDecode, untraced here) with the chain: a layer's experts one launch
    instead of two (3 launches a layer -> 2 with the attention's chain), the same logits and cache
    bit for bit."""
    with using_path(KernelPath.EMULATED):
        p = random_params(cfg, seed=4, pred_q8=False)
        apart_logits, apart_keys, apart_made = _decode(p, False, monkeypatch)
        chain_logits, chain_keys, chain_made = _decode(p, True, monkeypatch)
    layers = cfg.n_layers
    for apart, chained in zip(apart_made, chain_made):
        assert all(apart[n] == layers for n in APART) and apart[CHAINED] == 0
        assert chained[CHAINED] == layers and not any(chained[n] for n in APART)
        assert sum(chained.values()) == sum(apart.values()) - layers
    assert apart_logits.tobytes() == chain_logits.tobytes()
    assert apart_keys.tobytes() == chain_keys.tobytes()


@emulated
def test_the_chained_cuda_sources_compile(tmp_path, monkeypatch):
    """The chained kernel in its forms (code forms, vector loads, the shared expert),
    as MLX's CUDA build compiles it (g++ against the CUDA stub header, as every kernel's check)."""
    from test_metal_compile import _check

    monkeypatch.setattr(moe_decode, "CHAIN_EXPERTS", True)
    rec, records, x, x_mid, z, weights = _case(1024, 96, 24, 15, shared="gated")
    args = (records, rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, 4, RoutingOrder.SOFTMAX_TOPK, True)
    with using_path(KernelPath.EMULATED), recording() as seen:
        for kw in ({}, {"denormals": False, "down_vector_loads": True}, {"shared": _as_f16(weights)}):
            mx.eval(moe_decode.routed_residual(*args, **kw))
    chained = [s for s in seen if s[0].name == CHAINED]
    assert len(chained) == 3 and not chained[0][0].metal
    errors = [e for e in (_check(tmp_path, Dialect.CUDA, s) for s in chained) if e]
    assert not errors, "\n\n".join(errors)


# ---------------------------------------------------------------- GPU


@pytest.mark.parametrize("shared", [None, "gated"])
@pytest.mark.parametrize("path", [pytest.param(KernelPath.GPU, id="gpu", marks=gpu)])
def test_chain_equals_the_two_launches_on_the_gpu(monkeypatch, path, shared):
    """The seed expert shape (D 2560, F 576, k 10 of 256): the chain's bits are the two launches'."""
    d, f, k = SEED_EXPERT
    rec, records, x, x_mid, z, weights = _case(d, f, 256, 17, shared=shared)
    with using_path(path):
        args = (records, rec, mx.array(x_mid), mx.array(x), mx.array(z), 0, k, RoutingOrder.SOFTMAX_TOPK, True)
        for _ in range(2):  # the second launch of each finds the counters zero again
            (apart, chained), made = _apart_and_chained(monkeypatch, args, shared=_as_f16(weights))
            _assert_same_bits(apart, chained, made, f"GPU, shared={shared}")


@pytest.mark.parametrize("cfg", [pytest.param(NO_SHARED, id="no-shared", marks=gpu),
                                 pytest.param(WITH_SHARED, id="gated-shared", marks=gpu)])
def test_chained_decode_bit_for_bit_on_the_gpu(monkeypatch, cfg):
    """The compiled (traced) step with the chain against the uncompiled one without it, on the GPU:
    the same logits and cache, one launch a layer fewer in the trace."""
    with using_path(KernelPath.GPU):
        p = random_params(cfg, seed=23, pred_q8=False)
        apart_logits, apart_keys, _ = _decode(p, False, monkeypatch, steps=3)
        chain_logits, chain_keys, chain_made = _decode(p, True, monkeypatch, traced=True, steps=3)
    assert chain_made[0][CHAINED] == cfg.n_layers  # the trace; the replays launch nothing from Python
    assert apart_logits.tobytes() == chain_logits.tobytes()
    assert apart_keys.tobytes() == chain_keys.tobytes()
