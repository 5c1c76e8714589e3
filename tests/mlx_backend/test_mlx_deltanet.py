"""The MLX gated DeltaNet against the reference: the recurrent step, the chunked prompt form
(several chunks and a ragged last one), the whole mixer with its snapshots, on the ops path
(float32 weights: only the order of float32 sums differs, FAST) and on the default path."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx_agree import assert_backends_agree  # noqa: E402
from strata.mlx_backend import deltanet as mdn  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, using_path  # noqa: E402
from strata.mlx_backend.model import to_mlx_params  # noqa: E402
from strata.reference import deltanet as rdn  # noqa: E402
from strata.reference.attention import rms_norm  # noqa: E402
from strata.model_config import TensorNames  # noqa: E402
from strata.testing.models import SHAPES, make_dense  # noqa: E402

CFG = SHAPES["hybrid"]
HV, DK, DV = CFG.deltanet.linear_v_heads, CFG.deltanet.linear_k_head_dim, CFG.deltanet.linear_v_head_dim


def _inputs(t: int, seed: int = 0):
    """Normed q/k, v, log decays and betas like the mixer's, [Hv, T, d]."""
    rng = np.random.default_rng(seed)
    q = rdn.l2norm(rng.standard_normal((HV, t, DK)).astype(np.float32)) * np.float32(DK ** -0.5)
    k = rdn.l2norm(rng.standard_normal((HV, t, DK)).astype(np.float32))
    v = rng.standard_normal((HV, t, DV)).astype(np.float32)
    g = -rng.uniform(0.0, 1.5, (HV, t)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (HV, t)).astype(np.float32)
    s = (rng.standard_normal((HV, DK, DV)) * 0.3).astype(np.float32)
    return s, q, k, v, g, beta


def _reference(s, q, k, v, g, beta):
    outs = []
    for t in range(q.shape[1]):
        o, s = rdn.gated_delta_step(s, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(o)
    return np.stack(outs, axis=1), s


@pytest.mark.parametrize("t", [1, 5, 64, 150])
def test_recurrent_and_chunked_forms_are_the_reference(t):
    args = _inputs(t, seed=t)
    want_o, want_s = _reference(*args)
    m = [mx.array(a) for a in args]
    o, states = mdn.recurrent(*m)
    assert_backends_agree(want_o, o, "FAST", what=f"recurrent o, T={t}")
    assert_backends_agree(want_s, states[-1], "FAST", what=f"recurrent state, T={t}")
    o, s = mdn.chunked(*m)
    assert_backends_agree(want_o, o, "FAST", what=f"chunked o, T={t}")
    assert_backends_agree(want_s, s, "FAST", what=f"chunked state, T={t}")


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("t", [1, 7, 130])
def test_the_mixer_and_its_snapshots_are_the_references(t, window):
    cfg = dataclasses.replace(CFG, max_context=512)
    dense = make_dense(cfg, seed=1)
    rng = np.random.default_rng(2)
    x0 = rng.standard_normal((9, cfg.hidden_size)).astype(np.float32)
    x = rng.standard_normal((t, cfg.hidden_size)).astype(np.float32)
    norm = dense[TensorNames.block(0, TensorNames.attn_norm)]
    ref0 = rdn.deltanet(cfg, dense, 0, rdn.DeltaNetState.empty(cfg), rms_norm(x0, norm, cfg.rms_norm_eps))[1]
    want, ref = rdn.deltanet(cfg, dense, 0, ref0, rms_norm(x, norm, cfg.rms_norm_eps), window=window)
    with using_path(KernelPath.OPS):
        p = to_mlx_params(cfg, dense, pred_q8=False)
        w = p.layers[0].attn
        _, st0 = mdn.deltanet_partials(cfg, w, mdn.empty_state(cfg), mx.array(x0))
        parts, st = mdn.deltanet_partials(cfg, w, st0, mx.array(x), window=window)
    assert_backends_agree(want, parts.sum(axis=1), "FAST", what=f"mixer output T={t} window={window}")
    assert st.kept_positions == ref.kept_positions and st.length == ref.length
    for a, b in zip(ref.kept, st.kept):
        assert_backends_agree(a.recurrent, b.recurrent, "FAST", what=f"snapshot {a.position}")
        assert_backends_agree(a.conv, b.conv, "FAST", what=f"conv snapshot {a.position}")  # projection sums reordered
