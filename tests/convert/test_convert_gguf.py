"""`strata convert` of llama.cpp GGUF files (tests/gguf_models.py writes them from the tiny
trained checkpoints in llama.cpp's layout with gguf's writer and quantizers): experts kept
bit for bit in their own types, requantized with the KLD printed when --experts asks; logits
equal transformers' forward on the GGUF's dequantized weights (checked in under tests/fixtures/gguf/
with the digest of the weights they are for: tests/hf_fixtures.py); the tokenizer rebuilt from
tokenizer.ggml.* encodes like the original; `strata generate` on a GGUF that is not strata's."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests import gguf_models, hf_fixtures, hf_models  # noqa: E402
from strata.cli.main import main  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.errors import FormatError  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.reference.model import ModelState, forward  # noqa: E402
from strata.reference.quants import to_blocks  # noqa: E402
from tests.budgets import F16_LOGIT_BUDGET, GGUF_DEQUANT_LOGIT_BUDGET, Q2_KLD_SANITY, REQUANT_ARGMAX_AGREEMENT  # noqa: E402

# gguf_models.CASES with the strata type the experts must end up as
CASES = [(arch, experts, dense, kept and QuantType[kept]) for arch, experts, dense, kept in gguf_models.CASES]


def _case_name(case: tuple) -> str:
    return gguf_models.case_id(case) + ("-requantized" if case[3] is None else "")


@pytest.fixture(scope="module", params=CASES, ids=_case_name)
def converted(request, tmp_path_factory):
    arch, experts, dense, kept = request.param
    hf_dir, _ = hf_models.cached_checkpoint(arch, tmp_path_factory)
    work = tmp_path_factory.mktemp(f"gguf_{arch}_{experts}")
    path = gguf_models.write_gguf(hf_dir, work / "model.gguf", experts=experts, dense=dense)
    r = convert(path, work / "strata", expert_type=None if kept else QuantType.Q8_0)
    return request.param, hf_dir, path, r, work


def _transformers_on_dequantized(case: tuple, path, hf_dir, out) -> np.ndarray:
    """transformers' logits [T, V] on the GGUF's dequantized weights: the checked-in ones, once
    the weights are shown to be the ones they were computed from."""
    want = hf_fixtures.gguf_expected(gguf_models.case_id(case))
    ref_dir = gguf_models.dequantized_checkpoint(path, hf_dir, out)
    assert gguf_models.weights_digest(ref_dir) == want.weights_digest, (
        f"the dequantized weights of {gguf_models.case_id(case)} changed (the gguf package's quantizers, "
        "tests/gguf_models.py or the checkpoint): run `python scripts/make_hf_fixtures.py --gguf`")
    return want.logits


def test_experts_kept_or_requantized_with_kld(converted):
    (arch, experts, dense, kept), _, path, r, _ = converted
    model = load(r.model_path)
    if kept is None:
        assert r.expert_type is QuantType.Q8_0
        line = r.requant_kld.line(r.expert_type)
        print(f"\n{arch} {experts}: {line}")
        assert "mean KLD" in line and 0 <= r.requant_kld.kld < Q2_KLD_SANITY
        return
    assert r.requant_kld is None and model.experts_file.header.qtype is kept
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for layer in range(model.cfg.n_layers):
        for e in range(model.cfg.n_experts):
            w = model.experts_file.expert(layer, e)
            for proj, g in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
                stored = np.asarray(tensors[f"blk.{layer}.{g}.weight"].data)[e]
                assert to_blocks(w.projection(proj)).tobytes() == np.ascontiguousarray(stored).tobytes()


def test_logits_match_the_dequantized_weights(converted):
    (arch, experts, dense, kept), hf_dir, path, r, work = converted
    model = load(r.model_path)
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    theirs = _transformers_on_dequantized(converted[0], path, hf_dir, work / "dequantized")
    assert theirs.shape == (len(tokens), model.cfg.vocab_size)
    ours, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    scale = float(np.abs(theirs).max())
    rel = float(np.abs(ours - theirs).max()) / scale
    print(f"\n{arch} experts {experts} dense {dense}: max|dlogit|/scale vs transformers on the dequantized "
          f"GGUF = {rel:.2e}")
    if kept is not None:  # the same weight values on both sides
        assert rel <= GGUF_DEQUANT_LOGIT_BUDGET
    else:  # requantized experts: the KLD test bounds it; the argmax mostly agrees
        assert float(np.mean(ours.argmax(-1) == theirs.argmax(-1))) >= REQUANT_ARGMAX_AGREEMENT


def test_tokenizer_rebuilt_from_gguf_encodes_like_the_original(converted):
    _, hf_dir, _, r, _ = converted
    from tokenizers import Tokenizer

    original = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    model = load(r.model_path)
    for text in (hf_models.PARITY_TEXT, "Hello,  world!\tnaïve café 🙂 <|im_start|>user\nhi<|im_end|>"):
        assert list(model.tokenizer.encode(text)) == original.encode(text).ids


def test_generate_on_a_llama_cpp_gguf_runs_it_in_place(converted, capsys):
    """No conversion needed (strata/convert/gguf_in_place.py; tests/convert/test_gguf_in_place.py
    holds it to the converted run bit for bit)."""
    from strata.formats.expert_pieces import PieceStore

    _, _, path, _, work = converted
    with load(path) as model:
        assert isinstance(model.experts_file, PieceStore)
    assert main(["generate", str(path), "hi", "-n", "2"]) == 0
    assert capsys.readouterr().out.strip()


def test_k_quant_gguf_converts_with_kld_and_matches_dequantized_weights(tmp_path, capsys):
    """Q4_K experts requantized on request (here to f16, the KLD line printed) and Q6_K dense
    weights (dequantized), on a model wide enough for QK_K = 256 rows."""
    from strata.cli.main import main as cli

    hf_dir = gguf_models.build_wide_checkpoint(tmp_path / "hf")
    _, experts, dense = gguf_models.WIDE_CASE
    path = gguf_models.write_gguf(hf_dir, tmp_path / "k.gguf", experts=experts, dense=dense)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"Q4_K", "Q6_K"} <= types
    r = convert(path, tmp_path / "strata", expert_type=QuantType.F16)
    assert r.requant_kld is not None and r.requant_kld.source_types == ("Q4_K",)
    print(f"\n{r.requant_kld.line(r.expert_type)}")
    assert 0 <= r.requant_kld.kld < Q2_KLD_SANITY
    model = load(r.model_path)
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    theirs = _transformers_on_dequantized(gguf_models.WIDE_CASE, path, hf_dir, tmp_path / "dequantized")
    assert theirs.shape == (len(tokens), model.cfg.vocab_size)
    ours, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    rel = float(np.abs(ours - theirs).max()) / float(np.abs(theirs).max())
    print(f"Q4_K experts (-> f16), Q6_K dense: max|dlogit|/scale vs transformers on the dequantized GGUF = {rel:.2e}")
    assert rel <= F16_LOGIT_BUDGET  # f16 experts of the dequantized values: the f16 budget
    # the CLI prints the KLD line
    capsys.readouterr()
    assert cli(["convert", str(path), str(tmp_path / "cli"), "--experts", "q8_0", "--quiet"]) == 0
    assert "experts requantized Q4_K -> Q8_0: mean KLD" in capsys.readouterr().out


@pytest.mark.parametrize("experts", ["Q8_0", "F16"])
def test_a_non_finite_block_copied_through_is_refused_naming_the_tensor(tmp_path, tmp_path_factory, capsys, experts):
    """The pass-through path (GGUF blocks kept as stored) checks values as the Hugging Face path
    does: a Q8_0 block whose scale is NaN, or an F16 weight that is inf, is refused in one line
    naming the layer, expert and projection, and nothing is written."""
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    path = gguf_models.write_gguf(hf_dir, tmp_path / "m.gguf", experts=experts)
    target = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_up_exps.weight")
    expert, expert_bytes = 2, int(np.asarray(target.data)[0].nbytes)
    poison = np.float16(np.nan if experts == "Q8_0" else np.inf).tobytes()  # a Q8_0 block starts with its scale
    with open(path, "r+b") as f:
        f.seek(int(target.data_offset) + expert * expert_bytes + (0 if experts == "Q8_0" else 6))
        f.write(poison)
    with pytest.raises(FormatError, match=r"layer 1 expert 2 up projection: \d+ non-finite values"):
        convert(path, tmp_path / "out")
    assert not list(tmp_path.glob("out*"))
    assert main(["convert", str(path), str(tmp_path / "cli"), "--quiet"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expert 2 up projection" in err[0] and "non-finite" in err[0]


def test_dense_kept_as_stored_equals_dense_widened_to_f32(tmp_path_factory):
    """A llama-architecture (Mixtral) GGUF with Q8_0 dense matrices: kept as stored (the default;
    Q/K rows un-permuted as whole rows of blocks) and written as F32 (--dense f32) give the same
    logits bit for bit: the same values, one file 3.8x smaller in its dense part."""
    hf_dir, _ = hf_models.cached_checkpoint("mixtral", tmp_path_factory)
    work = tmp_path_factory.mktemp("gguf_mixtral_dense")
    path = gguf_models.write_gguf(hf_dir, work / "m.gguf", experts="Q8_0", dense="Q8_0")
    kept, wide = convert(path, work / "kept"), convert(path, work / "wide", dense_type=QuantType.F32)
    assert kept.dense_kept and not wide.dense_kept
    assert kept.model_path.stat().st_size < wide.model_path.stat().st_size
    a, b = load(kept.model_path), load(wide.model_path)
    tokens = np.asarray(a.tokenizer.encode(hf_models.PARITY_TEXT))
    ours, _ = forward(a.resident_params(), ModelState.empty(a.cfg), tokens)
    theirs, _ = forward(b.resident_params(), ModelState.empty(b.cfg), tokens)
    np.testing.assert_array_equal(ours, theirs)
