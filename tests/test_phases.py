"""Two dependent launches as one (kernels/phases.py): the consumer's blocks read the producer's
whole output in the same launch, the counters are zero again after it, and the chained QKV +
attention launch decodes bit for bit what the two launches did (emulator; the GPU test below)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from strata.mlx_backend.kernels import attend_project, emulate, moe_decode, phases
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


def test_a_stamped_chain_writes_every_blocks_timeline_and_the_same_outputs():
    """phases.stamping: each block's ticket, wait met and end in order (blocks run in ticket order
    on the emulator, whose clock counts stamps), a consumer's wait met after every producer block
    ended, and the chain's outputs unchanged."""
    na, nb = 3, 2
    x = mx.array(np.full(8, 1.0, np.float32))
    scale = mx.array(np.full(8, 0.5, np.float32))
    key = mx.zeros(3)
    with using_path(KernelPath.EMULATED):
        plain = [np.array(a) for a in phases.chain(*_specs(na, nb, x, scale), {"y": 0}, key=key)]
        with phases.stamping() as rec:
            stamped = [np.array(a) for a in phases.chain(*_specs(na, nb, x, scale), {"y": 0}, key=key)]
        phases.chain(*_specs(na, nb, x, scale), {"y": 0}, key=key)  # past the context: not stamped
    for a, b in zip(plain, stamped):
        np.testing.assert_array_equal(a, b)
    assert len(rec) == 1 and rec[0].starts == (0, na, na + nb)
    assert rec[0].phases == ("strata_test_fill", "strata_test_sum_all")
    assert len(rec) == 1
    st = np.array(rec[0].stamps).astype(np.int64)
    assert st.shape == (na + nb, phases.STAMP_WORDS)
    assert (st[:, 0] <= st[:, 1]).all() and (st[:, 1] < st[:, 2]).all()
    assert (np.diff(st[:, 0]) > 0).all()  # tickets in block order
    assert st[na:, 1].min() > st[:na, 2].max()  # every consumer waited until every producer ended
    assert (st[:na, 3] == 0).all() and (st[na:, 3] > 0).all()  # cycles to the wait: none where none is


def test_a_stamped_decode_stamps_the_expert_launches_too_and_changes_no_bits():
    """Inside phases.stamping a decoded token's one-row launches through phases.run (the expert
    step's gate/up and down) are stamped as well as its chains, in launch order; the same bits."""
    from strata.mlx_backend.kernels import moe_down_warps
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL, greedy_steps

    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL, seed=21, pred_q8=False)
        plain = greedy_steps(p, steps=1)
        with phases.stamping() as rec:
            stamped = greedy_steps(p, steps=1)
    for a, b in zip(plain, stamped):
        assert a.tobytes() == b.tobytes()
    names = [c.phases[0] for c in rec if len(c.phases) == 1]
    assert "strata_moe_gateup" in names and moe_down_warps.SOURCE.name in names
    down = next(c for c in rec if c.phases == (moe_down_warps.SOURCE.name,))
    st = np.array(down.stamps).astype(np.int64)
    assert down.starts == (0, len(st)) and (st[:, 0] <= st[:, 2]).all() and (np.diff(st[:, 0]) > 0).all()


def test_the_stamped_expert_launches_cuda_sources_compile(tmp_path, monkeypatch):
    """The expert step's stamped builds with benchmarks/chain_timeline.py's marks (gate/up, down),
    as a decoded token launches them, compiled as the chains above."""
    import sys
    from pathlib import Path

    from test_metal_compile import _check

    from strata.mlx_backend import model as mlx_model
    from strata.mlx_backend.kernels import moe_down_warps
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import PROMPT, SMALL

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from chain_timeline import MARKS

    seen = []
    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL, seed=21, pred_q8=False)
        _, state = mlx_model.forward(p, mlx_model.MlxModelState.empty(SMALL), PROMPT)
        with phases.stamping({k: [a for _, a in v] for k, v in MARKS.items()}):
            monkeypatch.setattr(phases, "launch", capturing(seen))
            mlx_model.forward(p, state, np.array([3]))
    want = {"strata_moe_gateup_stamped", moe_down_warps.SOURCE.name + "_stamped"}
    got = {k[0].name: k for k in seen if k[0].name in want}
    assert set(got) == want
    for name, key in got.items():
        marks = len(MARKS[name.removesuffix("_stamped")])  # each mark reads its word, then writes it
        assert key[0].body.count(f"chain_stamps[{phases.STAMP_WORDS}u * chain_vb + ") == 2 * marks
        assert _check(tmp_path, Dialect.CUDA, key) is None


def test_a_body_that_returns_is_not_stamped():
    with pytest.raises(ValueError, match="returns"):
        phases.stamped_single(replace(PRODUCER, name="strata_test_returns", body=PRODUCER.body + "  return;\n"))


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


# the QKV GEMV + attention (its partials summed in the launch: SUM_PARTS), and that + the router
CHAINS = {"qkv": "strata_chain_dense_gemv_attend_project_sum",
          "qkv_router": "strata_chain_dense_gemv_attend_project_sum_router",
          # ... with the QKV GEMV walked KV group by KV group (kernels/qkv_groups.py)
          "groups": "strata_chain_qkv_groups_attend_project_sum",
          "groups_router": "strata_chain_qkv_groups_attend_project_sum_router",
          # ... and a layer's down step run by the next layer's launch (moe_decode.DEFER_DOWN): the
          # first layer's launch as groups_router's, the later ones with the down phase first
          "deferred": ("strata_chain_qkv_groups_attend_project_sum_router",
                       "strata_chain_moe_down_chained_qkv_groups_attend_project_sum_router"),
          # ... and the top k ranked once as the launch's last phase (moe_decode.RANK_ONCE: the
          # expert launches read it), without and with the deferred down step
          "ranked": "strata_chain_qkv_groups_attend_project_sum_router_route_rank",
          "ranked_deferred": ("strata_chain_qkv_groups_attend_project_sum_router_route_rank",
                              "strata_chain_moe_down_chained_qkv_groups_attend_project_sum_router_route_rank")}
ROUTED = ("qkv_router", "groups_router", "deferred", "ranked", "ranked_deferred")  # the router in the launch
BY_GROUP = ("groups", "groups_router", "deferred", "ranked", "ranked_deferred")  # the QKV walk by KV group


def _decode(p, chained: str | None, monkeypatch, compiled: bool = False):
    """test_mlx_compiled.greedy_steps with a chain on (its CHAINS key) or none -> (its three
    arrays, launches of that chain). The router runs at the chain's 256 threads either way (its
    norm's partial sums are per thread: 128 threads would sum in another order)."""
    from test_mlx_compiled import greedy_steps

    monkeypatch.setattr(attend_project, "CHAIN_QKV", chained is not None)
    monkeypatch.setattr(attend_project, "CHAIN_ROUTER", chained in ROUTED)
    monkeypatch.setattr(attend_project, "QKV_BY_GROUP", chained in BY_GROUP)
    monkeypatch.setattr(moe_decode, "DEFER_DOWN", chained in ("deferred", "ranked_deferred"))
    monkeypatch.setattr(moe_decode, "RANK_ONCE", chained in ("ranked", "ranked_deferred"))
    monkeypatch.setattr(router_kernel, "THREADS", attend_project.THREADS)
    names = CHAINS[chained or "qkv"]
    names = (names,) if isinstance(names, str) else names
    before = sum(LAUNCHES[n] for n in names)
    out = greedy_steps(p, compiled=compiled)
    return (*out, sum(LAUNCHES[n] for n in names) - before)


@pytest.mark.parametrize("chained", list(CHAINS))
def test_chained_decode_bit_for_bit_on_the_emulator(monkeypatch, chained):
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL

    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL, seed=21, pred_q8=False)
        *apart, n_apart = _decode(p, None, monkeypatch)
        *chain, n_chained = _decode(p, chained, monkeypatch)
    assert n_apart == 0 and n_chained == 3 * SMALL.n_layers  # one a layer and decoded token (the prompt apart)
    for a, b in zip(apart, chain):
        assert a.tobytes() == b.tobytes()


def test_a_deferred_down_step_of_16_rows_a_block_decodes_within_fast(monkeypatch):
    """moe_decode.DEFER_ROWS = 16 (the down phase's other block shape: a lane takes another share
    of its row, so its float32 sums go in another order) against no chain, emulated, within FAST."""
    from mlx_agree import assert_backends_agree

    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL

    monkeypatch.setattr(moe_decode, "DEFER_ROWS", 16)
    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL, seed=25, pred_q8=False)
        *apart, _ = _decode(p, None, monkeypatch)
        *chain, n_chained = _decode(p, "deferred", monkeypatch)
    assert n_chained == 3 * SMALL.n_layers
    for what, a, b in zip(("logits", "keys", "values"), apart, chain):
        assert_backends_agree(a, b, "FAST", what=what)


def test_the_group_walk_decodes_gated_attention_bit_for_bit(monkeypatch):
    """The hybrid's gated attention (the output gate's rows walked with their group's, partial
    rotary): the walk against no chain, on the emulator."""
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL_HYBRID

    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL_HYBRID, seed=22, pred_q8=False)
        *apart, _ = _decode(p, None, monkeypatch)
        *chain, n_chained = _decode(p, "groups_router", monkeypatch)
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

    monkeypatch.setattr(attend_project, "QKV_BY_GROUP", True)
    h = 4
    with using_path(KernelPath.EMULATED):
        monkeypatch.setattr(phases, "launch", record)
        attend_project.qkv_attend_route(*zero_route_args(h, 2, 64, 256, 64, 16), 3, 1e-6, h)
    assert len(seen) == 1 and seen[0][0].name == CHAINS["groups_router"]
    assert _check(tmp_path, Dialect.CUDA, seen[0]) is None


def test_the_stamped_group_walk_chain_cuda_source_compiles(tmp_path, monkeypatch):
    """The timeline's stamped form of the chained launch (phases.stamping), compiled as above."""
    from test_metal_compile import _check

    seen = []
    h = 4
    with using_path(KernelPath.EMULATED), phases.stamping() as rec:
        monkeypatch.setattr(phases, "launch", capturing(seen))
        attend_project.qkv_attend_route(*zero_route_args(h, 2, 64, 256, 64, 16), 3, 1e-6, h)
    assert len(seen) == 1 and len(rec) == 1 and seen[0][0].name.endswith("_stamped")
    assert "globaltimer" not in seen[0][0].body and "clock_ns()" in seen[0][0].body
    assert _check(tmp_path, Dialect.CUDA, seen[0]) is None


@pytest.mark.parametrize("split", [False, True])
def test_the_timelines_marked_chains_cuda_sources_compile(tmp_path, monkeypatch, split):
    """benchmarks/chain_timeline.py's marks: each of its texts found once in its phase's body (the
    wait inserted), a stamp before each, in the short chain and the split chain, compiled as above."""
    import sys
    from pathlib import Path

    from test_metal_compile import _check

    from strata.mlx_backend.kernels import attend_split

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from chain_timeline import MARKS

    seen = []
    h = 4
    monkeypatch.setattr(attend_split, "CHAIN_SPLIT", True)
    with using_path(KernelPath.EMULATED), phases.stamping({k: [a for _, a in v] for k, v in MARKS.items()}):
        monkeypatch.setattr(phases, "launch", capturing(seen))
        if split:
            attend_split.qkv_split_route(*zero_route_args(h, 2, 64, 256, 512, 16), 300, 1e-6, h)
        else:
            attend_project.qkv_attend_route(*zero_route_args(h, 2, 64, 256, 64, 16), 3, 1e-6, h)
    body = seen[0][0].body
    want = len(MARKS["strata_qkv_groups"]) + len(MARKS["strata_attend_split_chained" if split
                                                     else "strata_attend_project_sum"])
    assert body.count(f"chain_stamps[{phases.STAMP_WORDS}u * chain_vb + ") == 2 * want  # its test and its write
    assert _check(tmp_path, Dialect.CUDA, seen[0]) is None


def test_a_marks_text_must_be_in_its_body_once():
    with pytest.raises(ValueError, match="0 times, not once"):
        phases._marked("  int a = 0;\n", ["  int b"], "strata_test")
    with pytest.raises(ValueError, match="at most"):
        phases._marked("x", ["x"] * (phases.MAX_MARKS + 1), "strata_test")


def test_the_deferred_down_chain_cuda_source_compiles(tmp_path, monkeypatch):
    """A layer's down step as the first phase of the next layer's chained launch (four phases),
    compiled as the ones above: the launches of a 2-layer model's decoded token captured."""
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL

    from strata.mlx_backend import model as mlx_model
    from test_metal_compile import _check

    seen = []
    real = phases.launch

    def record(src, inputs, shapes, dtypes, *, blocks, threads, template):
        if src.name == CHAINS["deferred"][1]:
            seen.append(compile_key(src, inputs, dtypes, template))
        return real(src, inputs, shapes, dtypes, blocks=blocks, threads=threads, template=template)

    monkeypatch.setattr(moe_decode, "DEFER_DOWN", True)
    monkeypatch.setattr(attend_project, "QKV_BY_GROUP", True)
    with using_path(KernelPath.EMULATED):
        p = random_params(SMALL, seed=24, pred_q8=False)
        _, state = mlx_model.forward(p, mlx_model.MlxModelState.empty(SMALL), np.array([3, 4]))
        monkeypatch.setattr(phases, "launch", record)
        logits, _ = mlx_model.forward(p, state, np.array([5]))
        mx.eval(logits)
    assert len(seen) == SMALL.n_layers - 1
    assert _check(tmp_path, Dialect.CUDA, seen[0]) is None


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is not Dialect.CUDA, reason="no MLX CUDA GPU here")
@pytest.mark.parametrize("chained", list(CHAINS))
def test_chained_decode_bit_for_bit_on_the_gpu(monkeypatch, chained):
    """The compiled step with a chain against the uncompiled forward without it, on the GPU."""
    from strata.testing.mlx_params import random_params
    from test_mlx_compiled import SMALL

    with using_path(KernelPath.GPU):
        p = random_params(SMALL, seed=23, pred_q8=False)
        *apart, _ = _decode(p, None, monkeypatch)
        *chain, n_chained = _decode(p, chained, monkeypatch, compiled=True)
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
