"""A llama.cpp GGUF whose types mix per layer and projection, as unsloth's dynamic quants mix them
(tests/gguf_models.UD_MIX: Q4_K gate/up with a Q5_1 down, an IQ4_NL layer, an MXFP4 layer, a
Q6_K / Q8_0 / BF16 layer; Q6_K dense weights), written with gguf's writer in llama.cpp's layout and converted with every expert
kept as stored (a version 3 `.experts` file) and every dense matrix kept in its Q6_K. Against the reference forward on the `gguf`
package's own dequantization of the same file (converted from those float32 values): the same
logits bit for bit and the same 32 greedy tokens, all-resident and streamed at the smallest legal
arena (strata's dequantization is gguf's bit for bit, tests/reference/test_ggml_quants.py, so nothing
else may differ). MLX, which has no kernels for these types, refuses the file in one line."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import strata
from engine_kinds import EXACT0, open_kind
from mlx_agree import assert_backends_agree
from strata.config import Backend
from strata.convert import convert
from strata.engines import open_engine, resolve_backend
from strata.errors import ConfigError
from strata.formats.quant_types import QuantType
from strata.reference.model import ModelState, forward
from strata.reference.quants import to_blocks
from tests import gguf_models, hf_models
from tests.convert_parity import greedy_run

GREEDY_TOKENS = 32
KEPT = {"MXFP4": QuantType.GGML_MXFP4}  # ggml names whose strata type is spelled otherwise


def _qtype(name: str) -> QuantType:
    return KEPT.get(name, QuantType[name] if name in QuantType.__members__ else None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    work = tmp_path_factory.mktemp("ud_mix")
    hf_dir = gguf_models.build_wide_checkpoint(work / "hf", layers=len(gguf_models.UD_MIX))
    path = gguf_models.write_gguf(hf_dir, work / "ud.gguf", experts=gguf_models.UD_MIX, dense="Q6_K")
    kept = convert(path, work / "kept")
    dequantized = gguf_models.dequantized_checkpoint(path, hf_dir, work / "dequantized")  # gguf's values
    ref = convert(dequantized, work / "f32", expert_type=QuantType.F32)
    a, b = strata.load(kept.model_path), strata.load(ref.model_path)
    yield path, kept, a, b
    a.close()
    b.close()


def test_every_expert_is_kept_as_stored_with_its_own_type(models):
    path, r, model, _ = models
    want = tuple(tuple(_qtype(n) for n in layer) for layer in gguf_models.UD_MIX)
    h = model.experts_file.header
    assert r.expert_type is None and r.expert_layer_types == want and r.requant_kld is None
    assert (h.version, h.layer_qtypes) == (3, want)
    assert "Q4_K" in r.experts_described and "as stored" in r.experts_described
    assert h.padded_bytes == max(model.experts_file.layer_layout(l).padded_bytes for l in range(h.n_layers))
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for layer in range(h.n_layers):
        for e in range(h.n_experts):
            w = model.experts_file.expert(layer, e)
            for proj, g in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
                stored = np.asarray(tensors[f"blk.{layer}.{g}.weight"].data)[e]
                assert to_blocks(w.projection(proj)).tobytes() == np.ascontiguousarray(stored).tobytes()


def test_dense_matrices_are_kept_as_stored(models):
    """Every dense matrix but the routers (F32 by the format's rule) is the GGUF's Q6_K, byte for byte."""
    from strata.formats.gguf_file import open_gguf

    path, r, _, _ = models
    assert r.dense_kept and r.dense_described == "as stored"
    ours, theirs = open_gguf(r.model_path), open_gguf(path)
    try:
        matrices = [n for n, t in ours.tensors.items() if len(t.shape) == 2 and "ffn_gate_inp" not in n]
        assert len(matrices) >= 2 + 4 * len(gguf_models.UD_MIX)  # embedding, head, q/k/v/o per layer
        for name in matrices:
            assert ours.tensors[name].ggml_type == int(QuantType.Q6_K), name
            assert ours.raw(ours.tensors[name]).tobytes() == theirs.raw(theirs.tensors[name]).tobytes(), name
    finally:
        ours.close()
        theirs.close()


def test_dense_q6_k_is_held_as_stored(models):
    """Loaded, the Q6_K matrices stay in their bytes (0.82 bytes a weight, not float32's 4): the
    CPU kernels compute on them, other paths widen per use."""
    from strata.formats.dense_weights import StoredType, as_dense_weights

    _, _, model, _ = models
    dense = as_dense_weights(model.dense)
    matrices = [n for n in dense if len(dense.stored(n).shape) == 2 and "ffn_gate_inp" not in n]
    assert len(matrices) >= 2 + 4 * len(gguf_models.UD_MIX)
    assert all(dense.stored_type(n) is StoredType.Q6_K for n in matrices), {n: dense.stored_type(n) for n in matrices}


def test_logits_equal_the_reference_on_gguf_s_dequantized_weights(models):
    _, _, model, ref = models
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    assert list(tokens) == list(ref.tokenizer.encode(hf_models.PARITY_TEXT))
    ours, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    theirs, _ = forward(ref.resident_params(), ModelState.empty(ref.cfg), tokens)
    np.testing.assert_array_equal(ours, theirs)  # the same float32 weights, the same arithmetic



@pytest.mark.parametrize("kind", ["reference", "numpy-min"])
def test_greedy_tokens_identical_resident_and_at_the_smallest_arena(models, kind):
    """On the float32 products (cpu_kernels off) the engines compute the reference's arithmetic:
    bit for bit. With the compiled CPU kernels (the default: the experts of every compiled type in
    the mix, the Q6_K dense matrices) the same tokens, logits within FORWARD."""
    _, _, model, ref = models
    prompt = list(model.tokenizer.encode("The quick brown fox"))
    exact = EXACT0.replace(cpu_kernels=False)
    with open_kind(ref, "reference", exact) as eng:
        want_tokens, want_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
    with open_kind(model, kind, exact) as eng:
        got_tokens, got_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
    assert got_tokens == want_tokens
    np.testing.assert_array_equal(got_logits, want_logits)
    with open_kind(model, kind) as eng:
        fast_tokens, fast_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
    assert fast_tokens == want_tokens
    for step, (fast, want) in enumerate(zip(fast_logits, want_logits)):
        assert_backends_agree(want, fast, "FORWARD", what=f"{kind} step {step}")


def test_mlx_refuses_mixed_types_in_one_line_and_auto_picks_numpy(models):
    _, _, model, _ = models
    pytest.importorskip("mlx.core")
    with pytest.raises(ConfigError) as err:
        open_engine(model, EXACT0.replace(backend=Backend.MLX), stream=False)
    msg = str(err.value)
    assert "\n" not in msg and "mix" in msg and "Q4_K" in msg and "backend='numpy'" in msg  # the Python API's spelling
    assert resolve_backend(model, EXACT0) is Backend.NUMPY


def test_auto_on_a_gpu_machine_says_numpy_computes_these_experts(models, monkeypatch):
    """Where MLX has a GPU, `--backend auto` still runs this model on numpy (MLX has no kernels
    for its types) and the stream report says why, in one line; never a silent change of engine."""
    import strata.engines as engines
    from engine_kinds import min_slots

    _, _, model, _ = models
    monkeypatch.setattr(engines, "mlx_gpu_available", lambda: True)
    config = EXACT0.replace(arena=f"{min_slots(model)}slots")
    assert resolve_backend(model, config) is Backend.NUMPY
    with open_engine(model, config, stream=True) as eng:
        eng.prefill(list(model.tokenizer.encode("The quick brown fox")))
        eng.decode(1)
        io = eng.report().io
    assert "backend auto: numpy computes these experts" in io and "Q5_1" in io
