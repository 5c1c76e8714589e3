"""Bucketed shapes (strata/mlx_backend/shape_buckets.py) in the Q2_0 grouped GEMM (GroupedGemm.Q2_MMA):
the bucket set is small and fixed, and a bucketed group capacity changes no real row's result (bit
for bit against the exact capacity, and the reference's per-token experts within FAST), while the
kernel's template row count M takes only bucket values over many prompt sizes."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_agree import assert_backends_agree
from strata.formats.expert_record import RecordLayout
from strata.formats.quant_types import QuantType
from strata.mlx_backend import grouped
from strata.mlx_backend.experts import stack_experts
from strata.mlx_backend.grouped import GroupedGemm, grouped_experts
from strata.mlx_backend.kernel_plan import KernelPlan, using_plan
from strata.mlx_backend.kernels import emulate
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path
from strata.mlx_backend.shape_buckets import LINEAR_FROM, MIN_BUCKET, bucket
from strata.reference.experts import routed_experts
from strata.testing.models import SHAPES, make_expert

CFG = replace(SHAPES["tiny"], hidden_size=64, expert_ffn_size=96, n_experts=5)


def test_bucket_set_is_small_fixed_and_covers():
    values = [bucket(n) for n in range(0, 20481)]  # the seed shape's pairs of a 2048-token prompt
    assert all(b >= n for n, b in enumerate(values))
    assert all(a <= b for a, b in zip(values, values[1:]))  # monotone
    assert all(bucket(b) == b for b in set(values))  # a bucket is its own bucket
    assert all(b < 2 * max(n, MIN_BUCKET) for n, b in enumerate(values))
    assert all(b - n < LINEAR_FROM for n, b in enumerate(values) if n > LINEAR_FROM)
    assert len(set(values)) <= 5 + 20480 // LINEAR_FROM
    with pytest.raises(ValueError):
        bucket(-1)


def _case(t: int, k: int, seed: int):
    rec = RecordLayout(QuantType.Q2_0, CFG.hidden_size, CFG.expert_ffn_size)
    experts = [make_expert(CFG, 0, 0, e, QuantType.Q2_0) for e in range(CFG.n_experts)]
    records, _ = stack_experts(experts, rec)
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((t, CFG.hidden_size)).astype(np.float32)
    ids = np.stack([rng.choice(CFG.n_experts, k, replace=False) for _ in range(t)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    ref = np.stack([routed_experts([experts[int(e)] for e in ids[i]], wts[i], h[i]) for i in range(t)])
    return rec, records, h, ids, wts, ref


def _run(monkeypatch, bucketed: bool, gemm: GroupedGemm, dtype, case):
    """grouped_experts with the group cap in a bucket (its default), or exact (no bucket)."""
    rec, records, h, ids, wts, _ = case
    monkeypatch.setattr(grouped, "bucket", bucket if bucketed else (lambda n: n))
    return np.array(grouped_experts(records, rec, mx.array(h), mx.array(ids), mx.array(wts), dtype=dtype,
                                    gemm=gemm))


@pytest.mark.skipif(not emulate.available(), reason="no C++ compiler")
def test_q2_mma_template_rows_take_bucket_values(monkeypatch):
    """Q2_MMA (emulated): over prompts of 9..41 tokens the kernel's template M is a bucket (P x
    bucket(cap)), fewer distinct values than the exact caps give, and each result equals the
    exact cap's bit for bit."""
    def rows_seen(seen) -> set[int]:
        return {dict(tpl)["M"] for src, _, _, tpl in seen if src.name == "strata_q2_mma"}

    exact_m, bucket_m = set(), set()
    with using_path(KernelPath.EMULATED):
        for t in (9, 17, 26, 33, 41):
            case = _case(t, 3, 100 + t)
            with recording() as seen:
                exact = _run(monkeypatch, False, GroupedGemm.Q2_MMA, mx.float16, case)
            exact_m |= rows_seen(seen)
            with recording() as seen:
                got = _run(monkeypatch, True, GroupedGemm.Q2_MMA, mx.float16, case)
            bucket_m |= rows_seen(seen)
            np.testing.assert_array_equal(got, exact)
            assert_backends_agree(case[-1], got, "FAST", what=f"q2_mma, bucketed cap, T={t}")
    p = 2  # lowp.py's two terms a row
    assert all(m % p == 0 and bucket(m // p) == m // p for m in bucket_m)
    assert len(bucket_m) < len(exact_m)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape", ("tiny", "hybrid", "mla"))
def test_prompt_attention_bucketed_positions(shape, dtype):
    """A first prompt chunk's attention padded to bucket(T) positions (prompt_attention's
    the kernel plan's bucket_positions): every position's logits against the reference (FORWARD for float32 weights,
    PROMPT for float16 matmul inputs) and against the unpadded path (FAST), the KV cache holding
    the real positions only, then a continuation (never padded) after them."""
    from strata.mlx_backend.model import MlxModelState, from_reference
    from strata.mlx_backend.prompt import prompt_forward
    from strata.reference import model as ref_model
    from test_mlx_prompt import made_params

    rp = made_params(shape)
    t = 21  # bucket 32: 11 padded rows
    tokens = np.random.default_rng(5).integers(0, rp.cfg.vocab_size, t + 3)
    ref, _ = ref_model.forward(rp, ref_model.ModelState.empty(rp.cfg), tokens)
    runs = {}
    with using_path(KernelPath.OPS):
        p = from_reference(rp, dtype=getattr(mx, dtype))
        for padded in (False, True):
            with using_plan(KernelPlan(bucket_positions=padded)):
                got, state = prompt_forward(p, MlxModelState.empty(rp.cfg), tokens[:t], all_logits=True)
                more, state = prompt_forward(p, state, tokens[t:])
            runs[padded] = (np.array(got), np.array(more), state)
    budget = "FORWARD" if dtype == "float32" else "PROMPT"
    got, more, state = runs[True]
    assert state.length == len(tokens)
    assert_backends_agree(ref[:t], got, budget, what=f"{shape}: padded prompt")
    assert_backends_agree(ref[-1:], more, budget, what=f"{shape}: continuation after a padded prompt")
    assert_backends_agree(runs[False][0], got, "FAST", what=f"{shape}: padded vs unpadded")
    for kv, exact in zip(state.layers, runs[False][2].layers):
        if hasattr(kv, "keys"):  # the cache past the positions held is untouched (zeros)
            np.testing.assert_array_equal(np.array(kv.keys[:, len(tokens):]), 0)
            assert_backends_agree(np.array(exact.keys[:, :len(tokens)]), np.array(kv.keys[:, :len(tokens)]), "FAST",
                                  what=f"{shape}: cached keys")
