"""MLX holds dense weights as stored (strata/mlx_backend/dense.py): the bytes it keeps are the
file's on the ops path, its logits are bit-identical there to float32 weights widened at load,
and the kernel paths (the C++ emulator here, the GPU where there is one) run a Q8_0 model's
matrices through the Q8_0 GEMV within FORWARD of the reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import strata  # noqa: E402
from engine_kinds import EXACT0, agree, open_kind  # noqa: E402
from mlx_agree import assert_backends_agree  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend.dense import Q8Dense, linear, rows  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, using_path  # noqa: E402
from strata.mlx_backend.model import MlxModelState, dense_nbytes, forward, from_reference, to_mlx_params  # noqa: E402
from strata.numpy_backend.engine import ReferenceEngine  # noqa: E402
from strata.reference.model import ModelParams  # noqa: E402
from strata.testing.models import make_model  # noqa: E402
from tests.kernel_paths import KERNEL_PATHS  # noqa: E402
from tests.widened_weights import widened_file_tensors  # noqa: E402

PROMPT = np.frombuffer(b"def fibonacci(n):\n    return", np.uint8).astype(np.int64)


@pytest.fixture(scope="module", params=[QuantType.F16, QuantType.Q8_0], ids=lambda q: q.name)
def stored_model(request, tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("mlxdense") / "m", "tiny", seed=4, dense_type=request.param)
    return request.param, made


@pytest.mark.parametrize("dense_type", [QuantType.F16, QuantType.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("shape", ["hybrid", "mla"])
def test_other_mixers_hold_their_projections_as_stored(shape, dense_type, tmp_path):
    """DeltaNet's and latent attention's projections are held as stored too, and the ops path's
    logits stay bit-identical to float32 at load (MLA's kv_b, split per head, is widened)."""
    made = make_model(tmp_path / shape, shape, seed=6, dense_type=dense_type)
    with strata.load(made.model_path) as m, using_path(KernelPath.OPS):
        experts = m.resident_params().experts
        now = from_reference(ModelParams(m.cfg, m.dense, experts))
        before = from_reference(ModelParams(m.cfg, widened_file_tensors(made.model_path)[1], experts))
        a, _ = forward(now, MlxModelState.empty(m.cfg), PROMPT)
        b, _ = forward(before, MlxModelState.empty(m.cfg), PROMPT)
        np.testing.assert_array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))
        assert dense_nbytes(now) < 0.75 * dense_nbytes(before)


def test_ops_path_holds_the_files_dense_bytes(stored_model):
    qtype, made = stored_model
    with strata.load(made.model_path) as m, using_path(KernelPath.OPS):
        p = to_mlx_params(m.cfg, m.dense, pred_q8=False)
        assert dense_nbytes(p) == m.dense.nbytes  # every tensor as the file stores it, none twice
        kind = Q8Dense if qtype is QuantType.Q8_0 else mx.array
        assert isinstance(p.layers[0].attn.wqkv, kind) and isinstance(p.embed, kind)
        if qtype is QuantType.F16:
            assert p.layers[0].attn.wqkv.dtype == mx.float16 and p.embed.dtype == mx.float16
        widened = to_mlx_params(m.cfg, widened_file_tensors(made.model_path)[1], pred_q8=False)
        assert dense_nbytes(widened) > 1.5 * dense_nbytes(p)  # what float32 at load held


def test_ops_path_logits_are_bit_identical_to_float32_at_load(stored_model):
    """The ops path widened every weight per op already: holding them as stored changes no bit."""
    _, made = stored_model
    with strata.load(made.model_path) as m, using_path(KernelPath.OPS):
        experts = m.resident_params().experts
        now = from_reference(ModelParams(m.cfg, m.dense, experts))
        before = from_reference(ModelParams(m.cfg, widened_file_tensors(made.model_path)[1], experts))
        (a, sa), (b, sb) = forward(now, MlxModelState.empty(m.cfg), PROMPT), forward(before, MlxModelState.empty(m.cfg), PROMPT)
        np.testing.assert_array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))
        a, _ = forward(now, sa, [7])
        b, _ = forward(before, sb, [7])
        np.testing.assert_array_equal(np.array(a).view(np.uint32), np.array(b).view(np.uint32))


@pytest.mark.parametrize("kind", ["mlx-resident", "mlx-min"])
def test_mlx_engines_on_stored_dense_agree_with_the_reference(stored_model, kind):
    _, made = stored_model
    with strata.load(made.model_path) as m:
        ref = ReferenceEngine(m.resident_params())
        eng = open_kind(m, kind, EXACT0)
        try:
            agree(kind, ref.prefill(PROMPT), eng.prefill(PROMPT), "prefill")
            for tok in (5, 17, 99):
                agree(kind, ref.decode(tok), eng.decode(tok), f"decode {tok}")
        finally:
            eng.close()


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_q8_0_matrices_on_a_kernel_path(path, tmp_path):
    """A Q8_0 model on a kernel path: its matrices stay Q8Dense (the stored bytes), the Q8_0 GEMV
    and the row lookup match the widened matrix, and the model's logits are within FORWARD of
    the reference (prompt, then decodes)."""
    made = make_model(tmp_path / "q8", "tiny", seed=5, dense_type=QuantType.Q8_0)
    with strata.load(made.model_path) as m, using_path(path):
        p = to_mlx_params(m.cfg, m.dense, experts=m.resident_params().experts, pred_q8=False)
        w = p.layers[0].attn.wqkv
        assert isinstance(w, Q8Dense) and dense_nbytes(p) <= m.dense.nbytes  # 1-D tensors float16 here
        x = mx.array(np.random.default_rng(0).standard_normal((3, w.shape[1])).astype(np.float32))
        assert_backends_agree(np.array(x) @ np.array(w.widen()).T, linear(x, w), "FORWARD", what="Q8_0 GEMV")
        ids = mx.array(np.array([3, 0, 3], np.int32))
        np.testing.assert_array_equal(np.array(rows(p.embed, ids)), np.array(p.embed.widen())[[3, 0, 3]])
        ref = ReferenceEngine(m.resident_params())
        logits, state = forward(p, MlxModelState.empty(m.cfg), PROMPT)
        assert_backends_agree(ref.prefill(PROMPT), np.array(logits[-1]), "FORWARD", what="prefill")
        for tok in (5, 17):
            logits, state = forward(p, state, [tok])
            assert_backends_agree(ref.decode(tok), np.array(logits[-1]), "FORWARD", what=f"decode {tok}")


@pytest.mark.parametrize("kind", ["mlx-resident", "mlx-min"])
def test_each_mlx_engine_holds_the_stored_bytes(stored_model, kind):
    """What the MLX engine holds for its dense weights: the file's bytes on the ops path (the
    resident engine keeps no read-ahead copies; the streaming one adds the Q8_0 router copies
    pred_q8 reads), never more than float16 for every matrix on a kernel path."""
    _, made = stored_model
    with strata.load(made.model_path) as m, using_path(KernelPath.OPS):
        eng = open_kind(m, kind, EXACT0)
        try:
            params = eng.params if kind == "mlx-resident" else eng.compute.params
            guesses = sum(lw.guess.w.nbytes + lw.guess.codes.nbytes + lw.guess.raw_scales.nbytes
                          + lw.guess.scales.nbytes + lw.guess.biases.nbytes for lw in params.layers if lw.guess is not None)
            assert dense_nbytes(params) == m.dense.nbytes + guesses
        finally:
            eng.close()


@pytest.mark.parametrize("stored", ["F16", "BF16", "Q8_0"])
def test_held_weights_widen_to_the_stored_values(stored):
    """`held` on the ops path keeps the stored type (BF16 as bfloat16, Q8_0 as its planes) and
    widens to exactly StoredTensor.widen's values; on a kernel path every float type is float16."""
    from strata.formats.dense_weights import StoredTensor, StoredType
    from strata.mlx_backend.dense import held, widen

    st = StoredType[stored]
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType(st.value))
    t = StoredTensor.from_gguf(st, raw.view(np.uint8), x.shape)
    w = held(t, mx.float32)
    assert int(w.nbytes) == t.nbytes
    np.testing.assert_array_equal(np.array(widen(w)).view(np.uint32), t.widen().view(np.uint32))
    if st is not StoredType.Q8_0:
        assert held(t, mx.float16).dtype == mx.float16


def test_the_prompt_path_refuses_q8_0_dense_matrices(stored_model):
    """The prompt path's float16 matmuls take float16 weights: a Q8_0 model's prompts take the
    regular path (its refusal names why), an F16 model's are served."""
    from strata.mlx_backend.prompt import prompt_refusal

    qtype, made = stored_model
    with strata.load(made.model_path) as m:
        p = to_mlx_params(m.cfg, m.dense, experts=m.resident_params().experts, pred_q8=False)
        why = prompt_refusal(p)
        assert (why == "Q8_0 dense matrices") if qtype is QuantType.Q8_0 else why is None


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_project_reads_a_float16_matrix_through_the_gemv_for_a_few_positions(path, monkeypatch):
    """dense.project: up to GEMV_ROWS positions of a float16 matrix take the float16 GEMV (no
    float32 copy of the weights), more take `linear`; both within FAST of float32 products."""
    from strata.mlx_backend import dense

    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((48, 64)).astype(np.float16))
    launches = []
    inner = dense.f16_kernel.dense_gemv
    monkeypatch.setattr(dense.f16_kernel, "dense_gemv", lambda *a, **k: launches.append(1) or inner(*a, **k))
    for t, gemv in ((1, 1), (dense.GEMV_ROWS, 1), (dense.GEMV_ROWS + 1, 0)):
        x = rng.standard_normal((t, 64)).astype(np.float32)
        launches.clear()
        with using_path(path):
            got = np.array(dense.project(mx.array(x), w))
        assert len(launches) == gemv, t
        assert_backends_agree(x @ np.array(w, np.float32).T, got, "FAST", what=f"{t} positions")


def test_column_blocks_hold_the_matrix_as_stored_in_pieces():
    """dense.held_column_blocks: each block held as `held` holds the whole (its type, its bytes),
    and the blocks side by side are the whole matrix's values."""
    from strata.formats.dense_weights import StoredTensor, StoredType
    from strata.mlx_backend.dense import held, held_column_blocks, widen
    from strata.reference.quants import quantize

    x = np.random.default_rng(5).standard_normal((6, 128)).astype(np.float32)
    q = quantize(QuantType.Q8_0, x)
    f16 = StoredTensor(StoredType.F16, x.shape, x.astype(np.float16))
    q8 = StoredTensor(StoredType.Q8_0, x.shape, q.codes.reshape(6, 128).view(np.int8), q.scales.reshape(6, 4)
                      .astype(np.float16))
    for t in (x, f16, q8):
        whole, blocks = held(t, mx.float32), held_column_blocks(t, mx.float32, 64)
        assert len(blocks) == 2 and all(type(b) is type(whole) and b.shape == (6, 64) for b in blocks)
        assert sum(b.nbytes for b in blocks) == whole.nbytes
        np.testing.assert_array_equal(np.concatenate([np.array(widen(b)) for b in blocks], axis=1),
                                      np.array(widen(whole)))
    with pytest.raises(ValueError, match="whole blocks"):
        held_column_blocks(x, mx.float32, 48)
