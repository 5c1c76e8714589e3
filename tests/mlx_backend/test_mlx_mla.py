"""The MLX latent attention (mlx_backend/mla.py) against the reference (reference/mla.py): one
layer, both forms and the chosen one, a prompt then decodes, the cache holding the reference's
latent and rope key, trim; the made 'mla' model through the MLX resident and streaming engines
within FORWARD; the compiled decode taking latent layers on kernel paths only."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import strata  # noqa: E402
from engine_kinds import agree, open_kind  # noqa: E402
from mlx_agree import assert_backends_agree  # noqa: E402
from models import DictExperts  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend import compiled  # noqa: E402
from strata.mlx_backend.kernels import emulate  # noqa: E402
from strata.mlx_backend.kernels.launch import KernelPath, using_path  # noqa: E402
from strata.mlx_backend.mla import MlxLatentKV, mla, mla_weights  # noqa: E402
from strata.mlx_backend.model import MlxModelState, mixer_partials, to_mlx_params  # noqa: E402
from strata.reference import mla as ref_mla  # noqa: E402
from strata.testing.models import SHAPES, make_dense, make_expert, make_model  # noqa: E402

CFG = SHAPES["mla"]
PROMPT = list(b"latent attention, decoded")


def fp16_exact(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


@pytest.fixture(scope="module")
def dense():
    d = make_dense(CFG, 1)
    rng = np.random.default_rng(0)
    for name in d:  # larger queries than the made model's: attention far from uniform, so a wrong score shows
        if "attn_q_b" in name:
            d[name] = rng.normal(0, 0.3, d[name].shape)
    return {k: fp16_exact(v) for k, v in d.items()}  # so float16 MLX weights hold the reference's values


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("absorbed", [None, True, False], ids=["chosen", "absorbed", "expanded"])
def test_prompt_then_decodes_agree_with_the_reference(dense, dtype, absorbed):
    x = np.random.default_rng(1).normal(0, 1, (12, CFG.hidden_size)).astype(np.float32)
    w = mla_weights(CFG, dense, 1, dtype)
    kv_r, kv_f = ref_mla.LatentKV.empty(CFG), MlxLatentKV.empty(CFG)
    for lo, hi in ((0, 8), (8, 9), (9, 10), (10, 12)):  # a prompt, two decodes, a two-position chunk
        r, kv_r = ref_mla.mla(CFG, dense, 1, kv_r, x[lo:hi], absorbed=absorbed)
        f, kv_f = mla(CFG, w, kv_f, mx.array(x[lo:hi]), absorbed=absorbed)
        assert_backends_agree(r, f, "FAST", what=f"positions {lo}..{hi}")
    assert kv_f.length == 12 and kv_f.buffer.shape == (CFG.max_context, CFG.mla.kv_lora_rank + CFG.mla.qk_rope_head_dim)
    assert_backends_agree(kv_r.latent, kv_f.latent(CFG), "FAST", what="cached latent")
    assert_backends_agree(kv_r.rope_key, kv_f.rope_key(CFG), "FAST", what="cached rope key")


def test_trim_then_continue_is_the_reference(dense):
    x = np.random.default_rng(2).normal(0, 1, (9, CFG.hidden_size)).astype(np.float32)
    w = mla_weights(CFG, dense, 2, mx.float32)
    whole, state = ref_mla.mla(CFG, dense, 2, ref_mla.LatentKV.empty(CFG), x)
    _, kv = mla(CFG, w, MlxLatentKV.empty(CFG), mx.array(x))
    kv, kv_r = kv.trim(5), state.trim(5)
    assert kv.length == 5
    y = x * 0.5  # other positions 5..8 than the first pass wrote: the trimmed rows are written over
    for t in range(5, 9):
        f, kv = mla(CFG, w, kv, mx.array(y[t:t + 1]))
        r, kv_r = ref_mla.mla(CFG, dense, 2, kv_r, y[t:t + 1])
        assert_backends_agree(r, f, "FAST", what=f"decode at {t} after trim(5)")
    assert not np.allclose(np.array(f), whole[8:9], atol=1e-3)  # the new rows, not the trimmed ones, were read


def test_the_compiled_decode_takes_latent_layers_on_a_kernel_path_only(dense):
    """Latent layers decode in their kernels with a device position (tests/mlx_backend/test_mlx_mla_kernel.py);
    on the ops path, which slices the cache by the Python length, a device position is refused."""
    experts = DictExperts({(m, e): make_expert(CFG, 1, m, e, QuantType.Q2_0)
                           for m in range(CFG.n_moe_layers) for e in range(CFG.n_experts)})
    with using_path(KernelPath.OPS):
        p = to_mlx_params(CFG, dense, experts=experts)
        assert "ops path" in compiled.unsupported(p, traced=False)
        with pytest.raises(ValueError, match="device position"):
            mixer_partials(p, 0, MlxLatentKV.empty(CFG), mx.zeros((1, CFG.hidden_size)), pos=mx.array([0]))
    if emulate.available():
        with using_path(KernelPath.EMULATED):
            p = to_mlx_params(CFG, dense, experts=experts)
            assert compiled.unsupported(p, traced=False) is None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("mla") / "mla", "mla", seed=5, dense_type=QuantType.F16)
    m = strata.load(made.model_path)
    yield m
    m.close()


@pytest.mark.parametrize("kind", ["mlx-resident", "mlx-min"])
def test_mlx_engines_agree_with_the_reference(model, kind):
    with open_kind(model, "reference") as ref:
        want = [ref.prefill(PROMPT)] + [ref.decode(t) for t in PROMPT[:4]]
        ref.trim(len(PROMPT) - 3)
        want += [ref.decode(t) for t in PROMPT[4:7]]
    with open_kind(model, kind) as eng:
        got = [eng.prefill(PROMPT)] + [eng.decode(t) for t in PROMPT[:4]]
        eng.trim(len(PROMPT) - 3)
        got += [eng.decode(t) for t in PROMPT[4:7]]
    agree(kind, np.stack(want), np.stack(got), f"mla, {kind}")


def test_column_blocks_of_a_llama_cpp_block_type_are_its_widened_columns():
    """A GGUF's Q6_K dense matrix (held as stored: rows of 256-weight blocks) is cut into column
    blocks from its widened values, never by slicing its block bytes."""
    from strata.formats.dense_weights import StoredTensor, StoredType
    from strata.mlx_backend.kernels import dense_gemv
    from strata.mlx_backend.mla import _column_blocks
    from strata.testing.ggml_random import random_block_matrix

    cols = dense_gemv.MAX_COLS + 256  # two column blocks, the second a super-block wide
    m = random_block_matrix(QuantType.Q6_K, 4, cols, np.random.default_rng(0))
    t = StoredTensor(StoredType.Q6_K, (4, cols), m.codes)
    got = np.concatenate([np.asarray(b) for b in _column_blocks(t, mx.float32)], axis=1)
    np.testing.assert_array_equal(got, t.widen())
