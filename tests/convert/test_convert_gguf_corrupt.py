"""Structurally invalid llama.cpp GGUFs end `strata convert` in one line naming the file, never
in a converted model of other weights: a tensor type relabelled with its bytes unchanged, an
offset moved by +1 (misaligned), +32, -32, to 2^64 - 1, into another tensor or by one flipped
bit, a shape changed, a changed alignment, truncation. ggml's own loader rejects each (gguf.cpp: offsets in
order, aligned, sized by type and shape, inside the file); strata's reader holds the file to the
same rules before converting a byte (strata/formats/gguf_file.py), and before a run in place
reads one."""

from __future__ import annotations

import struct

import pytest

from tests import gguf_models, hf_models
from strata.cli.main import main
from strata.convert import convert
from strata.errors import FormatError, StrataError
from strata.loader import load

EXPERTS = "blk.0.ffn_down_exps.weight"  # a Q8_0 tensor in the middle of the file
Q8_0, Q4_0, I32 = 8, 2, 26  # ggml type ids


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    path = gguf_models.write_gguf(hf_dir, tmp_path_factory.mktemp("gguf_good") / "model.gguf",
                                  experts="Q8_0", dense="F16")
    return path.read_bytes()


def _info(raw: bytes, name: str) -> tuple[int, int, int]:
    """(where its dims start, its n_dims, where its type field is) of tensor `name`'s info record:
    u64 name length, the name, u32 n_dims, n_dims x u64, u32 type, u64 offset."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", raw, at)
    return at + 4, n_dims, at + 4 + 8 * n_dims


def _offset(raw: bytes, name: str) -> tuple[int, int]:
    """(where tensor `name`'s data offset field is, its value)."""
    _, _, type_at = _info(raw, name)
    return type_at + 4, struct.unpack_from("<Q", raw, type_at + 4)[0]


def _patched(raw: bytes, at: int, data: bytes) -> bytes:
    return raw[:at] + data + raw[at + len(data):]


def _moved(delta):
    def make(raw: bytes) -> bytes:
        at, value = _offset(raw, EXPERTS)
        return _patched(raw, at, struct.pack("<Q", (value + delta) % 2**64))
    return make


def _into_another(raw: bytes) -> bytes:
    at, _ = _offset(raw, EXPERTS)
    _, other = _offset(raw, "blk.0.ffn_gate_exps.weight")
    return _patched(raw, at, struct.pack("<Q", other))


def _flipped_bit(raw: bytes) -> bytes:
    at, value = _offset(raw, EXPERTS)
    return _patched(raw, at, struct.pack("<Q", value ^ (1 << 12)))


def _relabelled(gtype):
    def make(raw: bytes) -> bytes:
        _, _, type_at = _info(raw, EXPERTS)
        return _patched(raw, type_at, struct.pack("<I", gtype))
    return make


def _norm_as_int(raw: bytes) -> bytes:  # F32 -> I32: the same bytes, an integer tensor
    _, _, type_at = _info(raw, "blk.0.attn_norm.weight")
    return _patched(raw, type_at, struct.pack("<I", I32))


def _shape_changed(raw: bytes) -> bytes:
    dims_at, _, _ = _info(raw, EXPERTS)
    (d0,) = struct.unpack_from("<Q", raw, dims_at)
    return _patched(raw, dims_at, struct.pack("<Q", d0 * 2))


def _truncated(raw: bytes) -> bytes:
    return raw[: len(raw) - 1000]


CORRUPTIONS = {
    "type relabelled Q8_0 -> Q4_0": (_relabelled(Q4_0), "offset"),
    "norm relabelled F32 -> I32": (_norm_as_int, "I32"),
    "offset +1": (_moved(1), "alignment"),
    "offset +32": (_moved(32), "offset"),
    "offset -32": (_moved(-32), "offset"),
    "offset 2^64-1": (lambda raw: _patched(raw, _offset(raw, EXPERTS)[0], struct.pack("<Q", 2**64 - 1)), "offset"),
    "offset into another tensor": (_into_another, "offset"),
    "offset with a flipped bit": (_flipped_bit, "offset"),
    "shape changed": (_shape_changed, ""),
    "truncated": (_truncated, "truncated"),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_a_corrupt_gguf_ends_in_one_line(good, tmp_path, capsys, what):
    make, fragment = CORRUPTIONS[what]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(make(good))
    with pytest.raises(StrataError) as err:
        convert(bad, tmp_path / "out")
    msg = str(err.value)
    assert "\n" not in msg and str(bad) in msg and fragment in msg, msg
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "out.experts").exists()
    capsys.readouterr()
    assert main(["convert", str(bad), str(tmp_path / "cli"), "--quiet"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error: ") and "internal error" not in err_lines[0]


@pytest.mark.parametrize("what", list(CORRUPTIONS))
def test_a_corrupt_gguf_run_in_place_ends_in_one_line(good, tmp_path, capsys, what):
    """The same files given to `strata generate` (run in place, no conversion:
    strata/convert/gguf_in_place.py): refused at load by the same reader, one line each."""
    make, fragment = CORRUPTIONS[what]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(make(good))
    with pytest.raises(StrataError) as err:
        load(bad)
    msg = str(err.value)
    assert "\n" not in msg and str(bad) in msg and fragment in msg, msg
    capsys.readouterr()
    assert main(["generate", str(bad), "hi", "-n", "2"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("error: ") and "internal error" not in err_lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]  # nothing written beside it


def test_the_good_file_converts(good, tmp_path):
    path = tmp_path / "good.gguf"
    path.write_bytes(good)
    convert(path, tmp_path / "out")


def test_a_file_that_is_not_gguf_inside_is_one_line(good, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good[:4] + struct.pack("<I", 77) + good[8:])  # an unknown version
    with pytest.raises(FormatError, match="version 77"):
        convert(bad, tmp_path / "out")


@pytest.mark.parametrize("alignment, fragment", [(128, "corrupt GGUF"), (48, "power of two")])
def test_a_changed_alignment_ends_in_one_line(tmp_path_factory, tmp_path, alignment, fragment):
    """A file written with general.alignment = 64 whose value is then changed: at 128 the data
    section would start elsewhere and the tensors no longer end where the file does; 48 is no
    alignment at all."""
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    path = gguf_models.write_gguf(hf_dir, tmp_path / "aligned.gguf", experts="Q8_0", dense="F16", alignment=64)
    convert(path, tmp_path / "fine")  # 64 itself is fine
    raw = path.read_bytes()
    key = struct.pack("<Q", len(b"general.alignment")) + b"general.alignment"
    at = raw.index(key) + len(key) + 4  # the key, its u32 value type, then the u32 value
    assert struct.unpack_from("<I", raw, at)[0] == 64
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_patched(raw, at, struct.pack("<I", alignment)))
    with pytest.raises(FormatError) as err:
        convert(bad, tmp_path / "out")
    assert "\n" not in str(err.value) and str(bad) in str(err.value) and fragment in str(err.value), str(err.value)


def _renamed(key: bytes):
    """Metadata `key` renamed (its last byte changed): the file parses, the key is gone."""
    def make(raw: bytes) -> bytes:
        at = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) - 1
        return _patched(raw, at, b"X")
    return make


def _retyped(key: bytes, value_type: int):
    """Metadata `key`'s value type changed to another of the same size (its bytes reread)."""
    def make(raw: bytes) -> bytes:
        at = raw.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
        return _patched(raw, at, struct.pack("<I", value_type))
    return make


METADATA = {
    "block_count missing": (_renamed(b"qwen3moe.block_count"), "missing metadata key qwen3moe.block_count"),
    "rms epsilon missing": (_renamed(b"qwen3moe.attention.layer_norm_rms_epsilon"),
                            "missing metadata key qwen3moe.attention.layer_norm_rms_epsilon"),
    "tokens missing": (_renamed(b"tokenizer.ggml.tokens"), "missing metadata key tokenizer.ggml.tokens"),
    "merges missing": (_renamed(b"tokenizer.ggml.merges"), "missing metadata key tokenizer.ggml.merges"),
    "block_count a float": (_retyped(b"qwen3moe.block_count", 6), "qwen3moe.block_count is FLOAT32"),
    "head count an int32 < 0": (_retyped(b"qwen3moe.attention.head_count", 5), "expected an integer"),
}


@pytest.mark.parametrize("what", list(METADATA))
def test_missing_or_mistyped_metadata_is_one_line(good, tmp_path, capsys, what):
    """What llama.cpp's loader requires (gguf keys of the architecture, the BPE vocabulary and
    its merges) missing, or a value of another type: one line naming the key, never a converted
    model of another configuration or an internal error."""
    make, fragment = METADATA[what]
    bad = tmp_path / "bad.gguf"
    data = make(good)
    if what == "head count an int32 < 0":  # the u32 4 read as an int32 is still 4: make it negative
        key = b"qwen3moe.attention.head_count"
        at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4
        data = _patched(data, at, struct.pack("<i", -4))
    bad.write_bytes(data)
    with pytest.raises(StrataError) as err:
        convert(bad, tmp_path / "out")
    msg = str(err.value)
    assert "\n" not in msg and str(bad) in msg and fragment in msg, msg
    capsys.readouterr()
    assert main(["convert", str(bad), str(tmp_path / "cli"), "--quiet"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "internal error" not in err_lines[0]
