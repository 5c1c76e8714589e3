"""The GGUF container reader (strata/formats/gguf_file.py) and the model file's checks on top of
it: every damaged or pathological file is a one-line FormatError naming the tensor or key, fast,
and never weights. Structural edits are resealed (the file checksum recomputed) so that the
reader's own checks, not the checksum, are what refuse them."""

from __future__ import annotations

import os
import struct
import threading
import time

import numpy as np
import pytest

from strata.errors import FormatError, MissingTensorError
from strata.formats.checksum import checksum
from strata.formats.gguf_file import open_gguf
from strata.formats.model_file import KEY_FILE_CHECKSUM, read_model, read_model_config
from strata.testing.models import make_model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("gguf") / "m", "tiny", seed=1)
    return made.model_path.read_bytes()


@pytest.fixture
def path(tmp_path, pristine):
    p = tmp_path / "m.gguf"
    p.write_bytes(pristine)
    return p


def _layout(path):
    gf = open_gguf(path)
    try:
        raw = path.read_bytes()
        infos = {}
        for t in gf.tensors.values():  # where each tensor's n_dims, dims, type and offset sit
            name = t.name.encode()
            at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
            infos[t.name] = (t, at, at + 4, at + 4 + 8 * len(t.dims), at + 4 + 8 * len(t.dims) + 4)
        return {k: f.offset for k, f in gf.fields.items()}, infos, gf.fields[KEY_FILE_CHECKSUM].offset
    finally:
        gf.close()


def _patch(path, fmt: str, at: int, value, seal_at: int | None) -> None:
    raw = bytearray(path.read_bytes())
    struct.pack_into(fmt, raw, at, value)
    if seal_at is not None:
        raw[seal_at: seal_at + 4] = bytes(4)
        struct.pack_into("<I", raw, seal_at, checksum(bytes(raw)))
    path.write_bytes(bytes(raw))


def _refused(path, *fragments, fn=read_model, error=FormatError) -> str:
    with pytest.raises(error) as err:
        fn(path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_write_model_output_passes_every_check(path):
    m = read_model(path)
    assert m.experts_identity is not None and len(m.experts_identity) == 32


@pytest.mark.parametrize("case", ["type changed", "type same size", "overlap", "unaligned", "wraps", "too far"])
def test_tensor_offsets_and_types_are_checked(path, case):
    _, infos, seal = _layout(path)
    names = list(infos)
    name = names[5]  # a 2-D F32 matrix of the tiny model (blk.0.attn_q.weight)
    t, _, _, type_at, off_at = infos[name]
    nxt = names[6]
    if case == "type changed":  # F32 -> F16 without its bytes: the next offset no longer follows
        _patch(path, "<I", type_at, 1, seal)
        _refused(path, nxt, "expected")
    elif case == "type same size":  # F32 -> I32: same bytes, so only the type rule can tell
        _patch(path, "<I", type_at, 26, seal)
        _refused(path, name, "integer type")
    elif case == "overlap":
        _patch(path, "<Q", infos[nxt][4], t.offset, seal)
        _refused(path, nxt, f"offset {t.offset}", "expected")
    elif case == "unaligned":
        _patch(path, "<Q", off_at, t.offset + 4, seal)
        _refused(path, name, "not a multiple of the alignment 32")
    elif case == "wraps":
        _patch(path, "<Q", off_at, 2**64 - 1, seal)
        _refused(path, name, "not a multiple of the alignment")
    else:
        _patch(path, "<Q", off_at, t.offset + 32, seal)
        _refused(path, name, "expected")


def test_dims_and_counts_are_bounded(path):
    _, infos, seal = _layout(path)
    t, ndims_at, dims_at, _, _ = infos["token_embd.weight"]
    raw = path.read_bytes()
    for fmt, at, value, fragment in [("<Q", dims_at, 2**63, "token_embd.weight"), ("<I", ndims_at, 5, "5 dimensions"),
                                     ("<Q", dims_at, 0, "0 elements"), ("<Q", 8, 2**64 - 1, "cannot fit"),
                                     ("<Q", 16, 2**40, "cannot fit")]:
        path.write_bytes(raw)
        _patch(path, fmt, at, value, seal)
        _refused(path, fragment)


def test_a_changed_general_alignment_is_refused(path):
    raw = path.read_bytes()
    key = b"general.alignment"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, 64)  # u32 64 over a 32-aligned file
    n_kv = struct.unpack_from("<Q", raw, 16)[0]
    new = bytearray(raw[:24] + kv + raw[24:])
    struct.pack_into("<Q", new, 16, n_kv + 1)
    path.write_bytes(bytes(new))
    _refused(path, "tensor")  # an offset that is not 64-aligned, or (all sizes 64-multiples) the extent
    struct.pack_into("<I", new, 24 + 8 + len(key) + 4, 3)
    path.write_bytes(bytes(new))
    _refused(path, "general.alignment must be a u32 power of two")


def test_a_flipped_byte_anywhere_is_a_checksum_mismatch(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 100] ^= 0x01  # inside the last tensor's data: structure intact
    path.write_bytes(bytes(raw))
    _refused(path, "checksum mismatch")


def test_non_finite_weights_and_invalid_values_are_refused(path):
    fields, infos, seal = _layout(path)
    raw = path.read_bytes()
    t = infos["output_norm.weight"][0]
    gf = open_gguf(path)
    data_offset = gf.data_offset
    gf.close()
    _patch(path, "<f", data_offset + t.offset + 8, float("nan"), seal)
    _refused(path, "output_norm.weight", "non-finite")
    for key, value, fragment in [("strata.rope_theta", float("nan"), "rope_theta"),
                                 ("strata.rope_theta", 0.0, "rope_theta"), ("strata.rope_theta", -1.0, "rope_theta"),
                                 ("strata.rms_norm_eps", -1.0, "rms_norm_eps"),
                                 ("strata.rms_norm_eps", float("nan"), "rms_norm_eps")]:
        path.write_bytes(raw)
        _patch(path, "<d", fields[key], value, seal)
        _refused(path, fragment, fn=read_model_config)


def test_n_layers_of_two_to_the_32_is_refused_before_building_anything(path):
    fields, _, seal = _layout(path)
    raw = path.read_bytes()
    _patch(path, "<I", fields["strata.n_layers"], 2**32 - 1, seal)
    start = time.perf_counter()
    for fn in (read_model, read_model_config):
        _refused(path, "strata.n_layers = 4294967295", fn=fn)
    assert time.perf_counter() - start < 2
    path.write_bytes(raw)
    _patch(path, "<I", fields["strata.n_layers"], 1000, seal)  # plausible, but not in a file of 29 tensors
    _refused(path, "strata.n_layers = 1000", "holds only", error=MissingTensorError)


def test_a_four_million_element_metadata_array_opens_fast(path):
    raw = path.read_bytes()
    key, n = b"x.big", 4 << 20
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, n) + bytes(n)  # ARRAY of UINT8
    new = bytearray(raw[:24] + kv + raw[24:])
    struct.pack_into("<Q", new, 16, struct.unpack_from("<Q", raw, 16)[0] + 1)
    path.write_bytes(bytes(new))
    start = time.perf_counter()
    with pytest.raises(FormatError):  # refused (the moved data section, the checksum), and quickly
        read_model(path)
    assert time.perf_counter() - start < 3


def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    result = []
    t = threading.Thread(target=lambda: result.append(_refused(fifo, "not a regular file")), daemon=True)
    t.start()
    t.join(5)
    assert result, "reading a named pipe blocked"


def test_an_older_file_without_seal_or_identity_still_reads():
    from importlib.resources import files

    m = read_model(files("strata") / "data" / "default.gguf")
    assert m.experts_identity is None


def test_truncated_and_trailing(path):
    raw = path.read_bytes()
    for data, fragment in [(raw[:-1], "truncated"), (raw + bytes(64), "trailing bytes"), (raw[:23], "not a GGUF"),
                           (b"GGUF" + struct.pack("<I", 7) + bytes(40), "version 7")]:
        path.write_bytes(data)
        _refused(path, fragment)
    assert np.frombuffer(raw[:4], np.uint8).tobytes() == b"GGUF"
