"""`strata convert` of Hugging Face FP8 checkpoints (block-wise e4m3 + weight_scale_inv).

- the e4m3fn decoder (strata/formats/float8.py) against ml_dtypes on all 256 codes and against
  values derived by hand from the bit layout;
- every fixture family, its linear weights quantized offline in the published layout
  (tests/fp8_checkpoints.py, [128, 128] blocks, ragged at the edges of the tiny shapes): the FP8
  checkpoint converts, and its logits equal bit for bit those of the float32 checkpoint of its
  dequantized weights (made with ml_dtypes, not strata's decoder), both converted with f32 experts;
- small ragged blocks, bfloat16 and power-of-two (F8_E8M0) scales, fused [E, rows, cols] experts;
- against the dequantized model rounded to bfloat16 (what transformers' `dequantize=True`
  loads), on Qwen3-MoE: mean KLD within FP8_BF16_KLD_BUDGET and the same greedy tokens;
- a requantization (q8_0 experts) prints its KLD; bad FP8 checkpoints are refused in one line.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: it reads these once
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers")
ml_dtypes = pytest.importorskip("ml_dtypes")

from strata.cli.main import main  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.convert.fp8_checkpoint import Fp8Checkpoint, Fp8Quantization  # noqa: E402
from strata.errors import ConfigError, FormatError  # noqa: E402
from strata.formats.float8 import E4M3_MAX, E4M3FN_VALUES, e4m3fn_to_f32  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.generate import generate  # noqa: E402
from strata.loader import load  # noqa: E402
from tests import fp8_checkpoints, hf_fixtures  # noqa: E402
from tests.budgets import FP8_BF16_KLD_BUDGET, Q2_KLD_SANITY  # noqa: E402
from tests.convert_parity import assert_refused_in_one_line, mean_kld, parity_tokens, reference_logits  # noqa: E402
from tests.hf_fixtures import GREEDY_STEPS, PROMPT_TOKENS  # noqa: E402

# every fixture but the one already quantized (gpt-oss's MXFP4 experts)
FP8_ARCHS = tuple(a for a in hf_fixtures.fixture_archs() if a != "gpt_oss_mxfp4")


# ---------------------------------------------------------------- the decoder


def test_e4m3fn_decoder_matches_ml_dtypes_on_all_256_codes():
    codes = np.arange(256, dtype=np.uint8)
    theirs = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ours = e4m3fn_to_f32(codes)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs))
    finite = ~np.isnan(theirs)
    assert np.array_equal(ours[finite].view(np.uint32), theirs[finite].view(np.uint32))  # -0.0 included


def test_e4m3fn_decoder_matches_hand_derived_values():
    by_hand = {0x00: 0.0, 0x01: 2.0**-9, 0x07: 7 * 2.0**-9, 0x08: 2.0**-6, 0x30: 0.5, 0x38: 1.0, 0x39: 1.125,
               0x3F: 1.875, 0x40: 2.0, 0x77: 240.0, 0x78: 256.0, 0x7E: 448.0, 0x80: -0.0, 0xB8: -1.0, 0xFE: -448.0}
    for code, value in by_hand.items():
        got = E4M3FN_VALUES[code]
        assert got == value and np.signbit(got) == np.signbit(value), hex(code)
    assert np.isnan(E4M3FN_VALUES[[0x7F, 0xFF]]).all() and np.isnan(E4M3FN_VALUES).sum() == 2
    assert np.nanmax(np.abs(E4M3FN_VALUES)) == E4M3_MAX
    positive = E4M3FN_VALUES[:0x7F]
    assert (np.diff(positive) > 0).all()  # codes 0..126 count up: one value per code, no gaps


# ---------------------------------------------------------------- every family, exactly


@pytest.fixture(scope="module", params=FP8_ARCHS)
def arch(request):
    return request.param


def _pair(arch, tmp, **kw):
    """(FP8 checkpoint, F32 checkpoint of its dequantized weights) of fixture `arch`."""
    src = hf_fixtures.checkpoint_dir(arch)
    block = kw.get("block", fp8_checkpoints.PUBLISHED_BLOCK)
    quantized = fp8_checkpoints.write_fp8_checkpoint(src, tmp / "fp8", **kw)
    assert quantized, f"{arch}: nothing quantized"
    fp8_checkpoints.write_dequantized(src, quantized, tmp / "deq", block=block)
    return tmp / "fp8", tmp / "deq"


def _assert_same_logits(fp8_dir, deq_dir, out):
    a = convert(fp8_dir, out / "fp8", expert_type=QuantType.F32)
    b = convert(deq_dir, out / "deq", expert_type=QuantType.F32)
    assert a.requant_kld is None  # f32 experts hold FP8 values times float32 scales exactly
    with load(a.model_path) as ma, load(b.model_path) as mb:
        tokens = parity_tokens(ma)
        got, want = reference_logits(ma, tokens), reference_logits(mb, tokens)
    np.testing.assert_array_equal(got, want)
    return a


def test_fp8_checkpoint_converts_to_its_dequantized_model_exactly(arch, tmp_path):
    fp8_dir, deq_dir = _pair(arch, tmp_path)
    _assert_same_logits(fp8_dir, deq_dir, tmp_path)


@pytest.mark.parametrize("scale_dtype", ["F32", "BF16", "F8_E8M0"])
def test_ragged_blocks_and_scale_dtypes(scale_dtype, tmp_path):
    """Blocks of [16, 24] on 64-wide matrices: every row of blocks ends ragged (64 = 2 * 24 + 16)."""
    fp8_dir, deq_dir = _pair("qwen3_moe", tmp_path, block=(16, 24), scale_dtype=scale_dtype)
    _assert_same_logits(fp8_dir, deq_dir, tmp_path)


def test_fused_experts_and_ragged_blocks(tmp_path):
    """gpt-oss's fused [E, D, 2F] / [E, F, D] expert stacks: one expert's slice and its scales."""
    fp8_dir, deq_dir = _pair("gpt_oss_bf16", tmp_path, block=(16, 24))
    _assert_same_logits(fp8_dir, deq_dir, tmp_path)


@pytest.mark.parametrize("block", [fp8_checkpoints.PUBLISHED_BLOCK, (7, 3)])
def test_table_rows_read_by_range_equal_the_whole_table(block, tmp_path):
    """A PLE table is converted a row range at a time: each range, with only the rows of scales it
    spans, equals those rows of the whole dequantized table (ranges across ragged blocks too)."""
    quantized = fp8_checkpoints.write_fp8_checkpoint(hf_fixtures.checkpoint_dir("qwen4_exp_text"), tmp_path / "fp8",
                                                     block=block)
    tables = [n for n in quantized if "ngram_embedding" in n]
    assert tables
    with Fp8Checkpoint(tmp_path / "fp8", Fp8Quantization(block)) as ckpt:
        for name in tables:
            whole = ckpt.read(name)
            np.testing.assert_array_equal(whole, fp8_checkpoints.dequantize_blocks(*quantized[name], block))
            n = whole.shape[0]
            for start, stop in ((0, n), (0, 1), (5, 17), (n - 3, n), (100, min(300, n))):
                np.testing.assert_array_equal(ckpt.read_rows(name, start, stop), whole[start:stop])


# ---------------------------------------------------------------- against the bf16 model, requantized


def test_fp8_matches_the_dequantized_bf16_model(tmp_path):
    """transformers loads an FP8 checkpoint with dequantize=True as bfloat16 weights: strata's
    float32 values of the same checkpoint give logits within the budget and the same greedy text."""
    src = hf_fixtures.checkpoint_dir("qwen3_moe")
    quantized = fp8_checkpoints.write_fp8_checkpoint(src, tmp_path / "fp8")
    fp8_checkpoints.write_dequantized(src, quantized, tmp_path / "bf16", dtype="BF16")
    a = convert(tmp_path / "fp8", tmp_path / "a", expert_type=QuantType.F32)
    b = convert(tmp_path / "bf16", tmp_path / "b", expert_type=QuantType.F32)
    with load(a.model_path) as ma, load(b.model_path) as mb:
        tokens = parity_tokens(ma)
        kld = mean_kld(reference_logits(mb, tokens), reference_logits(ma, tokens))
        print(f"\nFP8 (float32 values) vs its bf16 dequantization: mean KLD {kld:.2e} nats")
        assert kld <= FP8_BF16_KLD_BUDGET
        prompt = [int(t) for t in tokens[:PROMPT_TOKENS]]
        assert generate(ma, prompt, max_tokens=GREEDY_STEPS).tokens == generate(mb, prompt,
                                                                                 max_tokens=GREEDY_STEPS).tokens


def test_requantized_experts_print_their_kld(tmp_path, capsys):
    fp8_dir, _ = _pair("qwen3_moe", tmp_path)
    capsys.readouterr()
    assert main(["convert", str(fp8_dir), str(tmp_path / "q8"), "--experts", "q8_0", "--quiet"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("experts requantized"))
    assert "F8_E4M3 -> Q8_0" in line and "the FP8 checkpoint's dequantized experts" in line, line
    kld = float(line.split("mean KLD ")[1].split()[0])
    assert 0 <= kld < Q2_KLD_SANITY


# ---------------------------------------------------------------- refusals


def _edit_quantization(fp8_dir, **changes):
    path = fp8_dir / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    ({"fmt": "e5m2"}, "fmt = 'e5m2'"),
    ({"fmt": "float8_e5m2"}, "fmt = 'float8_e5m2'"),
    ({"activation_scheme": "static"}, "activation_scheme = 'static'"),
    ({"weight_block_size": [128]}, "weight_block_size = [128]"),
    ({"weight_block_size": [32, 32]}, "in blocks of [32, 32]"),  # the scales were written for [128, 128]
])
def test_bad_quantization_configs_are_refused(changes, message, tmp_path):
    fp8_dir, _ = _pair("qwen3_moe", tmp_path)
    _edit_quantization(fp8_dir, **changes)
    with pytest.raises((ConfigError, FormatError)) as err:
        convert(fp8_dir, tmp_path / "out", expert_type=QuantType.F16)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_minimax_spelling_of_the_format_is_read(tmp_path):
    fp8_dir, deq_dir = _pair("minimax_m2", tmp_path)
    _edit_quantization(fp8_dir, fmt="float8_e4m3fn")
    _assert_same_logits(fp8_dir, deq_dir, tmp_path)


def test_fp8_weight_without_scales_is_refused(tmp_path):
    src = hf_fixtures.checkpoint_dir("qwen3_moe")
    fp8_checkpoints.write_fp8_checkpoint(src, tmp_path / "fp8")
    # drop one scale: rewrite the header without it
    path = tmp_path / "fp8" / "model.safetensors"
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    victim = next(k for k in header if k.endswith("weight_scale_inv"))
    del header[victim]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + blob[8 + n:])
    with pytest.raises(FormatError) as err:
        convert(tmp_path / "fp8", tmp_path / "out", expert_type=QuantType.F16)
    assert "without its block scales" in str(err.value) and victim in str(err.value)


def test_a_non_fp8_quantization_is_still_refused(tmp_path):
    src = hf_fixtures.checkpoint_dir("qwen3_moe")
    from tests.convert_parity import with_config

    d = with_config(src, tmp_path / "awq", lambda c: c.update(quantization_config={"quant_method": "awq"}))
    assert_refused_in_one_line(d, tmp_path / "out", "pre-quantized checkpoint (quantization_config: awq)")
