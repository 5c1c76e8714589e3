"""Two dependent launches as one (kernels/phases.py): the consumer's blocks read the producer's
whole output in the same launch, the counters are zero again after it, and the chained QKV +
attention launch decodes bit for bit what the two launches did (emulator; the GPU test below)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from strata.mlx_backend.kernels import attend_project, emulate, phases
from strata.mlx_backend.kernels import router as router_kernel
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, gpu_dialect, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.source import KernelSource

pytestmark = pytest.mark.skipif(not emulate.available(), reason="no C++ compiler for the emulator")

NT = 64
# producer: block b writes y[b NT + tid] = 2 (b NT + tid) + 1
PRODUCER = KernelSource("strata_test_fill", ("x",), ("y",), r"""
  const uint32_t i = bx * NT + tid;
  y[i] = 2.0f * (float)i + x[0];
""")
# consumer: every block sums all of y (written by every producer block) into out[bx]
CONSUMER = KernelSource("strata_test_sum_all", ("y", "scale"), ("out",), r"""
  SHARED float part[NT];
  float s = 0.0f;
  for (uint32_t i = tid; i < (uint32_t)N; i += NT) s += y[i];
  part[tid] = s;
  BARRIER();
  if (tid == 0) {
    float tot = 0.0f;
    for (int k = 0; k < NT; ++k) tot += part[k];
    out[bx] = tot * scale[0];
  }
""")


def _specs(na: int, nb: int, x: mx.array, scale: mx.array):
    n = na * NT
    prod = phases.LaunchSpec(PRODUCER, (x,), ((n,),), (mx.float32,), (na, 1, 1), NT, (("NT", NT),))
    cons = phases.LaunchSpec(CONSUMER, (phases.Pending((n,), mx.float32), scale), ((nb,),), (mx.float32,), (nb, 1, 1),
                             NT, (("NT", NT), ("N", n)))
    return prod, cons


def test_a_consumer_block_reads_every_producer_block_and_the_counters_reset():
    na, nb = 7, 5
    x = mx.array(np.full(8, 1.0, np.float32))
    scale = mx.array(np.full(8, 0.5, np.float32))
    key = mx.zeros(3)
    want = 0.5 * sum(2.0 * i + 1.0 for i in range(na * NT))
    with using_path(KernelPath.EMULATED):
        for _ in range(2):  # the second launch finds its counters zero again
            y, out = phases.chain(*_specs(na, nb, x, scale), {"y": 0}, key=key)
            np.testing.assert_array_equal(np.array(y), 2.0 * np.arange(na * NT, dtype=np.float32) + 1.0)
            np.testing.assert_allclose(np.array(out), np.full(nb, want, np.float32), rtol=1e-6)
            assert not np.array(phases.counters(key)).any()
    assert phases.counters(key) is phases.counters(key)
    assert phases.counters(mx.zeros(3)) is not phases.counters(key)


def test_an_unmet_wait_is_an_error_on_the_emulator():
    """Counters left non-zero (a chain's reset broken) hand out tickets from 2: one producer block
    runs, and the consumers' wait for 3 fails loudly instead of reading an unwritten output."""
    x = mx.array(np.ones(8, np.float32))
    scale = mx.array(np.ones(8, np.float32))
    prod, cons = _specs(3, 2, x, scale)
    src = phases.chain_source(prod.src, cons.src, (("y", "y"),), prod.template, cons.template)
    stale = mx.array(np.array([2, 0, 0, 0, 0, 0, 0, 0], np.uint32))
    template = (tuple(("A_" + k, v) for k, v in prod.template) + tuple(("B_" + k, v) for k, v in cons.template)
                + (("CHAIN_S1", 3), ("CHAIN_NTOT", 5)))
    with using_path(KernelPath.EMULATED), pytest.raises(RuntimeError, match="waited for blocks that had not run"):
        # tickets 2..6: block 2 of the producer, then consumers 0..3 (out holds 4)
        phases.launch(src, [stale, x, scale], [(3 * NT,), (4,)], [mx.float32, mx.float32], blocks=(5, 1, 1),
                      threads=NT, template=template)


def test_chain_refuses_what_it_cannot_run():
    x = mx.array(np.ones(8, np.float32))
    scale = mx.array(np.ones(8, np.float32))
    prod, cons = _specs(2, 2, x, scale)
    with using_path(KernelPath.EMULATED):
        with pytest.raises(ValueError, match="threads a block"):
            phases.chain(prod, replace(cons, threads=2 * NT), {"y": 0}, key=x)
        with pytest.raises(ValueError, match="must be a Pending"):
            phases.chain(prod, replace(cons, inputs=(x, scale)), {"y": 0}, key=x)
        returning = replace(PRODUCER, name="strata_test_returns", body=PRODUCER.body + "  return;\n")
        with pytest.raises(ValueError, match="returns"):
            phases.chain(replace(prod, src=returning), cons, {"y": 0}, key=x)
    with using_path(KernelPath.OPS), pytest.raises(RuntimeError, match="emulator or MLX's CUDA build"):
        phases.chain(prod, cons, {"y": 0}, key=x)


# a decoded token's chained launch: the QKV GEMV walked KV group by KV group
# (kernels/qkv_groups.py), the attention (its partials summed in the launch) and the router
CHAIN = "strata_chain_qkv_groups_attend_project_sum_router"


def _decode(p, chained: bool, compiled: bool = False):
    """test_mlx_compiled.greedy_steps with the chain (the default) or its launches apart (the QKV
    GEMV, the attention launch with its partials summed, the router) -> (its three arrays,
    launches of the chain). The router runs at the chain's 256 threads either way (its norm's
    partial sums are per thread: 128 threads would sum in another order)."""
    from test_mlx_compiled import greedy_steps

    before = LAUNCHES[CHAIN]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(router_kernel, "THREADS", attend_project.THREADS)
        if not chained:
            m.setattr(attend_project, "chains_qkv", lambda *a: False)
        out = greedy_steps(p, compiled=compiled)
    return (*out, LAUNCHES[CHAIN] - before)


def test_chained_decode_bit_for_bit_on_the_emulator():
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL

    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL, seed=21, pred_q8=False)
        *apart, n_apart = _decode(p, False)
        *chain, n_chained = _decode(p, True)
    assert n_apart == 0 and n_chained == 3 * SMALL.n_layers  # one a layer and decoded token (the prompt apart)
    for a, b in zip(apart, chain):
        assert a.tobytes() == b.tobytes()


def test_the_group_walk_decodes_gated_attention_bit_for_bit():
    """The hybrid's gated attention (the output gate's rows walked with their group's, partial
    rotary): the walk against no chain, on the emulator."""
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL_HYBRID

    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL_HYBRID, seed=22, pred_q8=False)
        *apart, _ = _decode(p, False)
        *chain, n_chained = _decode(p, True)
    assert n_chained == 3  # the one attention layer, three decoded tokens
    for a, b in zip(apart, chain):
        assert a.tobytes() == b.tobytes()


def test_the_group_walk_rows_cover_the_projection_once():
    """qkv_group_row over every group and row is a permutation of the projection's rows, each
    group's rows the ones its heads read (its query heads, its key and value heads, its gates)."""
    from strata.mlx_backend.kernels import qkv_groups

    for h, kvh, hd, gate in ((4, 2, 64, 0), (16, 4, 128, 0), (8, 2, 16, 1), (6, 3, 8, 1)):
        g = h // kvh
        rg = (g * (1 + gate) + 2) * hd

        def row(grp, j):  # the helper's rule, restated
            qr = g * hd
            if j < qr:
                return grp * qr + j
            if j < qr + hd:
                return h * hd + grp * hd + j - qr
            if j < qr + 2 * hd:
                return (h + kvh) * hd + grp * hd + j - qr - hd
            return (h + 2 * kvh) * hd + grp * qr + j - qr - 2 * hd

        rows = [row(grp, j) for grp in range(kvh) for j in range(rg)]
        assert sorted(rows) == list(range((h * (1 + gate) + 2 * kvh) * hd))
        for grp in range(kvh):
            mine = {row(grp, j) for j in range(rg)}
            heads = range(grp * g, grp * g + g)
            want = {q * hd + i for q in heads for i in range(hd)} | {(h + grp) * hd + i for i in range(hd)}
            want |= {(h + kvh + grp) * hd + i for i in range(hd)}
            want |= {(h + 2 * kvh + q) * hd + i for q in heads for i in range(hd) if gate}
            assert mine == want
    assert "if (j < qr) return g * qr + j;" in qkv_groups.HELPERS  # the rule restated above is the kernel's


def compile_key(src, inputs, dtypes, template) -> tuple:
    """A launch as test_metal_compile._check takes it: (source, input dtype names, output dtype
    names, template)."""
    return (src, tuple(str(np.dtype(str(a.dtype).split(".")[-1])) for a in inputs),
            tuple(str(d).split(".")[-1] for d in dtypes), tuple(template))


def zero_route_args(h: int, kvh: int, hd: int, d: int, s: int, e: int) -> tuple:
    """The arrays a chained route (attend_project.qkv_attend_route, attend_split.qkv_split_route)
    takes before its position, as zeros: h / kvh heads of hd, hidden d, s cached positions, e experts."""
    f16 = mx.float16
    return (mx.zeros(((h + 2 * kvh) * hd, d), f16), mx.zeros((1, d)), mx.zeros((d,), f16), None,
            mx.zeros((hd,), f16), mx.zeros((hd,), f16), mx.zeros((s, hd // 2)), mx.zeros((s, hd // 2)),
            mx.zeros((kvh, s, hd)), mx.zeros((kvh, s, hd)), mx.zeros((d, h * hd), f16), mx.zeros((d,), f16),
            mx.zeros((e, d)))


def capturing(seen: list):
    """A `launch` stand-in: each launch's `compile_key` into seen, zeros back (nothing runs)."""
    def record(src, inputs, shapes, dtypes, *, blocks, threads, template):
        seen.append(compile_key(src, inputs, dtypes, template))
        return [mx.zeros(s, d) for s, d in zip(shapes, dtypes)]
    return record


def test_the_chained_cuda_source_compiles(tmp_path):
    """The chained QKV + attention kernel as MLX's CUDA build would compile it (g++ against the
    CUDA stub header, as every other kernel's check)."""
    from test_metal_compile import _check

    seen = []
    record = capturing(seen)

    h, kvh, hd, d, s = 4, 2, 64, 256, 64
    f16 = mx.float16
    with using_path(KernelPath.EMULATED):
        saved = phases.launch
        phases.launch = record
        try:
            attend_project.qkv_attend_project(
                mx.zeros(((h + 2 * kvh) * hd, d), f16), mx.zeros((1, d)), mx.zeros((d,), f16), None,
                mx.zeros((hd,), f16), mx.zeros((hd,), f16), mx.zeros((s, hd // 2)), mx.zeros((s, hd // 2)),
                mx.zeros((kvh, s, hd)), mx.zeros((kvh, s, hd)), mx.zeros((d, h * hd), f16), 3, 1e-6, h)
        finally:
            phases.launch = saved
    assert len(seen) == 1
    assert _check(tmp_path, Dialect.CUDA, seen[0]) is None


def test_the_group_walk_chain_cuda_source_compiles(tmp_path, monkeypatch):
    """The chained launch with the QKV GEMV walked by KV groups, compiled as the one above."""
    from test_metal_compile import _check

    seen = []
    record = capturing(seen)

    h = 4
    with using_path(KernelPath.EMULATED):
        monkeypatch.setattr(phases, "launch", record)
        attend_project.qkv_attend_route(*zero_route_args(h, 2, 64, 256, 64, 16), 3, 1e-6, h)
    assert len(seen) == 1 and seen[0][0].name == CHAIN
    assert _check(tmp_path, Dialect.CUDA, seen[0]) is None


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is not Dialect.CUDA, reason="no MLX CUDA GPU here")
def test_chained_decode_bit_for_bit_on_the_gpu():
    """The compiled step with a chain against the uncompiled forward without it, on the GPU."""
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL

    with using_path(KernelPath.GPU):
        p = random_params(SMALL, seed=23, pred_q8=False)
        *apart, _ = _decode(p, False)
        *chain, n_chained = _decode(p, True, compiled=True)
    assert n_chained > 0
    for a, b in zip(apart, chain):
        assert a.tobytes() == b.tobytes()


def test_links_must_name_a_consumer_input_and_a_producer_output():
    x = mx.array(np.ones(8, np.float32))
    prod, cons = _specs(2, 2, x, x)
    with using_path(KernelPath.EMULATED):
        for links in ({"nope": 0}, {"y": 1}):
            with pytest.raises(ValueError, match="name no input"):
                phases.chain(prod, cons, links, key=x)
