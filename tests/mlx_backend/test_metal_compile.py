"""Compile-check every kernel specialisation strata launches, as the full Metal and CUDA sources MLX
would build (signature generated from the input/output names, like MLX's write_signature /
build_kernel), with g++ against small stub headers (tests/metal_stub, tests/cuda_stub).

No Metal GPU runs anywhere we test, so this is what catches a Metal-only mistake: a CUDA name in
a shared body, a missing prelude helper, a type MLX's signature does not declare, `uint` in a
body (CUDA has none). The specialisations are recorded while a tiny model runs on the emulated
path (so the check covers exactly what runs, with real template values).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from models import DictExperts
from strata.formats.quant_types import QuantType
from strata.mlx_backend import model as mlx_model
from strata.mlx_backend.experts import routed_partials
from strata.mlx_backend.kernel_plan import KernelPlan, using_plan
from strata.mlx_backend.kernels import q8_gemv
from strata.mlx_backend.kernels import attention as attn_kernels
from strata.mlx_backend.kernels.launch import KernelPath, recording, using_path
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.source import full_source
from strata.model_config import QKNorm, RoutingOrder
from strata.reference.model import ModelParams
from strata.reference.quants import quantize
from strata.testing.models import SHAPES, make_dense, make_expert

TESTS = Path(__file__).resolve().parents[1]
CXX = os.environ.get("CXX", "g++")
pytestmark = pytest.mark.skipif(shutil.which(CXX) is None, reason="no C++ compiler")

STUBS = {Dialect.METAL: TESTS / "metal_stub", Dialect.CUDA: TESTS / "cuda_stub"}


def _model(**overrides) -> ModelParams:
    cfg = SHAPES["tiny"].with_fields(**overrides)
    experts = {(l, e): make_expert(cfg, 0, l, e, QuantType.Q2_0) for l in range(cfg.n_layers) for e in range(cfg.n_experts)}
    return ModelParams(cfg, make_dense(cfg, 0), DictExperts(experts))


@pytest.fixture(scope="module")
def specialisations() -> list:
    """Every (source, dtypes, template) launched by: the forward of three model variants, the
    streaming pieces (host slots, the router with its Q8_0 guess) and the standalone Q8_0 GEMV."""
    with using_path(KernelPath.EMULATED), recording() as rec:
        for over in ({}, dict(shared_ffn_size=0, routing_order=RoutingOrder.TOPK_SOFTMAX, qk_norm=QKNorm.NONE),
                     dict(attention_bias=True, shared_expert_gated=False)):
            params = _model(**over)
            mp = mlx_model.from_reference(params)
            for cross_block in (True, False):  # CUDA's forms (blocks counting on one another), then Metal's
                with using_plan(KernelPlan(chained_launches=cross_block)):
                    logits, state = mlx_model.forward(mp, mlx_model.MlxModelState.empty(params.cfg), np.array([1, 2, 3]))
                    logits, _ = mlx_model.forward(mp, state, np.array([4]))  # a decoded token: the chained QKV
                    mx.eval(logits)
        with pytest.MonkeyPatch.context() as m:  # past SPLIT_FROM: the split attention's chain (CUDA's)
            m.setattr(attn_kernels, "SPLIT_FROM", 2)
            logits, state = mlx_model.forward(mp, mlx_model.MlxModelState.empty(params.cfg), np.array([1, 2, 3]))
            mx.eval(mlx_model.forward(mp, state, np.array([4]))[0])
        x = mx.array(np.ones((1, params.cfg.hidden_size), np.float32))
        mx.eval(routed_partials(mp.arena.array, mp.rec, x, np.array([[0, 5, -1, 2]]), np.ones((1, 4), np.float32)))
        parts = mx.zeros((1, params.cfg.n_heads, params.cfg.hidden_size))
        mx.eval(*[a for a in mlx_model.router_stage(mp, 0, x, parts, mp.layers[1].guess) if a is not None])
        m = quantize(QuantType.Q8_0, np.ones((16, 64), np.float32))
        mx.eval(q8_gemv.q8_gemv(mx.array(m.codes), mx.array(m.scales), x))
    assert len(rec) >= 8
    return rec


def _check(tmp_path: Path, dialect: Dialect, spec) -> str | None:
    src, in_types, out_types, template = spec
    code = full_source(src, dialect, in_types, out_types, template)
    f = tmp_path / f"{src.name}_{abs(hash(spec)) % 10**8}.{dialect.value}.cpp"
    f.write_text(code)
    proc = subprocess.run([CXX, "-fsyntax-only", "-std=c++17", "-x", "c++", "-Wno-attributes", "-Wno-unknown-pragmas",
                           "-I", str(STUBS[dialect]), str(f)], capture_output=True, text=True)
    return None if proc.returncode == 0 else f"{src.name} {template}:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("dialect", [Dialect.METAL, Dialect.CUDA], ids=["metal", "cuda"])
def test_every_kernel_source_compiles(tmp_path, specialisations, dialect):
    runs = [s for s in specialisations if dialect is not Dialect.METAL or s[0].metal]  # CUDA-only sources apart
    assert len(runs) >= 8
    errors = [e for e in (_check(tmp_path, dialect, s) for s in runs) if e]
    assert not errors, "\n\n".join(errors)


def test_the_checked_sources_include_folded_outputs(specialisations):
    """Unread outputs folded into one buffer (folded_outputs.py): the gate/up launch (every
    dialect) and the attention chain (CUDA's) are checked in that form."""
    folded = {s[0].name for s in specialisations if "folded" in s[0].outputs}
    assert "strata_moe_gateup" in folded
    assert any(n.startswith("strata_chain_") for n in folded), sorted(folded)
    # ... and the down step reading gate/up's buffer (moe_decode.routed_residual)
    assert "strata_moe_down_warps" in {s[0].name for s in specialisations if "packed" in s[0].inputs}


def test_the_checked_sources_include_the_split_chain(specialisations):
    """Past SPLIT_FROM the QKV GEMV, the split attention, its merge and the router as one launch
    (kernels/attend_split.py, CUDA's form) is among the sources checked."""
    names = {s[0].name for s in specialisations}
    assert any("attend_split_chained_merge_project_router" in n for n in names), sorted(names)


def test_metal_signature_declares_what_the_body_uses(specialisations):
    """MLX adds a Metal attribute parameter only when its name is in the body: the body prelude
    must name every id it uses, and inputs stay in `device` space (>= 8 elements each)."""
    src, in_types, out_types, template = specialisations[0]
    code = full_source(src, Dialect.METAL, in_types, out_types, template)
    for attr in ("thread_position_in_threadgroup", "threadgroup_position_in_grid", "thread_index_in_simdgroup",
                 "simdgroup_index_in_threadgroup"):
        assert f"[[{attr}]]" in code
    assert "const constant" not in code


def test_a_cuda_only_name_in_a_shared_body_fails_the_metal_check(tmp_path, specialisations):
    """The check has teeth: the same body with a CUDA intrinsic does not compile as Metal."""
    src, in_types, out_types, template = specialisations[0]
    bad = replace(src, name=src.name + "_bad", body=src.body + "\n  __syncthreads();\n")
    assert _check(tmp_path, Dialect.METAL, (bad, in_types, out_types, template)) is not None
    uint_body = replace(src, name=src.name + "_uint")
    with pytest.raises(ValueError, match="uint32_t"):
        replace(uint_body, body=uint_body.body + "\n  uint n = 0;\n")
