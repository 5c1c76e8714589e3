"""Differential tests: every twin of strata/mlx_backend/twins.py against the reference, on every
kernel path this machine has (STYLE §1, §7):

- ops:      MLX ops (CPU in CI; the GPU device where MLX has one)
- emulated: the shared kernel bodies compiled for the CPU (needs a C++20 compiler)
- gpu:      the shared bodies through mx.fast.metal_kernel / cuda_kernel (marked `gpu`)

Inputs are fresh random values for every example (hypothesis draws the reference engine and the variant);
dense weights are float16-exact, so the float16 kernel path and the float32 reference compute on
the same numbers and the FAST budget applies.
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mlx_agree import assert_backends_agree, assert_selections_agree, examples
from models import DictExperts
from strata.formats.quant_types import QuantType
from strata.mlx_backend.quants import native_refusal
from strata.mlx_backend import mla as mlx_mla
from strata.mlx_backend import model as mlx_model
from strata.mlx_backend.attention import MlxLayerKV
from strata.mlx_backend.kernels.launch import KernelPath, gpu_dialect, using_path
from strata.mlx_backend.twins import BY_NAME, TWINS
from strata.model_config import Ffn, LayerType, Mixer, QKNorm, RoutingOrder
from strata.reference.experts import expert_act
from strata.reference import mla as ref_mla
from strata.reference import model as ref_model
from strata.reference.attention import LayerKV
from strata.reference.quants import quantize
from strata.reference.routing import RouterRule
from strata.testing.models import SHAPES, make_dense, make_expert
from strategies import logit_ranges, moce_policies, routing_orders, routing_problems
from tests.kernel_paths import KERNEL_PATHS

PATHS = [pytest.param(KernelPath.OPS, id="ops"), *KERNEL_PATHS]
# Examples per path: the emulator runs a GPU thread per OS thread, so it gets fewer.
# Where a GPU is, the ops path runs there too with fewer examples (CI runs it on the CPU at 25).
EXAMPLES = {KernelPath.OPS: examples(25 if gpu_dialect() is None else 6), KernelPath.EMULATED: examples(4),
            KernelPath.GPU: examples(8)}

# Model variants the layer-level twins run on (each a set of kernel specialisations).
VARIANTS = {
    "tiny": {},
    "no_shared_topk_softmax": dict(shared_ffn_size=0, routing_order=RoutingOrder.TOPK_SOFTMAX, qk_norm=QKNorm.NONE),
    "bias_full_norm": dict(attention_bias=True, qk_norm=QKNorm.FULL, shared_expert_gated=False, n_experts=8,
                           n_experts_per_token=2),
    # gpt-oss: a sliding then a full layer, sinks, biases, the clamped SwiGLU, YaRN (ops path on every path)
    "gpt_oss": {f: SHAPES["gpt-oss"].flat()[f] for f in (
        "routing_order", "attention_bias", "router_logit_bias", "expert_kind", "expert_bias", "swiglu_limit",
        "attention_sinks", "attention_output_bias", "rope_scaling", "yarn_factor", "yarn_original_context",
        "yarn_truncate", "yarn_attention_factor")} | dict(
        shared_ffn_size=0, qk_norm=QKNorm.NONE, sliding_window=3,
        layer_types=(LayerType(Mixer.SLIDING_ATTENTION, Ffn.MOE), LayerType(Mixer.ATTENTION, Ffn.MOE))),
}
seeds = st.integers(0, 2**31 - 1)


def fp16_exact(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def tiny_model(variant: str, seed: int) -> ref_model.ModelParams:
    cfg = SHAPES["tiny"].with_fields(**VARIANTS[variant])
    dense = {k: fp16_exact(v) for k, v in make_dense(cfg, seed).items()}
    experts = {(l, e): make_expert(cfg, seed, l, e, QuantType.Q2_0) for l in range(cfg.n_layers) for e in range(cfg.n_experts)}
    return ref_model.ModelParams(cfg, dense, DictExperts(experts))


def boundary_gap(trace: ref_model.ForwardTrace, k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th router logit over every (layer, token):
    below float32 noise the twins may legitimately pick different experts."""
    gaps = []
    for layer in trace.selections:
        for sel in layer:
            z = np.sort(sel.logits)[::-1]
            if z.size > k:
                gaps.append(float(z[k - 1] - z[k]))
    return min(gaps, default=np.inf)


# ---------------------------------------------------------------- one case per twin: -> [(what, ref, fast)]


def case_dequantize(rng, path):
    qt = [QuantType.Q2_0, QuantType.Q4_0, QuantType.Q8_0, QuantType.F16][int(rng.integers(4))]
    m = quantize(qt, rng.standard_normal((int(rng.integers(1, 9)), 32 * int(rng.integers(1, 5)))) * rng.uniform(0.01, 100))
    t = BY_NAME["quants.dequantize"]
    return [(qt.name, t.reference(m), t.fast(m))]


def case_gemv(rng, path):
    rows, cols = [(8, 64), (40, 96), (256, 128)][int(rng.integers(3))]
    qt = [QuantType.Q2_0, QuantType.Q8_0, QuantType.Q4_0][int(rng.integers(3))]
    m = quantize(qt, rng.standard_normal((rows, cols)))
    x = rng.standard_normal((int(rng.integers(1, 4)), cols)).astype(np.float32)
    t = BY_NAME["quants.gemv"]
    return [(f"{qt.name} {rows}x{cols}", t.reference(m, x), t.fast(m, x))]


def case_output_gate(rng, path):
    """The DeltaNet's gated-RMSNorm gate: silu, and sigmoid (the released Qwen3.8-Flash-Next's)."""
    z = (rng.standard_normal((3, 4, 16)) * rng.uniform(0.1, 30)).astype(np.float32)
    t = BY_NAME["deltanet.output_gate"]
    out = []
    for sigmoid in (False, True):
        cfg = SHAPES["hybrid"].with_fields(deltanet_sigmoid_gate=sigmoid)
        out.append(("sigmoid" if sigmoid else "silu", t.reference(cfg, z), t.fast(cfg, mx.array(z))))
    return out


def case_router_logits(rng, path):
    w = rng.standard_normal((16, 64)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    t = BY_NAME["routing.router_logits"]
    return [("z", t.reference(w, x), t.fast(w, x))]


def case_rms_norm(rng, path):
    x = (rng.standard_normal((3, 64)) * rng.uniform(0.01, 10)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    t = BY_NAME["attention.rms_norm"]
    return [("rms", t.reference(x, w, 1e-6), t.fast(mx.array(x), mx.array(w), 1e-6))]


def case_swiglu_expert(rng, path):
    cfg = SHAPES["tiny"] if rng.random() < 0.5 else SHAPES["gpt-oss"]  # gpt-oss: clamped, with biases
    qt = QuantType.Q2_0 if cfg is SHAPES["tiny"] or rng.random() < 0.5 else QuantType.MXFP4
    if native_refusal(qt) is not None:  # MXFP4 on MLX's CUDA build: refused in one line, not computed
        qt = QuantType.Q2_0
    w = make_expert(cfg, int(rng.integers(1 << 30)), 0, 0, qt)
    x = rng.standard_normal((int(rng.integers(1, 4)), cfg.hidden_size)).astype(np.float32)
    t, act = BY_NAME["experts.swiglu_expert"], expert_act(cfg)
    return [(f"{cfg.gpt_oss.expert_kind.value} {qt.name}", t.reference(w, x, act), t.fast(w, x, act))]


def case_gated_hidden(rng, path):
    act = expert_act(SHAPES["gpt-oss"] if rng.random() < 0.5 else SHAPES["tiny"])
    g, u = (rng.standard_normal((2, int(rng.integers(1, 4)), 32)) * 2).astype(np.float32)
    t = BY_NAME["experts.gated_hidden"]
    return [(act.kind.value, t.reference(act, g, u), t.fast(act, mx.array(g), mx.array(u)))]


def case_softmax_with_sinks(rng, path):
    h, q, k = 4, int(rng.integers(1, 4)), int(rng.integers(1, 9))
    scores = (rng.standard_normal((h, q, k)) * 3).astype(np.float32)
    scores[:, :, : int(rng.integers(0, k))] = -np.inf  # keys outside a window
    scores[:, :, -1] = np.abs(scores[:, :, -1])  # the query's own key is always visible
    sinks = (rng.standard_normal(h) * 3).astype(np.float32) if rng.random() < 0.75 else None
    t = BY_NAME["attention.softmax_with_sinks"]
    return [("sinks" if sinks is not None else "plain", t.reference(scores, sinks),
             t.fast(mx.array(scores), None if sinks is None else mx.array(sinks)))]


def case_routed_experts(rng, path):
    cfg = SHAPES["tiny"] if rng.random() < 0.5 else SHAPES["small"]
    k = int(rng.integers(1, 6))
    ex = [make_expert(cfg, int(rng.integers(1 << 30)), 0, e, QuantType.Q2_0) for e in range(k)]
    wts = rng.random(k).astype(np.float32)
    x = rng.standard_normal(cfg.hidden_size).astype(np.float32)
    t = BY_NAME["experts.routed_experts"]
    return [(f"k={k}", t.reference(ex, wts, x), t.fast(ex, wts, x))]


def case_shared_expert(rng, path):
    d, fs = 64, [32, 64][int(rng.integers(2))]
    g, u = (fp16_exact(rng.standard_normal((fs, d)) / 8) for _ in range(2))
    dn = fp16_exact(rng.standard_normal((d, fs)) / 8)
    gi = fp16_exact(rng.standard_normal(d) / 8) if rng.random() < 0.5 else None
    x = rng.standard_normal((int(rng.integers(1, 4)), d)).astype(np.float32)
    dt = mlx_model.default_dtype()
    conv = lambda a: None if a is None else mx.array(a).astype(dt)  # noqa: E731
    t = BY_NAME["experts.shared_expert"]
    return [("shared", t.reference(g, u, dn, gi, x), t.fast(conv(g), conv(u), conv(dn), conv(gi), x))]


def case_embed(rng, path):
    params = tiny_model("tiny", int(rng.integers(1 << 30)))
    tokens = rng.integers(0, params.cfg.vocab_size, int(rng.integers(1, 6)))
    t = BY_NAME["model.embed"]
    return [("embed", t.reference(params, tokens), t.fast(mlx_model.from_reference(params), tokens))]


def case_attention_block(rng, path):
    variant = list(VARIANTS)[int(rng.integers(len(VARIANTS)))]
    params = tiny_model(variant, int(rng.integers(1 << 30)))
    cfg = params.cfg
    mp = mlx_model.from_reference(params)
    layer = int(rng.integers(cfg.n_layers))
    prefix = (rng.standard_normal((int(rng.integers(0, 5)), cfg.hidden_size))).astype(np.float32)
    new = rng.standard_normal((int(rng.integers(1, 4)), cfg.hidden_size)).astype(np.float32)
    kv_r, kv_f = LayerKV.empty(cfg), MlxLayerKV.empty(cfg)
    out = []
    t = BY_NAME["model.attention_block"]
    for i, x in enumerate((prefix, new)):
        if len(x):
            r, kv_r = t.reference(params, layer, kv_r, x)
            f, kv_f = t.fast(mp, layer, kv_f, mx.array(x))
            out.append((f"{variant} chunk {i}", r, f))
    return out


def case_mla(rng, path):
    cfg = SHAPES["mla"]
    dense = {k: fp16_exact(v) for k, v in make_dense(cfg, int(rng.integers(1 << 30))).items()}
    layer = int(rng.integers(cfg.n_layers))
    w = mlx_mla.mla_weights(cfg, dense, layer, mlx_model.default_dtype())
    kv_r, kv_f = ref_mla.LatentKV.empty(cfg), mlx_mla.MlxLatentKV.empty(cfg)
    out, t = [], BY_NAME["mla.mla"]
    for i in range(3):  # a prompt chunk, then decodes (the absorbed form once anything is cached)
        x = rng.standard_normal((int(rng.integers(1, 6)) if i == 0 else 1, cfg.hidden_size)).astype(np.float32)
        r, kv_r = t.reference(cfg, dense, layer, kv_r, x)
        f, kv_f = t.fast(cfg, w, kv_f, mx.array(x))
        out.append((f"layer {layer} chunk {i}", r, f))
    return out


def case_head(rng, path):
    params = tiny_model("tiny", int(rng.integers(1 << 30)))
    x = rng.standard_normal((2, params.cfg.hidden_size)).astype(np.float32)
    t = BY_NAME["model.head"]
    return [("head", t.reference(params, x), t.fast(mlx_model.from_reference(params), mx.array(x)))]


def case_forward(rng, path):
    variant = list(VARIANTS)[int(rng.integers(len(VARIANTS)))]
    params = tiny_model(variant, int(rng.integers(1 << 30)))
    cfg = params.cfg
    prompt = rng.integers(0, cfg.vocab_size, int(rng.integers(1, 7)))
    step = rng.integers(0, cfg.vocab_size, 1)
    ref1, st_r, tr1 = ref_model.forward(params, ref_model.ModelState.empty(cfg), prompt, trace=True)
    ref2, _, tr2 = ref_model.forward(params, st_r, step, trace=True)
    assume(min(boundary_gap(tr1, cfg.n_experts_per_token), boundary_gap(tr2, cfg.n_experts_per_token)) > 1e-3)
    mp = mlx_model.from_reference(params)
    t = BY_NAME["model.forward"]
    f1, st_f = t.fast(mp, mlx_model.MlxModelState.empty(cfg), prompt)
    f2, _ = t.fast(mp, st_f, step)
    return [(f"{variant} prompt", ref1, f1), (f"{variant} decode", ref2, f2)]


CASES = {
    "quants.dequantize": case_dequantize, "quants.gemv": case_gemv, "routing.router_logits": case_router_logits,
    "attention.rms_norm": case_rms_norm, "experts.swiglu_expert": case_swiglu_expert,
    "experts.routed_experts": case_routed_experts, "experts.shared_expert": case_shared_expert,
    "experts.gated_hidden": case_gated_hidden, "attention.softmax_with_sinks": case_softmax_with_sinks,
    "model.embed": case_embed, "model.attention_block": case_attention_block, "model.head": case_head,
    "model.forward": case_forward, "mla.mla": case_mla, "deltanet.output_gate": case_output_gate,
}


def test_every_twin_has_a_case():
    assert set(CASES) | {"routing.route"} == {t.name for t in TWINS}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_twin_agrees_with_reference(name, path):
    twin = BY_NAME[name]
    if path is not KernelPath.OPS and not twin.kernel:
        pytest.skip("no kernel path: the ops run covers it")

    @settings(max_examples=EXAMPLES[path])
    @given(seed=seeds)
    def check(seed):
        with using_path(path):
            for what, ref, fast in CASES[name](np.random.default_rng(seed), path):
                assert_backends_agree(ref, fast, twin.budget, what=f"{name} [{path.value}] {what}")

    check()


@pytest.mark.parametrize("path", [p for p in PATHS if p.id != "emulated"])
@settings(max_examples=examples(200))
@given(problem=routing_problems(max_experts=64), policy=moce_policies(), logit_range=logit_ranges,
       order=routing_orders, norm=st.booleans(), with_policy=st.booleans())  # sigmoid: test_mlx_sigmoid.py
def test_route_twin_selects_exactly(path, problem, policy, logit_range, order, norm, with_policy):
    logits, resident, k = problem
    rule = RouterRule(k, order, norm)
    policy = policy if with_policy else None
    twin = BY_NAME["routing.route"]
    ref = twin.reference(logits, rule, policy, resident, logit_range)
    if policy is not None and policy.drop_tail_weight > 0:  # a weight at the threshold may round either way
        all_w = np.concatenate([ref.weights, ref.dropped_weights])
        assume(np.all(np.abs(all_w - np.float32(policy.drop_tail_weight)) > 1e-5))
    with using_path(path):
        fast = twin.fast(logits, rule, policy, resident, logit_range)
    assert_selections_agree(ref, fast, what="route")


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_float32_matmul_is_full_precision_on_the_gpu():
    """The ops path's float32 products are float32 on the GPU: strata.mlx_backend sets
    MLX_ENABLE_TF32=0 unless the user chose otherwise (TF32 would be ~3e-4 relative here, 10-bit
    mantissas; the FAST budget is 2e-5)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 2560)).astype(np.float32)
    b = rng.standard_normal((2560, 512)).astype(np.float32)
    got = np.array(mx.array(a) @ mx.array(b))
    assert_backends_agree(a.astype(np.float64) @ b.astype(np.float64), got, "FAST", what="float32 matmul on the GPU")
