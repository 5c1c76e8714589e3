"""A tier-2 checkpoint's experts repacked into aligned records, the bits unchanged.

`strata convert DIR` (no OUT) writes `DIR/RECORDS_NAME`: every expert of every MoE layer as one
record of its pieces back to back (codes, scales, biases of each projection, in the arena's
slot order), each record padded to RECORD_ALIGN, so one expert is one contiguous read of whole
pages (one `preadv` into the slot's piece buffers) instead of one `pread` per piece from the
shards. The bytes are the shards' own: a run on the records computes what a run in place does,
bit for bit.

Layout: MAGIC (16 bytes), the JSON header's length (little-endian u64), the JSON header (the
geometry: pieces, layers, experts, slot bytes; and the shards it was made from: each one's name,
size, mtime and the SHA-256 of its safetensors header), zero padding to RECORD_ALIGN, then the
records in (layer, expert) order (a layer stored in fewer bits than the largest, under a mixed
recipe, fills its records' first bytes; every record is a whole slot). `use_records` swaps a
checkpoint's in-place experts for the records when the file is there and was made from these
very shards, and refuses it in one line (naming the fix) when it was not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path

from strata.errors import FormatError
from strata.formats.expert_record import RECORD_ALIGN
from strata.tier2.expert_tensors import ExpertTensors

__all__ = ["RECORDS_NAME", "MAGIC", "write_records", "use_records"]

RECORDS_NAME = "strata-experts.records"
MAGIC = b"STRATA-T2RECORDS"
VERSION = 2  # 2: each layer's piece bytes in the header (mixed recipes store some layers in more bits)


def _fingerprint(shards) -> list[dict]:
    out = []
    for p in shards:
        st = os.stat(p)
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            head = f.read(n)
        out.append({"name": Path(p).name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                    "header_sha256": hashlib.sha256(head).hexdigest()})
    return out


def _geometry(t: ExpertTensors) -> dict:
    return {"pieces": [[p.name, list(p.shape), p.dtype, p.nbytes] for p in t.pieces], "n_layers": t.n_layers,
            "n_experts": t.n_experts, "slot_bytes": t.slot_bytes,
            "layer_piece_bytes": [[p.nbytes for p in layer] for layer in t.layer_pieces]}


def write_records(tensors: ExpertTensors, *, progress=None) -> Path:
    """Write `tensors`' experts as records into their directory (module doc); -> its path.
    `progress(n)`: records written so far. Written under a temporary name and renamed when whole."""
    path = tensors.directory / RECORDS_NAME
    tmp = path.with_name(path.name + ".partial")
    header = json.dumps({"version": VERSION, **_geometry(tensors), "shards": _fingerprint(tensors.shards)}).encode()
    data_offset = -(-(len(MAGIC) + 8 + len(header)) // RECORD_ALIGN) * RECORD_ALIGN
    fds = [os.open(p, os.O_RDONLY) for p in tensors.shards]
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            f.write(b"\0" * (data_offset - f.tell()))
            n = 0
            for m in range(tensors.n_layers):
                pad = b"\0" * (tensors.slot_bytes - tensors.layer_record_bytes(m))
                for e in range(tensors.n_experts):
                    for shard, offset, nbytes in _in_place_ranges(tensors, m, e):
                        got = os.pread(fds[shard], nbytes, offset)
                        if len(got) != nbytes:
                            raise FormatError(f"{tensors.shards[shard]}: short read at {offset} ({len(got)} of "
                                              f"{nbytes} bytes): the shard is truncated")
                        f.write(got)
                    f.write(pad)
                    n += 1
                    if progress is not None:
                        progress(n)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return path


def _in_place_ranges(t: ExpertTensors, layer: int, expert: int):
    return [(s, begin + expert * p.nbytes, p.nbytes) for p, (s, begin) in zip(t.layer_pieces[layer], t.offsets[layer])]


def use_records(tensors: ExpertTensors) -> ExpertTensors:
    """`tensors` read from the records file where there is one made from these shards (module
    doc); as they are where there is none. A records file made from other shards, or damaged,
    is refused in one line naming the fix."""
    path = tensors.directory / RECORDS_NAME
    if not path.exists():
        return tensors
    redo = f"run `strata convert {tensors.directory}` again to repack, or delete {path}"
    try:
        with open(path, "rb") as f:
            magic, n = f.read(len(MAGIC)), f.read(8)
            if magic != MAGIC or len(n) != 8:
                raise FormatError(f"{path}: not a strata records file; {redo}")
            length = struct.unpack("<Q", n)[0]
            header = json.loads(f.read(length))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error) as e:
        raise FormatError(f"{path}: unreadable ({e}); {redo}") from None
    if header.get("version") != VERSION:
        raise FormatError(f"{path}: records version {header.get('version')!r}, this strata reads {VERSION}; {redo}")
    if {k: header.get(k) for k in _geometry(tensors)} != _geometry(tensors):
        raise FormatError(f"{path}: its experts are laid out unlike this checkpoint's; {redo}")
    if header.get("shards") != _fingerprint(tensors.shards):
        raise FormatError(f"{path}: made from other shards than the checkpoint's now (a shard changed since the "
                          f"repack); {redo}")
    data_offset = -(-(len(MAGIC) + 8 + length) // RECORD_ALIGN) * RECORD_ALIGN
    if size != data_offset + tensors.n_records * tensors.slot_bytes:
        raise FormatError(f"{path}: {size} bytes, expected {data_offset + tensors.n_records * tensors.slot_bytes} "
                          f"(truncated?); {redo}")
    return dataclasses.replace(tensors, records=path, records_offset=data_offset)
