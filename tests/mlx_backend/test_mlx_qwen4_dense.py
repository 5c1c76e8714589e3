"""Qwen4-Exp's dense weights on MLX as stored (mlx_backend/dense.py, through the hyper-connection
residual of mlx_backend/residual.py), as every family's are: MLX holds the file's dense bytes
(less the n-gram tables, which the PLE row source holds), no matrix but the routers widened to
float32; its logits on the ops path are bit-identical to float32 weights widened at load (what
the ops twin held before); and the engines, and the kernel paths (the C++ emulator here, the GPU
where there is one), agree with the reference within FORWARD."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import strata  # noqa: E402
from engine_kinds import min_slots  # noqa: E402
from mlx_agree import assert_backends_agree  # noqa: E402
from strata.config import Backend, Config  # noqa: E402
from strata.families.qwen4_exp import Qwen4Names, ple_layers  # noqa: E402
from strata.formats.dense_weights import StoredTensor  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend.dense import Q8Dense  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, using_path  # noqa: E402
from strata.mlx_backend.model import MlxModelState, dense_arrays, dense_nbytes, forward, from_reference  # noqa: E402
from strata.mlx_backend.model import to_mlx_params  # noqa: E402
from strata.model_config import TensorNames  # noqa: E402
from strata.reference.model import ModelParams, ModelState  # noqa: E402
from strata.reference.model import forward as reference_forward  # noqa: E402
from strata.reference.ple import resident_rows  # noqa: E402
from strata.testing.models import make_model  # noqa: E402
from tests.kernel_paths import KERNEL_PATHS  # noqa: E402
from tests.widened_weights import widened_file_tensors  # noqa: E402

MLX = Config(backend=Backend.MLX, moce_lambda=0.0)


@pytest.fixture(scope="module", params=[QuantType.F16, QuantType.Q8_0], ids=lambda q: q.name)
def stored(request, tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("q4dense") / "qwen4", "qwen4", seed=4, dense_type=request.param,
                      expert_type=QuantType.Q2_0)
    m = strata.load(made.model_path)
    yield request.param, made, m
    m.close()


def _tokens(m) -> np.ndarray:
    eos = m.cfg.qwen4.ngram_eos_token
    return np.asarray(list(b"def fib(n):") + [eos] + list(b" return fib(n - 1)"))


def _tables(cfg) -> set[str]:
    return {TensorNames.block(l, Qwen4Names.ple_ngram) for l in ple_layers(cfg)}


def test_mlx_holds_the_files_dense_bytes(stored):
    qtype, _, m = stored
    cfg = m.cfg
    with using_path(KernelPath.OPS):
        p = to_mlx_params(cfg, m.dense, pred_q8=False)
    tables = _tables(cfg)
    assert dense_nbytes(p) == m.dense.nbytes - sum(m.dense.stored(n).nbytes for n in tables)
    kind = Q8Dense if qtype is QuantType.Q8_0 else mx.array
    deltanet, indexed = (next(l for l, t in enumerate(cfg.kinds) if t.mixer.value == v)
                         for v in ("deltanet", "indexed_attention"))
    ple = ple_layers(cfg)[0]
    held = [p.embed, p.output, p.layers[deltanet].attn.w_in, p.layers[deltanet].attn.wo, p.layers[indexed].attn.wq,
            p.layers[indexed].attn.idx_qk, p.layers[indexed].attn.wo, *p.layers[0].hyper.hc_attn.down,
            p.layers[ple].hyper.ple.key, p.layers[0].shared.gate, p.layers[0].shared.down]
    assert all(isinstance(w, kind) for w in held)
    if qtype is QuantType.F16:
        assert all(w.dtype == mx.float16 for w in held)
    # no matrix widened: float32 ones are the routers (float32 by design) and what the file stores as F32
    routers = {id(lw.router) for lw in p.layers}
    widened = sum(a.nbytes for a in dense_arrays(p) if a.dtype == mx.float32 and a.ndim == 2 and id(a) not in routers)
    file_f32 = sum(m.dense.stored(n).nbytes for n in m.dense
                   if not isinstance(m.dense.stored(n), StoredTensor) and m.dense.stored(n).ndim == 2
                   and n not in tables and not n.endswith(TensorNames.router))
    assert widened == file_f32


def test_ops_logits_are_bit_identical_to_float32_at_load(stored):
    _, made, m = stored
    experts = m.resident_params().experts
    rows = resident_rows(m.cfg, m.dense)
    with using_path(KernelPath.OPS):
        now = from_reference(ModelParams(m.cfg, m.dense, experts))
        before = from_reference(ModelParams(m.cfg, widened_file_tensors(made.model_path)[1], experts))
        a, _ = forward(now, MlxModelState.empty(m.cfg), _tokens(m), rows=rows)
        b, _ = forward(before, MlxModelState.empty(m.cfg), _tokens(m), rows=rows)
    np.testing.assert_array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))
    assert dense_nbytes(now) < 0.75 * dense_nbytes(before)


@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streaming"])
def test_engines_agree_with_the_reference(stored, stream):
    _, _, m = stored
    tokens = _tokens(m)
    whole, _ = reference_forward(m.resident_params(), ModelState.empty(m.cfg), tokens)
    config = MLX.replace(arena=f"{min_slots(m, MLX)}slots") if stream else MLX
    with strata.open_engine(m, config, stream=stream) as engine:
        got = [engine.prefill(tokens[:10])] + [engine.decode(int(t)) for t in tokens[10:20]]
        assert_backends_agree(whole[9:20], np.stack(got), "FORWARD", what="prefill + decode")
        assert_backends_agree(whole[20:], engine.decode_window(tokens[20:]), "FORWARD", what="window")


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_kernel_paths_agree_with_the_reference(stored, path):
    """On a kernel path the stored matrices take the backend's kernels where they apply (the
    Q8_0 GEMV, the DeltaNet step over float16 weights, the shared expert's), the rest MLX ops."""
    _, _, m = stored
    tokens = _tokens(m)[:14]
    params = m.resident_params()
    whole, _ = reference_forward(params, ModelState.empty(m.cfg), tokens)
    rows = resident_rows(m.cfg, m.dense)
    with using_path(path):
        p = from_reference(params)
        prompt, state = forward(p, MlxModelState.empty(m.cfg), tokens[:8], rows=rows)
        got = [np.array(prompt)]
        for t in tokens[8:]:
            logits, state = forward(p, state, [int(t)], rows=rows)
            got.append(np.array(logits))
    assert_backends_agree(whole, np.concatenate(got), "FORWARD", what=f"{path.value} path")
