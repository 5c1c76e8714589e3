"""The MLA decode kernels (kernels/mla.py) on the emulated path against the reference
(reference/mla.py): decoded positions after a prompt on the made `mla` heads (c = 32, r = 8: a
cached row of 40 floats, ragged over the lanes), DeepSeek-V3's heads (c = 512, r = 64, n = v = 128,
two of its 128 heads), a model without the q low-rank path, a ragged latent (c = 40, r = 6) and
W_o in two column blocks (H v = 10240);
the output and the cache rows after every step (MLA_KERNEL), 5 launches + one per W_o block, DeepSeek's
YaRN (tables and the folded softmax scale), every split count and step shape (PB, HPW, VW) agreeing
(empty splits included), determinism, a latent the kernels refuse taking the ops
path; the compiled decode's device-scalar step over latent layers against the numpy reference
(untraced, on the emulator); and the Metal / CUDA compile check of every specialisation launched
here (Metal: compile-checked, not run). Marked `gpu` and run on the GPU path where MLX has a GPU:
the decode steps on the made heads and DeepSeek-V3's, and the compiled step, traced.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_agree import assert_backends_agree  # noqa: E402
from models import DictExperts  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend import compiled  # noqa: E402
from strata.mlx_backend import mla as mmla  # noqa: E402
from strata.mlx_backend.kernels import mla as mla_kernel  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, recording, using_path  # noqa: E402
from strata.mlx_backend.kernels.preludes import Dialect  # noqa: E402
from strata.mlx_backend.model import MlxModelState, to_mlx_params  # noqa: E402
from strata.model_config import RopeScaling, TensorNames  # noqa: E402
from strata.reference import mla as ref_mla  # noqa: E402
from strata.reference.attention import rms_norm  # noqa: E402
from strata.testing.models import SHAPES, make_dense, make_expert  # noqa: E402
from strata.reference.model import ModelParams, ModelState  # noqa: E402
from strata.reference.model import forward as ref_forward  # noqa: E402
from tests.kernel_paths import KERNEL_PATHS, emulated, gpu  # noqa: E402


BASE = dataclasses.replace(SHAPES["mla"], max_context=64)
HEADS = {  # (heads, q_lora_rank, kv_lora_rank, rope, nope, v)
    "made_mla": (4, 32, 32, 8, 16, 16),
    "deepseek_v3_heads": (2, 64, 512, 64, 128, 128),
    "no_q_lora": (4, 0, 32, 8, 16, 16),
    "ragged_40_r6": (3, 16, 40, 6, 10, 16),
    "wide_wo_64x160": (64, 16, 32, 8, 16, 160),  # H v = 10240: W_o in two column blocks (8192 + 2048)
}
# on the GPU (marked `gpu`) the made model's heads, whose kernel builds the compiled step's test
# below reuses, and DeepSeek-V3's: every first launch of a specialisation is an NVRTC compile
# (seconds each), so the others, which the emulator runs with the same bodies, stay there
GPU_HEADS = ("made_mla", "deepseek_v3_heads")
CASES = ([pytest.param(name, KernelPath.EMULATED, id=f"{name}-emulated", marks=emulated) for name in HEADS]
         + [pytest.param(name, KernelPath.GPU, id=f"{name}-gpu", marks=gpu) for name in GPU_HEADS])
PROMPT, STEPS = 5, 3
LAYER = 1
RECORDED: list = []  # specialisations launched here, for the compile check


def _cfg(name: str):
    h, ql, c, r, n, v = HEADS[name]
    return BASE.with_fields(n_heads=h, n_kv_heads=h, head_dim=n + r, q_lora_rank=ql, kv_lora_rank=c,
                               qk_rope_head_dim=r, qk_nope_head_dim=n, v_head_dim=v)


def _setup(name: str, seed: int):
    cfg = _cfg(name)
    dense = make_dense(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for k in dense:  # larger queries than the made model's: attention far from uniform, so a wrong score shows
        if "attn_q_b" in k or k.endswith(TensorNames.attn_q):
            dense[k] = rng.normal(0, 0.3, dense[k].shape)
    dense = {k: np.asarray(v, np.float32).astype(np.float16).astype(np.float32) for k, v in dense.items()}
    norm = dense[TensorNames.block(LAYER, TensorNames.attn_norm)]
    xs = rng.standard_normal((PROMPT + STEPS, cfg.hidden_size)).astype(np.float32)
    _, ref = ref_mla.mla(cfg, dense, LAYER, ref_mla.LatentKV.empty(cfg), rms_norm(xs[:PROMPT], norm, cfg.rms_norm_eps))
    w = mmla.mla_weights(cfg, dense, LAYER, mx.float16)
    return cfg, dense, norm, xs, ref, w


def _prefilled(cfg, w, xs) -> mmla.MlxLatentKV:
    """The MLX cache after the prompt (its ops form: T > 1)."""
    _, kv = mmla.mla_partials(cfg, w, mmla.MlxLatentKV.empty(cfg), mx.array(xs[:PROMPT]))
    return kv


def _decode(cfg, w, kv, x, **kw):
    before = sum(LAUNCHES.values())
    parts, kv = mmla.mla_partials(cfg, w, kv, mx.array(x), **kw)
    mx.eval(parts)
    return parts[:, 0], kv, sum(LAUNCHES.values()) - before


@pytest.mark.parametrize("name, path", CASES)
def test_decode_steps_are_the_references(name, path):
    cfg, dense, norm, xs, ref, w = _setup(name, seed=len(name))
    kv = _prefilled(cfg, w, xs)
    assert len(w.wo_blocks) == -(-cfg.n_heads * cfg.mla.v_head_dim // 8192)
    with using_path(path), recording() as rec:
        assert mmla.kernel_applies(cfg, w)
        for i in range(PROMPT, PROMPT + STEPS):
            want, ref = ref_mla.mla(cfg, dense, LAYER, ref, rms_norm(xs[i:i + 1], norm, cfg.rms_norm_eps))
            got, kv, launches = _decode(cfg, w, kv, xs[i:i + 1])
            assert launches == 5 + len(w.wo_blocks)  # a- and q-projections, query, attend, output, W_o blocks
            assert_backends_agree(want, got, "MLA_KERNEL", what=f"{name} position {i}: output")
            assert_backends_agree(ref.latent, kv.latent(cfg), "MLA_KERNEL", what=f"{name} position {i}: cached latents")
            assert_backends_agree(ref.rope_key, kv.rope_key(cfg), "MLA_KERNEL", what=f"{name} position {i}: rope keys")
            assert kv.length == ref.length == i + 1
    RECORDED.extend(r for r in rec if r[0].name.startswith("strata_mla") and r not in RECORDED)


@emulated
def test_yarn_decode_steps_are_the_references():
    """DeepSeek's YaRN (scaled frequencies, cos/sin times the attention factor, the softmax scale
    times mscale^2): the MLX tables and the kernels' folded scale against the reference."""
    name = "made_mla"
    cfg = _cfg(name).with_fields(rope_scaling=RopeScaling.YARN, yarn_factor=4.0, yarn_original_context=16,
                              yarn_attention_factor=1.1, yarn_mscale_all_dim=0.8)
    assert ref_mla.softmax_scale(cfg) > 1.1 * ref_mla.softmax_scale(_cfg(name))
    _, dense, norm, xs, _, w = _setup(name, seed=4)
    _, ref = ref_mla.mla(cfg, dense, LAYER, ref_mla.LatentKV.empty(cfg), rms_norm(xs[:PROMPT], norm, cfg.rms_norm_eps))
    kv = _prefilled(cfg, w, xs)
    assert_backends_agree(ref.rope_key, kv.rope_key(cfg), "MLA_KERNEL", what="prompt rope keys (ops)")
    with using_path(KernelPath.EMULATED):
        for i in range(PROMPT, PROMPT + 2):
            want, ref = ref_mla.mla(cfg, dense, LAYER, ref, rms_norm(xs[i:i + 1], norm, cfg.rms_norm_eps))
            got, kv, launches = _decode(cfg, w, kv, xs[i:i + 1])
            assert launches == 6
            assert_backends_agree(want, got, "MLA_KERNEL", what=f"yarn position {i}")


@emulated
def test_every_split_count_is_the_reference():
    """NS = 1 .. 16 over 6 positions (NS = 8, 16: empty splits, whose max stays NEG_BIG and sum 0)."""
    cfg, dense, norm, xs, ref, w = _setup("made_mla", seed=7)
    want, _ = ref_mla.mla(cfg, dense, LAYER, ref, rms_norm(xs[PROMPT:PROMPT + 1], norm, cfg.rms_norm_eps))
    outs = {}
    with using_path(KernelPath.EMULATED), recording() as rec:
        for ns in (1, 2, 4, 8, 16):
            kv = _prefilled(cfg, w, xs)
            got, _, _ = _decode(cfg, w, kv, xs[PROMPT:PROMPT + 1], splits=ns)
            assert_backends_agree(want, got, "MLA_KERNEL", what=f"{ns} splits")
            outs[ns] = np.array(got)
    assert len({o.tobytes() for o in outs.values()}) > 1  # the splits do change the order of the sums
    RECORDED.extend(r for r in rec if r[0].name.startswith("strata_mla") and r not in RECORDED)


@emulated
def test_every_step_shape_gives_the_same_attention():
    """PB positions a step, HPW heads a warp, NS splits and VW floats a load (the benchmark's
    sweep) against the default kernels' output, which the test above holds to the reference:
    within MLA_KERNEL. VW = 4 on a 40-float row (c 32 + r 8): 10 16-byte loads, lanes 10.. idle."""
    cfg, _, norm, xs, _, w = _setup("made_mla", seed=11)
    rng = np.random.default_rng(3)
    h, c, r = cfg.n_heads, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim
    q = mx.array(rng.standard_normal((1, h * (cfg.mla.qk_nope_head_dim + r))).astype(np.float32))
    kva = mx.array(rng.standard_normal((1, c + r)).astype(np.float32))
    cache = rng.standard_normal((cfg.max_context, c + r)).astype(np.float32)
    cos, sin = mmla.rope_table(cfg)
    pos = 13

    def run(**kw):
        return np.array(mla_kernel.mla_decode(q, kva, w.w_uk, w.w_uv, w.kv_a_norm, cos, sin, mx.array(cache), pos,
                                              eps=1e-6, scale=0.2, **kw))

    with using_path(KernelPath.EMULATED), recording() as rec:
        want = run()
        for pb, hpw, ns, vw in ((1, 1, 1, 1), (2, 2, 4, 1), (8, 4, 2, 1), (4, 2, 1, 1), (3, 1, 8, 1), (4, 1, 2, 4),
                                (2, 2, 4, 4)):
            got = run(positions_per_step=pb, heads_per_warp=hpw, splits=ns, vector_width=vw)
            assert_backends_agree(want, got, "MLA_KERNEL", what=f"PB {pb}, HPW {hpw}, NS {ns}, VW {vw}")
    RECORDED.extend(r for r in rec if r[0].name.startswith("strata_mla") and r not in RECORDED)


@emulated
def test_every_length_takes_one_split_count():
    """MAX_SPLITS at 1, 33 and 257 positions: one attend and one output specialisation for every
    length (each is an NVRTC compile on MLX's CUDA build), the compiled step's too."""
    cfg, _, _, xs, _, w = _setup("made_mla", seed=2)
    with using_path(KernelPath.EMULATED), recording() as rec:
        for pos in (0, 32, 256):
            mx.eval(mla_kernel.mla_decode(mx.ones((1, 4 * 24)), mx.ones((1, 40)), w.w_uk, w.w_uv, w.kv_a_norm,
                                          *mmla.rope_table(dataclasses.replace(cfg, max_context=512)),
                                          mx.zeros((512, 40)), pos, eps=1e-6, scale=1.0))
    attend = {dict(r[3])["NS"] for r in rec if r[0].name == "strata_mla_attend"}
    assert attend == {mla_kernel.MAX_SPLITS}
    assert len({r for r in rec if r[0].name.startswith("strata_mla")}) == 3  # query, attend, output
    assert [mla_kernel.heads_per_block(h) for h in (128, 4, 6, 3)] == [8, 4, 2, 1]


@emulated
def test_the_step_is_deterministic():
    cfg, _, _, xs, _, w = _setup("deepseek_v3_heads", seed=5)
    with using_path(KernelPath.EMULATED):
        a, ka, _ = _decode(cfg, w, _prefilled(cfg, w, xs), xs[PROMPT:PROMPT + 1])
        row_a = np.array(ka.buffer[PROMPT])
        b, kb, _ = _decode(cfg, w, _prefilled(cfg, w, xs), xs[PROMPT:PROMPT + 1])
        np.testing.assert_array_equal(np.array(a), np.array(b))
        np.testing.assert_array_equal(row_a, np.array(kb.buffer[PROMPT]))


@emulated
def test_a_latent_the_kernels_refuse_takes_the_ops_path():
    """c = 12 is no multiple of 8 (the 16-byte weight groups): the layer runs its ops twin, no launch."""
    cfg = _cfg("made_mla").with_fields(kv_lora_rank=12)
    assert not mla_kernel.fits(12, 8) and mla_kernel.fits(512, 64) and not mla_kernel.fits(512, 7)
    w = mmla.mla_weights(cfg, make_dense(cfg, seed=1), LAYER, mx.float16)
    with using_path(KernelPath.EMULATED):
        assert not mmla.kernel_applies(cfg, w)
        _, _, launches = _decode(cfg, w, mmla.MlxLatentKV.empty(cfg), np.ones((1, cfg.hidden_size), np.float32))
        assert launches == 0
        with pytest.raises(ValueError, match="latent 12"):
            mla_kernel.mla_decode(mx.zeros((1, 4 * 24)), mx.zeros((1, 20)), w.w_uk, w.w_uv, w.kv_a_norm,
                                  *mmla.rope_table(cfg), mx.zeros((64, 20)), 0, eps=1e-6, scale=1.0)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_the_compiled_step_runs_latent_layers(path):
    """The compiled decode over the made mla model: on the emulator its device-scalar body
    untraced, on a GPU traced by mx.compile (then replayed with no new launch). From an empty
    state it takes a prompt token by token and then its own greedy tokens, latent layers decoding
    in their kernels with a device position; every step's logits agree with the numpy reference's
    forward over the same weights and experts within FORWARD. Only the compiled step runs (no
    uncompiled forward): on the GPU each kernel specialisation's first launch is an NVRTC compile,
    and the step's are the made model's decode-step test's too (one split count at every length)."""
    cfg = dataclasses.replace(SHAPES["mla"], max_context=64)
    dense = {k: np.asarray(v, np.float32).astype(np.float16).astype(np.float32) for k, v in make_dense(cfg, 3).items()}
    experts = DictExperts({(m, e): make_expert(cfg, 3, m, e, QuantType.Q2_0)
                           for m in range(cfg.n_moe_layers) for e in range(cfg.n_experts)})
    tokens = list(b"latent")
    traced = path is KernelPath.GPU
    ref_params, ref_state = ModelParams(cfg, dense, experts), ModelState.empty(cfg)
    with using_path(path):
        p = to_mlx_params(cfg, dense, experts=experts)
        assert compiled.unsupported(p, traced=traced) is None
        state = MlxModelState.empty(cfg)
        step = compiled.CompiledDecode(p, state, traced=traced)
        n = len(tokens) + 3  # the prompt, then 3 greedy tokens
        for i in range(n):
            want, ref_state = ref_forward(ref_params, ref_state, np.array([tokens[i]]))
            got, state = step(state, tokens[i])
            assert_backends_agree(want[-1], np.array(got[-1]), "FORWARD", what=f"compiled step {i} vs the reference")
            assert state.length == ref_state.length == i + 1
            if i + 1 == len(tokens) < n:
                tokens.append(int(np.argmax(want[-1])))
        assert step.bound_to(state)
        if traced:
            before = sum(LAUNCHES.values())
            logits, _ = step(state, tokens[-1])
            mx.eval(logits)
            assert sum(LAUNCHES.values()) == before  # replayed: the latent buffers are bound, not retraced


@emulated
@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_every_mla_specialisation_compiles(tmp_path, dialect):
    """Compile-checked, not run (Metal): the full Metal and CUDA sources of every shape above."""
    from test_metal_compile import _check

    if len(RECORDED) < 3 * len(HEADS):  # run alone: record them here
        for name in HEADS:
            test_decode_steps_are_the_references(name, KernelPath.EMULATED)
    errors = [e for e in (_check(tmp_path, dialect, s) for s in RECORDED) if e]
    assert not errors, "\n\n".join(errors)
