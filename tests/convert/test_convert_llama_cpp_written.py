"""`strata convert` of GGUF files llama.cpp wrote itself (tests/fixtures/llama_cpp/, made by
scripts/make_llama_cpp_fixtures.py: llama.cpp's own convert_hf_to_gguf.py on the repo's tiny
checkpoints, then its llama-quantize with per-tensor overrides to UD-like mixes: IQ3_S / IQ2_XXS /
Q4_K / IQ4_NL / Q4_0 / Q4_1 / Q5_0 gate and up with IQ4_NL / Q5_1 / Q8_0 downs, Q4_K / Q5_K /
Q6_K / IQ4_XS / Q8_0 / Q5_0 dense, MXFP4, across qwen3moe, deepseek2, gpt-oss, qwen3next,
qwen2moe, olmoe, minimax-m2, glm4moe, qwen35moe and qwen4exp with its Q8_0 n-gram table). Each converts with every expert kept in its stored type; its
logits equal the reference forward on the `gguf` package's dequantization of the same file
within GGUF_DEQUANT_LOGIT_BUDGET; 32 greedy tokens of the default engine (compiled CPU kernels),
all-resident and streamed at the smallest legal arena, are the reference's on those weights. Run
in place (`strata generate file.gguf`, nothing converted), each file's logits and 32 greedy tokens
at the smallest legal arena are its conversion's, bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import strata
from engine_kinds import EXACT0, open_kind
from strata.convert import convert
from strata.formats.quant_types import QuantType
from strata.reference.model import ModelState, forward
from strata.reference.quants import to_blocks
from tests import hf_models
from tests.budgets import GGUF_DEQUANT_LOGIT_BUDGET
from tests.llama_cpp_fixtures import CASES, dequantized_gguf
from tests.convert_parity import greedy_run

GREEDY_TOKENS = 32
STRATA_NAMES = {"MXFP4": "GGML_MXFP4"}  # ggml names strata spells otherwise


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def models(request, tmp_path_factory):
    case = request.param
    work = tmp_path_factory.mktemp(case.name)
    # a PLE model's n-gram rows as F32: the stored Q8_0 rows' values exactly (the default f16 rounds them)
    kept = convert(case.path, work / "kept", ngram_type=QuantType.F32)
    ref = convert(dequantized_gguf(case.path, work / "dequantized.gguf"), work / "f32", expert_type=QuantType.F32,
                  ngram_type=QuantType.F32)
    a, b = strata.load(kept.model_path), strata.load(ref.model_path)
    yield case, kept, a, b
    a.close()
    b.close()


def test_the_file_holds_the_recipe_s_types(models):
    """The fixture is what its recipe says (llama-quantize applied every override)."""
    case = models[0]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(case.path).tensors}
    assert {name: types.get(name) for name, _ in case.expected} == dict(case.expected)


def test_every_expert_is_kept_in_its_stored_type(models):
    case, r, model, _ = models
    assert r.requant_kld is None  # nothing requantized
    tensors = {t.name: t for t in gguf.GGUFReader(case.path).tensors}
    h = model.experts_file.header
    for i, layer in enumerate(model.cfg.moe_layers):
        for proj in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            stored_type = QuantType[STRATA_NAMES.get(t.tensor_type.name, t.tensor_type.name)]
            assert model.experts_file.layer_layout(i).qtype_of(proj) is stored_type
            stored = np.asarray(t.data)
            for e in (0, h.n_experts - 1):
                got = to_blocks(model.experts_file.expert(i, e).projection(proj))
                assert got.tobytes() == np.ascontiguousarray(stored[e]).tobytes(), (layer, e, proj)


def test_logits_equal_the_reference_on_gguf_s_dequantized_weights(models):
    case, _, model, ref = models
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    assert list(tokens) == list(ref.tokenizer.encode(hf_models.PARITY_TEXT))
    ours, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    theirs, _ = forward(ref.resident_params(), ModelState.empty(ref.cfg), tokens)
    rel = float(np.abs(ours - theirs).max()) / float(np.abs(theirs).max())
    print(f"\n{case.name}: max|Δlogit|/scale vs the reference on gguf's dequantized weights = {rel:.2e}")
    assert rel <= GGUF_DEQUANT_LOGIT_BUDGET



@pytest.mark.parametrize("kind", ["reference", "numpy-min"])
def test_32_greedy_tokens_equal_the_reference_s(models, kind):
    """The default configuration (compiled CPU kernels where a type has one), all-resident and
    streamed at the smallest legal arena, against the float32 reference on the dequantized file."""
    _, _, model, ref = models
    prompt = list(model.tokenizer.encode("The quick brown fox"))
    with open_kind(ref, "reference", EXACT0.replace(cpu_kernels=False)) as eng:
        want = greedy_run(eng, prompt, GREEDY_TOKENS)[0]
    with open_kind(model, kind) as eng:
        got = greedy_run(eng, prompt, GREEDY_TOKENS)[0]
    assert got == want



def test_the_file_run_in_place_is_its_conversion_s_run(models):
    """The file as llama.cpp wrote it, read in place (experts from its stacked tensors, dense
    weights as its conversion holds them), streamed at the smallest legal arena with the default
    configuration: 32 greedy tokens and every step's logits equal the conversion's, bit for bit."""
    case, _, kept, _ = models
    prompt = list(kept.tokenizer.encode("The quick brown fox"))
    with open_kind(kept, "numpy-min", strata.Config()) as eng:
        want_tokens, want_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
    with strata.load(case.path) as in_place:
        assert in_place.experts_file.path == str(case.path) and in_place.cfg == kept.cfg
        # a PLE model's n-gram table is read as rows of its stored type from the same file
        assert (kept.ngrams_file is None) == (in_place.ngrams_file is None)
        assert in_place.ngrams_file is None or in_place.ngrams_file.path == str(case.path)
        with open_kind(in_place, "numpy-min", strata.Config()) as eng:
            got_tokens, got_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
            assert eng.io.bytes_read > 0 and eng.io.errors == 0
    assert got_tokens == want_tokens
    np.testing.assert_array_equal(got_logits, want_logits)
