"""Dense weights kept as stored (strata/formats/dense_weights.py): widening gives exactly gguf's
values, a loaded model holds the file's bytes, the numpy engines' logits are bit-identical to
float32-at-load weights, and a Q8_0 model's peak memory is below its float32 size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import strata
from engine_kinds import EXACT0, open_kind
from strata.formats.dense_weights import DenseWeights, StoredTensor, StoredType, stored_bytes
from strata.formats.quant_types import QuantType
from strata.model_config import TensorNames, dense_tensor_shapes
from strata.numpy_backend.engine import ReferenceEngine
from strata.reference.model import ModelParams
from strata.testing.models import make_model
from strata.testing.ggml_random import random_block_matrix
from tests.budgets import PEAK_RSS_SHARE_OF_F32
from tests.widened_weights import widened_file_tensors

ROOT = Path(__file__).resolve().parents[2]
PROMPT = np.frombuffer(b"def fibonacci(n):\n    return", np.uint8).astype(np.int64)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("stored", list(StoredType), ids=lambda t: t.name)
def test_widen_is_ggufs_dequantize_bit_for_bit(stored):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 64)) * rng.choice([1e-3, 1.0, 300.0], (6, 1))).astype(np.float32)
    x[0, :5] = [0.0, -0.0, 65000.0, -1e-7, 1e-30]  # zero signs, near-overflow, subnormal in f16
    ggml = gguf.GGMLQuantizationType(stored.value)
    if stored.whole_blocks:  # llama.cpp's block types: gguf has no quantizer for them; random blocks
        x = np.zeros((6, 512), np.float32)
        raw = random_block_matrix(stored.quant_type, 6, 512, rng).codes
    else:
        raw = gguf.quants.quantize(x, ggml)
    want = np.asarray(gguf.quants.dequantize(raw, ggml), np.float32).reshape(x.shape)
    t = StoredTensor.from_gguf(stored, raw if raw.dtype == np.uint8 else raw.view(np.uint8), x.shape)
    np.testing.assert_array_equal(_bits(t.widen()), _bits(want))
    ids = np.array([5, 0, 0, 3])
    np.testing.assert_array_equal(_bits(t.widen_rows(ids)), _bits(want[ids]))
    assert t.nbytes == raw.nbytes  # held in the stored bytes, not float32's


def test_dense_weights_hold_what_they_are_given():
    f32 = np.arange(64, dtype=np.float32).reshape(2, 32)
    t = StoredTensor(StoredType.F16, (2, 32), f32.astype(np.float16))
    d = DenseWeights({"a": f32, "b": t})
    assert d["a"] is f32 and d.stored("b") is t and d.stored_type("b") is StoredType.F16
    assert d.stored_type("a") is None
    assert d.nbytes == f32.nbytes + t.codes.nbytes == stored_bytes({"a": f32, "b": t})
    np.testing.assert_array_equal(d.rows("b", np.array([1])), f32[1:])
    with pytest.raises(ValueError, match="codes must be float16"):
        StoredTensor(StoredType.F16, (2, 32), f32)


@pytest.fixture(scope="module", params=[QuantType.F16, QuantType.Q8_0], ids=lambda q: q.name)
def stored_model(request, tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("dense") / "m", "tiny", seed=2, dense_type=request.param)
    return request.param, made


def test_a_loaded_model_holds_the_files_dense_bytes(stored_model):
    qtype, made = stored_model
    stored, before = widened_file_tensors(made.model_path)
    with strata.load(made.model_path) as m:
        assert m.dense.nbytes == stored
        assert stored < 0.6 * sum(a.nbytes for a in before.values())  # F16: ~1/2, Q8_0: ~1/4 of float32
        kinds = {m.dense.stored_type(n) for n in dense_tensor_shapes(m.cfg)}
        assert StoredType[qtype.name] in kinds and None in kinds  # matrices as stored, 1-D float32
        embd = TensorNames.token_embd
        np.testing.assert_array_equal(_bits(m.dense[embd]), _bits(before[embd]))


@pytest.mark.parametrize("kind", ["reference", "numpy-min", "numpy-full"])
def test_numpy_engine_logits_are_bit_identical_to_float32_at_load(stored_model, kind):
    """Prompt, then decodes: every position's logits equal, bit for bit, the reference engine's
    over the float32 weights the loader used to hold. On the float32 products (cpu_kernels off):
    the compiled Q8_0 products are held to these within a budget in tests/numpy_backend/test_numpy_quant_kernels.py."""
    _, made = stored_model
    _, before = widened_file_tensors(made.model_path)
    with strata.load(made.model_path) as m:
        want = ReferenceEngine(ModelParams(m.cfg, before, m.resident_params().experts))
        got = open_kind(m, kind, EXACT0.replace(cpu_kernels=False))
        try:
            np.testing.assert_array_equal(_bits(got.prefill(PROMPT)), _bits(want.prefill(PROMPT)))
            for tok in (5, 17, 99, 3):
                np.testing.assert_array_equal(_bits(got.decode(tok)), _bits(want.decode(tok)), err_msg=f"token {tok}")
        finally:
            got.close()


PEAK_CHILD = r"""
import json, sys
import numpy as np
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import gguf, tokenizers  # what loading imports late: in the base, not counted as weights
import strata
from strata.numpy_backend.engine import ReferenceEngine
base = rss("VmRSS:")
m = strata.load(sys.argv[1])
eng = ReferenceEngine(m.resident_params())
eng.prefill(np.arange(8))
for t in range(4):
    eng.decode(t)
print(json.dumps({"base": base, "peak": rss("VmHWM:"), "dense": m.dense.nbytes}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM (Linux)")
@pytest.mark.parametrize("dense_type", [QuantType.Q8_0, QuantType.F32], ids=lambda q: q.name)
def test_peak_memory_of_a_q8_0_model_is_below_its_float32_size(tmp_path, dense_type):
    """A made model whose dense part is 120 MB in float32, loaded and run in a fresh process:
    with Q8_0 dense its peak grows by under PEAK_RSS_SHARE_OF_F32 of that (the stored 32 MB and
    the one tensor a matmul widens at a time); the same model with F32 dense grows by at least
    the float32 size (the measurement sees what it should)."""
    made = make_model(tmp_path / "big", "tiny", dense_type=dense_type, hidden_size=1024, n_heads=8, n_kv_heads=8,
                      head_dim=128, shared_ffn_size=1024, n_layers=4, n_experts=8, expert_ffn_size=32)
    f32 = sum(int(np.prod(s)) * 4 for s in dense_tensor_shapes(made.cfg).values())
    out = subprocess.run([sys.executable, "-c", PEAK_CHILD, str(made.model_path)], capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["peak"] - r["base"]
    if dense_type is QuantType.Q8_0:
        assert r["dense"] < 0.3 * f32
        assert grew < PEAK_RSS_SHARE_OF_F32 * f32, f"peak grew {grew / 1e6:.1f} MB, float32 dense is {f32 / 1e6:.1f} MB"
    else:
        assert grew >= f32


@pytest.mark.parametrize("kind", ["reference", "numpy-min"])
def test_each_numpy_engine_holds_the_stored_bytes(stored_model, kind):
    """The engine's dense weights are the loaded ones as stored (not a widened copy)."""
    _, made = stored_model
    stored, _ = widened_file_tensors(made.model_path)
    with strata.load(made.model_path) as m:
        eng = open_kind(m, kind, EXACT0)
        try:
            params = eng.params if kind == "reference" else eng.compute.params
            assert params.dense.nbytes == stored
            assert params.dense.stored(TensorNames.token_embd) is m.dense.stored(TensorNames.token_embd)
        finally:
            eng.close()
