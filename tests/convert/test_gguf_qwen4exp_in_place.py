"""llama.cpp's `qwen4exp` GGUF run in place (`strata generate model.gguf`): its n-gram table
`per_layer_token_embd.weight` read by the PLE row store as rows of its stored type, straight from
the file (strata/convert/ngram_table_in_place.py), against the same file converted with F32 rows
(the table's values exactly: ggml's dequantization of a Q8_0 / IQ4_NL row is exact in float32).
With the table F32 (every tensor F32) or quantized as the UD files are (Q8_0 / IQ4_NL table, Q5_1
experts, Q8_0 dense): every row equals the conversion's, and the logits and 32 greedy tokens equal
the converted run's bit for bit, all resident, with every expert in the arena and at the smallest
legal arena (the rows streamed through the row cache); a Q8_0 table equals the conversion that
keeps its rows Q8_0 (`--ngrams q8_0`) too. A table changed under a run is caught on
the next read of its page, a NaN row on its first; a moved table offset or a truncated file ends
in one line; nothing is written beside the file."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest

from engine_kinds import EXACT0, open_kind
from strata.cli.main import main
from strata.convert import convert
from strata.convert.ngram_table_in_place import GgufNgramTable
from strata.errors import FormatError, StrataError
from strata.formats.quant_types import QuantType
from strata.loader import load
from tests import hf_qwen4_released
from tests.gguf_qwen4exp import write_qwen4exp_gguf
from tests.convert_parity import greedy_run

GREEDY_TOKENS = 32
TABLE = "per_layer_token_embd.weight"
# table type -> the builder's types (the UD files': Q8_0 / IQ4_NL tables beside Q5_1 experts, Q8_0 dense)
TYPES = {"F32": dict(), "Q8_0": dict(experts="Q5_1", dense="Q8_0", table="Q8_0"),
         "IQ4_NL": dict(experts="Q5_1", dense="Q8_0", table="IQ4_NL")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hf_qwen4_released.cached_checkpoint(hf_qwen4_released.ARCHS[0], tmp_path_factory)


@pytest.fixture(scope="module", params=list(TYPES))
def pair(request, checkpoint, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"q4x_in_place_{request.param}")
    path = write_qwen4exp_gguf(checkpoint[0], work / "m.gguf", mtp=False, **TYPES[request.param])
    converted = load(convert(path, work / "converted", ngram_type=QuantType.F32).model_path)
    in_place = load(path)
    yield request.param, path, converted, in_place
    converted.close()
    in_place.close()


def test_the_rows_are_the_conversion_s(pair):
    table, path, converted, in_place = pair
    store, want = in_place.ngrams_file, converted.ngrams_file
    assert isinstance(store, GgufNgramTable) and store.path == str(path) and store.qtype is QuantType[table]
    assert in_place.cfg == converted.cfg
    assert {l: (t.rows, t.width) for l, t in store.tables.items()} == {
        l: (t.rows, t.width) for l, t in want.tables.items()}
    ids = np.arange(want.tables[0].rows)
    np.testing.assert_array_equal(store.rows(0, ids), want.rows(0, ids))



@pytest.mark.parametrize("kind", ["reference", "numpy-full", "numpy-min"])
def test_logits_and_greedy_tokens_are_the_converted_run_s(pair, kind):
    _, _, converted, in_place = pair
    prompt = list(converted.tokenizer.encode("The quick brown fox"))
    with open_kind(converted, kind, EXACT0) as eng:
        want_tokens, want_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
    with open_kind(in_place, kind, EXACT0) as eng:
        got_tokens, got_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
    assert got_tokens == want_tokens
    np.testing.assert_array_equal(got_logits, want_logits)


def test_the_rows_stream_at_the_smallest_arena(pair):
    """At the smallest arena the rows come through the row cache (not the table read whole)."""
    _, _, _, in_place = pair
    with open_kind(in_place, "numpy-min", EXACT0) as eng:
        eng.prefill(list(in_place.tokenizer.encode("The quick brown fox")))
        assert eng.ngram_rows is not None and eng.ngram_rows.stats().total.pages_read > 0


def test_a_q8_0_table_equals_the_conversion_that_keeps_q8_0(quantized, tmp_path):
    """The Q8_0 table in place against the conversion that stores its rows as Q8_0 again
    (`--ngrams q8_0`: gguf's quantizer gives the stored blocks back): the same rows and the same
    run at the smallest arena, bit for bit."""
    converted = convert(quantized, tmp_path / "q8", ngram_type=QuantType.Q8_0)
    with load(quantized) as in_place, load(converted.model_path) as kept:
        assert kept.ngrams_file.qtype is in_place.ngrams_file.qtype is QuantType.Q8_0
        ids = np.arange(kept.ngrams_file.tables[0].rows)
        np.testing.assert_array_equal(in_place.ngrams_file.rows(0, ids), kept.ngrams_file.rows(0, ids))
        prompt = list(kept.tokenizer.encode("The quick brown fox"))
        with open_kind(kept, "numpy-min", EXACT0) as eng:
            want_tokens, want_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
        with open_kind(in_place, "numpy-min", EXACT0) as eng:
            got_tokens, got_logits = greedy_run(eng, prompt, GREEDY_TOKENS)
    assert got_tokens == want_tokens
    np.testing.assert_array_equal(got_logits, want_logits)


# ---------------------------------------------------------------- changed and corrupt files


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    return write_qwen4exp_gguf(checkpoint[0], tmp_path_factory.mktemp("q4x_corrupt") / "m.gguf", mtp=False,
                               **TYPES["Q8_0"])


def _copy(path, tmp_path):
    out = tmp_path / path.name
    shutil.copy(path, out)
    return out


def test_a_table_changed_under_the_run_is_caught_on_its_next_read(quantized, tmp_path):
    path = _copy(quantized, tmp_path)
    with load(path) as model:
        store = model.ngrams_file
        store.rows(0, np.array([5]))  # its page's first read: the CRC-32 kept
        with open(path, "r+b") as f:  # one code byte of row 5 flipped on disk
            at = store.page_offset(0) + 5 * store.tables[0].row_bytes + 10
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(FormatError, match=rf"{TABLE} rows \[0, \d+\): checksum mismatch: .* first read gave"):
            store.rows(0, np.array([5]))


def test_a_non_finite_row_is_refused_on_its_first_read(quantized, tmp_path):
    """A Q8_0 block whose scale is NaN: its page's first read refuses it, through the row cache too."""
    path = _copy(quantized, tmp_path)
    with load(path) as model:
        store = model.ngrams_file
        with open(path, "r+b") as f:  # row 0's first block's float16 d
            f.seek(store.page_offset(0))
            f.write(np.float16(np.nan).tobytes())
        with pytest.raises(FormatError, match=rf"{TABLE} rows \[0, \d+\): 32 non-finite values"):
            store.rows(0, np.array([1, 0]))


def _table_offset(raw: bytes) -> tuple[int, int]:
    """(where the table's data offset field is in the tensor index, its value)."""
    key = struct.pack("<Q", len(TABLE)) + TABLE.encode()
    at = raw.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", raw, at)
    at += 4 + 8 * n_dims + 4
    return at, struct.unpack_from("<Q", raw, at)[0]


def _offset_set(new):
    """The file with the table's offset replaced by new(its offset)."""
    def make(raw: bytes) -> bytes:
        at, value = _table_offset(raw)
        return raw[:at] + struct.pack("<Q", new(value) % 2**64) + raw[at + 8:]
    return make


CORRUPTIONS = {
    "table offset +32": (_offset_set(lambda v: v + 32), "offset"),
    "table offset -32": (_offset_set(lambda v: v - 32), "offset"),
    "table offset +1": (_offset_set(lambda v: v + 1), "alignment"),
    "table offset 2^64-1": (_offset_set(lambda v: 2**64 - 1), "offset"),
    "table offset with a flipped bit": (_offset_set(lambda v: v ^ (1 << 12)), "offset"),
    "truncated in the table": (None, "truncated"),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_a_corrupt_table_ends_in_one_line(quantized, tmp_path, capsys, what):
    make, fragment = CORRUPTIONS[what]
    raw = quantized.read_bytes()
    if make is None:  # cut inside the table's bytes
        with load(quantized) as model:
            cut = model.ngrams_file.page_offset(0) + 100
        bad_bytes = raw[:cut]
    else:
        bad_bytes = make(raw)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bad_bytes)
    with pytest.raises(StrataError) as err:
        load(bad)
    msg = str(err.value)
    assert "\n" not in msg and str(bad) in msg and fragment in msg, msg
    capsys.readouterr()
    assert main(["generate", str(bad), "hi", "-n", "2"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error: ") and "internal error" not in err_lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_generate_runs_in_place_and_writes_nothing(quantized, tmp_path, capsys):
    path = _copy(quantized, tmp_path)
    assert main(["generate", str(path), "Hello", "-n", "4"]) == 0
    assert capsys.readouterr().out.strip()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.mark.parametrize("rows, row_nbytes, begin, file_bytes, want", [
    (208, 128, 0, 10**6, 32),  # 4096 // 128 rows a page; the last page's over-read is inside the file
    (208, 128, 0, 208 * 128, 26),  # the table ends the file: the largest divisor of 208 up to 32
    (211, 128, 0, 211 * 128, 1),  # a prime count at the end of the file: a row a page
    (5, 5000, 0, 25000, 1),  # a row larger than a page: a page is one row
])
def test_a_page_is_whole_rows_and_every_read_is_inside_the_file(rows, row_nbytes, begin, file_bytes, want):
    from strata.convert.ngram_table_in_place import table_pages

    rpp = table_pages(rows, row_nbytes, begin, file_bytes)
    assert rpp == want
    assert begin + -(-rows // rpp) * rpp * row_nbytes <= file_bytes
