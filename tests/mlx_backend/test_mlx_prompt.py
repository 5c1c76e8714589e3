"""The MLX prompt path (strata/mlx_backend/prompt.py, grouped.py, prompt_attention.py) against the
reference, on MLX's CPU build here and on a GPU where MLX has one:

- float32 weights: only the order of float32 sums differs from the reference (FORWARD), for every
  made shape the path serves (attention, a dense first layer, sigmoid routing with groups, the
  hybrid's DeltaNet layers and the MLA shape's latent attention run their own multi-position
  forms), the whole prompt and a continuation after cached positions;
- float16 matmul inputs (what a GPU runs): the PROMPT budget, on prompts whose routing
  decisions are far from a tie (float16 rounding may legitimately pick another expert there);
- the pieces: the exact top-k key against the reference's ranking (ties, -0.0, -inf), the two
  grouped GEMMs against each other and against the reference's per-token experts;
- the engine: a GPU prefill through the prompt path against the decode kernels' `forward`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kernel_paths import plan_in_force
from mlx_agree import assert_backends_agree
from models import DictExperts
from strata.formats.quant_types import QuantType
from strata.mlx_backend import grouped
from strata.mlx_backend.engine import MlxEngine
from strata.mlx_backend.experts import slot_planes
from strata.mlx_backend.grouped import GroupedGemm, dequantized_experts, grouped_experts, top_k
from strata.mlx_backend.kernels.launch import KernelPath, gpu_dialect, using_path
from strata.mlx_backend.model import MlxModelState, forward, from_reference
from strata.mlx_backend.prompt import PROMPT_MIN_TOKENS, prompt_forward, prompt_refusal, uses_prompt_path
from strata.reference import model as ref_model
from strata.reference.experts import routed_experts
from strata.model_config import RoutingOrder
from strata.reference.routing import RouterRule, route
from strata.testing.models import SHAPES, make_dense, make_expert

SERVED = ("tiny", "dense-first", "sigmoid", "hybrid", "mla")
PROMPT_LEN = 24
CONTINUATION = 5


def fp16_exact(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def made_params(shape: str, seed: int = 0) -> ref_model.ModelParams:
    cfg = SHAPES[shape]
    dense = {k: fp16_exact(v) for k, v in make_dense(cfg, seed).items()}
    experts = {(m, e): make_expert(cfg, seed, m, e, QuantType.Q2_0)
               for m in range(cfg.n_moe_layers) for e in range(cfg.n_experts)}
    return ref_model.ModelParams(cfg, dense, DictExperts(experts))


def min_gap(trace: ref_model.ForwardTrace, k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th selection score over every (layer, token)."""
    gaps = [float(np.sort(s.logits)[::-1][k - 1] - np.sort(s.logits)[::-1][k])
            for layer in trace.selections for s in layer if s.logits.size > k]
    return min(gaps, default=np.inf)


@pytest.fixture
def always_grouped(monkeypatch):
    """Every MoE layer's experts through the grouped GEMMs (the made shapes have few pairs per expert)."""
    return plan_in_force(monkeypatch, grouped_min_pairs=0)


@pytest.mark.parametrize("experts", ["grouped", "fused"])
@pytest.mark.parametrize("shape", SERVED)
def test_prompt_path_matches_reference_float32(shape, experts, monkeypatch):
    """float32 weights: the prompt path is the reference up to the order of float32 sums, every
    position's logits, then a continuation after the cached positions; its experts as grouped
    GEMMs, and through the decode kernels' expert step (few pairs per expert)."""
    plan_in_force(monkeypatch, grouped_min_pairs=0 if experts == "grouped" else 10**9)
    rp = made_params(shape)
    tokens = np.random.default_rng(1).integers(0, rp.cfg.vocab_size, PROMPT_LEN + CONTINUATION)
    ref, _ = ref_model.forward(rp, ref_model.ModelState.empty(rp.cfg), tokens)
    with using_path(KernelPath.OPS):
        p = from_reference(rp, dtype=mx.float32)
        assert prompt_refusal(p) is None
        got, state = prompt_forward(p, MlxModelState.empty(rp.cfg), tokens[:PROMPT_LEN], all_logits=True)
        assert_backends_agree(ref[:PROMPT_LEN], np.array(got), "FORWARD", what=f"{shape}: prompt")
        assert state.length == PROMPT_LEN
        more, state = prompt_forward(p, state, tokens[PROMPT_LEN:])
        assert_backends_agree(ref[-1:], np.array(more), "FORWARD", what=f"{shape}: continuation's last position")
        assert state.length == len(tokens)


@pytest.mark.parametrize("shape", ("tiny", "dense-first", "sigmoid"))
def test_prompt_path_float16_within_prompt_budget(shape, always_grouped):
    """float16 matmul inputs (the GPU's) against the float32 reference: the PROMPT budget, on a
    prompt whose every selection is decided by more than float16 noise."""
    rp = made_params(shape, seed=3)
    k = rp.cfg.n_experts_per_token
    rng = np.random.default_rng(2)
    for _ in range(20):  # a prompt with no near-tie at any layer's top-k boundary
        tokens = rng.integers(0, rp.cfg.vocab_size, 12)
        ref, _, trace = ref_model.forward(rp, ref_model.ModelState.empty(rp.cfg), tokens, trace=True)
        if min_gap(trace, k) > 2e-2:
            break
    else:
        pytest.skip("no prompt without a near-tie in 20 draws")
    with using_path(KernelPath.OPS):
        p = from_reference(rp, dtype=mx.float16)
        got, _ = prompt_forward(p, MlxModelState.empty(rp.cfg), tokens, all_logits=True)
    assert_backends_agree(ref, np.array(got), "PROMPT", what=f"{shape}: float16 prompt path")


@pytest.mark.parametrize("keys", ["uint64", "comparisons"])
def test_top_k_is_the_reference_ranking(keys, monkeypatch):
    """Ties go to the lower id and -0.0 equals 0.0: the reference's selections; -inf (a group
    masked out by the sigmoid rule) ranks below every finite score, ties again to the lower id.
    Both forms: the sorted uint64 keys, and the pairwise comparisons where uint64 does not sort."""
    if keys == "comparisons":
        monkeypatch.setattr(grouped, "_sorts_uint64", lambda device: False)
    rows = [
        [1.0, -2.0, 1.0, 0.0, -0.0, 3.0, -7.0, 1.0],
        [-0.0, 0.0, -0.0, 0.0, 5.0, 5.0, -1.0, -1.0],
        [-1.0, -1.0, 2.0, -1.0, 2.0, 2.0, -3.0, 0.5],
    ]
    rng = np.random.default_rng(0)
    rows += [rng.standard_normal(8).astype(np.float32) for _ in range(20)]
    rows += [np.round(rng.standard_normal(8), 1).astype(np.float32) for _ in range(20)]  # many ties
    z = np.asarray(rows, np.float32)
    rule = RouterRule(4, RoutingOrder.SOFTMAX_TOPK)
    got = np.array(top_k(mx.array(z), 4))
    for t in range(z.shape[0]):
        np.testing.assert_array_equal(got[t], route(z[t], rule).experts, err_msg=f"row {t}: {z[t]}")
    masked = mx.array([[-np.inf, 0.5, -np.inf, -2.0, -np.inf, -np.inf, 1.0, -np.inf]], mx.float32)
    np.testing.assert_array_equal(np.array(top_k(masked, 5))[0], [6, 1, 3, 0, 2])


OPS_FORMS = [g for g in GroupedGemm if g not in (GroupedGemm.Q2_MMA, GroupedGemm.Q2_TILES)]  # kernels: their own tests


@pytest.mark.parametrize("gemm", OPS_FORMS)
def test_grouped_experts_match_the_reference_per_token(gemm):
    """The MLX-ops grouped GEMMs: sum_i w_i expert_i(h_t) as the reference computes it token by
    token, including an expert no token picked and one most tokens picked."""
    rp = made_params("tiny")
    cfg = rp.cfg
    e, k, t = cfg.n_experts, cfg.n_experts_per_token, 40
    rng = np.random.default_rng(4)
    h = rng.standard_normal((t, cfg.hidden_size)).astype(np.float32)
    experts = np.stack([rng.choice(np.arange(1, e), k, replace=False) for _ in range(t)]).astype(np.int32)
    experts[::2, 0] = e - 1  # a popular expert; expert 0 is never picked
    experts[::2, 1:] = np.where(experts[::2, 1:] == e - 1, 1, experts[::2, 1:])
    weights = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    ref = np.stack([routed_experts([rp.experts.expert(0, int(x)) for x in experts[i]], weights[i], h[i])
                    for i in range(t)])
    with using_path(KernelPath.OPS):
        p = from_reference(rp, dtype=mx.float32)
        got = grouped_experts(p.arena.array[:e], p.rec, mx.array(h), mx.array(experts), mx.array(weights),
                              dtype=mx.float32, gemm=gemm)
    assert_backends_agree(ref, np.array(got), "FAST", what=f"grouped experts ({gemm.value})")


def test_engine_takes_the_prompt_path_only_where_it_applies():
    """The ops and emulated paths keep `forward` (the prompt path is for the GPU); the GPU takes it
    from PROMPT_MIN_TOKENS, for a model it serves."""
    with using_path(KernelPath.OPS):
        p = from_reference(made_params("tiny"), dtype=mx.float32)
        assert not uses_prompt_path(p, 10 * PROMPT_MIN_TOKENS)
    with using_path(KernelPath.OPS):  # gpt-oss: a router logit bias and biased experts (refused)
        assert prompt_refusal(from_reference(made_params("gpt-oss"), dtype=mx.float32)) is not None


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
@pytest.mark.parametrize("shape", ("tiny", "sigmoid", "hybrid"))
@pytest.mark.parametrize("gemm", list(GroupedGemm))
def test_gpu_prefill_through_the_prompt_path(shape, gemm, monkeypatch):
    """On the GPU: MlxEngine.prefill of a PROMPT_MIN_TOKENS-position prompt goes through the prompt
    path and agrees with the reference within PROMPT (a prompt far from routing ties), then
    decodes on from the cache it wrote (the compiled step where the model has one)."""
    plan_in_force(monkeypatch, grouped_gemm=gemm, grouped_min_pairs=0)  # every layer's experts grouped
    rp = made_params(shape, seed=3)
    rng = np.random.default_rng(5)
    for _ in range(20):
        tokens = rng.integers(0, rp.cfg.vocab_size, PROMPT_MIN_TOKENS + 1)
        ref, _, trace = ref_model.forward(rp, ref_model.ModelState.empty(rp.cfg), tokens, trace=True)
        if min_gap(trace, rp.cfg.n_experts_per_token) > 2e-2:
            break
    else:
        pytest.skip("no prompt without a near-tie in 20 draws")
    with using_path(KernelPath.GPU):
        p = from_reference(rp)
        assert uses_prompt_path(p, PROMPT_MIN_TOKENS)
        eng = MlxEngine(p)  # decode after the prompt: the compiled step, bound to the cache the prompt wrote
        got = eng.prefill(list(tokens[:-1]))
        assert_backends_agree(ref[-2], got, "PROMPT", what=f"{shape} ({gemm.value}): GPU prefill")
        nxt = eng.decode(int(tokens[-1]))
        assert_backends_agree(ref[-1], nxt, "PROMPT", what=f"{shape} ({gemm.value}): decode after it")
        old, _ = forward(p, MlxModelState.empty(rp.cfg), tokens[:-1])
        assert_backends_agree(np.array(old[-1]), got, "PROMPT", what=f"{shape}: vs the decode kernels")



@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_gpu_float16_dequantization_is_exact():
    """On the GPU the float16 dequantization (q d + (-2d) in float16) is d (q - 2) exactly: the
    float32 dequantization rounded to float16 (itself exact), bit for bit."""
    rp = made_params("small")
    with using_path(KernelPath.OPS):
        p = from_reference(rp, dtype=mx.float32)
    records = p.arena.array[:rp.cfg.n_experts]
    st = slot_planes(records, p.rec)
    g, u, d = (mx.dequantize(w, s, b, group_size=32, bits=2).astype(mx.float16)
               for w, s, b in (st.gate, st.up, st.down))
    exact = [mx.concatenate([g, u], axis=1), d]
    for got, want in zip(dequantized_experts(records, p.rec, mx.float16), exact):
        assert_backends_agree(np.array(want.astype(mx.float32)), np.array(got.astype(mx.float32)), "EXACT",
                              what="float16 dequantization on the GPU")


@pytest.mark.parametrize("arena,chunk", [("10slots", 16), ("12slots", 8)])
def test_streaming_prompt_chunks_through_the_prompt_pieces(tmp_path, monkeypatch, arena, chunk):
    """The streaming engine's prompt chunks on the prompt path's pieces (MlxCompute: attention as
    matmuls, each cache pass's distinct slots as grouped GEMMs): a small arena forces several
    passes per layer, and the logits are the reference engine's (float32 weights on the CPU:
    FORWARD), prompt and decode after it."""
    pytest.importorskip("gguf")
    from strata.config import Backend, Config
    from strata.engines import open_engine
    from strata.loader import load
    from strata.mlx_backend import prompt
    from strata.mlx_backend.compute import MlxCompute
    from strata.numpy_backend.engine import ReferenceEngine
    from strata.testing.models import make_model

    plan_in_force(monkeypatch, prompt_paths=frozenset(KernelPath), grouped_min_pairs=0)  # and always grouped
    monkeypatch.setattr(prompt, "PROMPT_MIN_TOKENS", 4)
    from strata.mlx_backend import compute as mlx_compute

    passes = []
    grouped_passes = []
    real = grouped.grouped_experts
    monkeypatch.setattr(mlx_compute, "slot_experts", lambda *a, **kw: passes.append(1) or prompt.slot_experts(*a, **kw))
    monkeypatch.setattr(prompt, "grouped_experts", lambda *a, **kw: grouped_passes.append(1) or real(*a, **kw))
    model = load(make_model(tmp_path / "tiny", "tiny", seed=0, dense_type=QuantType.F16).model_path)
    tokens = list(np.random.default_rng(6).integers(0, model.cfg.vocab_size, 40))
    ref_eng = ReferenceEngine(model.resident_params())
    ref = [ref_eng.prefill(tokens), ref_eng.decode(7)]
    eng = open_engine(model, Config(backend=Backend.MLX, arena=arena, moce_lambda=0.0, prefill_chunk=chunk,
                                     prefetch=0))
    try:
        assert isinstance(eng.compute, MlxCompute) and eng.compute._prompt(mx.zeros((chunk, 1)))
        got = [eng.prefill(tokens), eng.decode(7)]
        assert_backends_agree(np.stack(ref), np.stack(got), "FORWARD", what=f"streaming prompt path, {arena}")
        chunks = -(-len(tokens) // chunk)
        assert len(passes) > chunks * model.cfg.n_moe_layers  # some layer of some chunk took several passes
        assert len(grouped_passes) == len(passes)
    finally:
        eng.close()


def test_engine_falls_back_when_the_prompt_path_fails(monkeypatch):
    """A prompt path that fails (an op this MLX build lacks) warns once, leaves the state alone and
    hands the prompt to `forward`: the logits are the reference's all the same."""
    from strata.mlx_backend import engine as mlx_engine
    from strata.mlx_backend import prompt

    rp = made_params("tiny")
    tokens = np.random.default_rng(7).integers(0, rp.cfg.vocab_size, PROMPT_MIN_TOKENS)
    ref, _ = ref_model.forward(rp, ref_model.ModelState.empty(rp.cfg), tokens)

    def broken(*args, **kwargs):
        raise RuntimeError("no GPU kernel for this op")

    plan_in_force(monkeypatch, prompt_paths=frozenset(KernelPath))
    monkeypatch.setattr(mlx_engine, "prompt_forward", broken)
    with using_path(KernelPath.OPS):
        eng = MlxEngine(from_reference(rp, dtype=mx.float32), compiled=False)
        with pytest.warns(RuntimeWarning, match="prompt path failed"):
            got = eng.prefill(list(tokens))
        assert eng.prompt_error is not None and eng.length == len(tokens)
        assert_backends_agree(ref[-1], got, "FORWARD", what="prefill after the prompt path failed")
