"""Read a Hugging Face checkpoint's safetensors shards one tensor (or one expert slice) at a time.

A small reader of its own instead of `safetensors.safe_open`: numpy has no bfloat16, so
safe_open(framework="np") cannot read the BF16 checkpoints the Hub ships, and the torch
framework would make torch a runtime dependency. The format is simple (8-byte little-endian
header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the raw bytes), and
reading with `os.pread` into a fresh buffer keeps the process's memory at the tensor being
converted: nothing is mmapped, so untouched shards never count against RSS.

Every shard's header is validated when the checkpoint is opened (a missing shard named by the
index, a truncated file, overlapping data) so that a bad checkpoint fails before any output
is written.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.errors import FormatError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

# safetensors dtype -> (bytes per element, numpy dtype of the stored bits). BF16 is read as its
# raw uint16 bits and widened to float32 by a shift (exact: bf16 is the top half of an f32).
DTYPES: dict[str, tuple[int, np.dtype]] = {
    "F32": (4, np.dtype("<f4")),
    "F16": (2, np.dtype("<f2")),
    "BF16": (2, np.dtype("<u2")),
    "F64": (8, np.dtype("<f8")),
}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (exact). In place after one widening copy, so
    converting a tensor holds its bf16 bytes and one float32 copy, nothing more."""
    wide = bits.astype(np.uint32)
    wide <<= np.uint32(16)
    return wide.view(np.float32)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: `shard` file, absolute byte range [begin, end)."""

    name: str
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    name = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise FormatError(f"{path}: truncated or not a safetensors file (header of {n} bytes, file of {size})")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for tname, meta in header.items():
        if tname == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{path}: bad header entry for tensor {tname}") from None
        if dtype in DTYPES:
            want = DTYPES[dtype][0] * int(np.prod(shape, dtype=np.int64))
            if e - b != want:
                raise FormatError(f"{path}: tensor {tname}: {dtype} {list(shape)} needs {want} bytes, "
                                  f"the header gives {e - b}")
        if data_start + e > size:
            raise FormatError(f"{path}: truncated: tensor {tname} ends at byte {data_start + e}, the file has {size} "
                              f"(re-download {name})")
        out[tname] = TensorInfo(tname, path, dtype, shape, data_start + b, data_start + e)
    return out


class Checkpoint:
    """The tensors of a checkpoint directory: `model.safetensors`, or the shards listed in
    `model.safetensors.index.json` (or, with neither, every `*.safetensors` file in it)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shards():
            for tname, info in _read_header(shard).items():
                if tname in self.tensors:
                    raise FormatError(f"{shard}: tensor {tname} is also in {self.tensors[tname].shard.name}")
                self.tensors[tname] = info
        self._fds: dict[Path, int] = {}

    def _shards(self) -> list[Path]:
        d = self.directory
        index = d / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise FormatError(f"{index}: unreadable shard index ({type(e).__name__}: {e})") from None
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (d / s).exists()]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise FormatError(f"{d}: missing shard {missing[0]}{more}, listed in {INDEX_NAME}")
            return [d / s for s in shards]
        if (d / SINGLE_NAME).exists():
            return [d / SINGLE_NAME]
        found = sorted(d.glob("*.safetensors"))
        if not found:
            raise FormatError(f"{d}: no safetensors weights ({SINGLE_NAME} or {INDEX_NAME}); only safetensors "
                              "checkpoints are supported")
        return found

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.directory}: checkpoint has no tensor {name}") from None

    def check_dtype(self, name: str) -> None:
        """A FormatError now if tensor `name` is stored in a dtype `read` cannot convert."""
        info = self.info(name)
        if info.dtype not in DTYPES:
            raise FormatError(f"{info.shard.name}: tensor {name} has dtype {info.dtype}; supported: "
                              f"{', '.join(DTYPES)} (pre-quantized checkpoints are not supported)")

    def _pread(self, info: TensorInfo, begin: int, nbytes: int) -> bytearray:
        fd = self._fds.get(info.shard)
        if fd is None:
            fd = self._fds[info.shard] = os.open(info.shard, os.O_RDONLY)
        buf = bytearray(nbytes)
        got = os.preadv(fd, [buf], begin)
        if got != nbytes:
            raise FormatError(f"{info.shard}: short read of tensor {info.name} ({got} of {nbytes} bytes; truncated?)")
        return buf

    def read(self, name: str, index: int | None = None) -> np.ndarray:
        """Tensor `name` as float32; with `index`, only `tensor[index]` along the first axis (one
        expert of a fused [E, ...] tensor) is read from disk.

        Shapes:
            -> shape(name), or shape(name)[1:] with index
        """
        self.check_dtype(name)
        info = self.info(name)
        np_dtype = DTYPES[info.dtype][1]
        shape, begin, nbytes = info.shape, info.begin, info.end - info.begin
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise FormatError(f"{info.shard.name}: tensor {name} {list(shape)} has no index {index}")
            shape = shape[1:]
            nbytes //= info.shape[0]
            begin += index * nbytes
        x = np.frombuffer(self._pread(info, begin, nbytes), dtype=np_dtype).reshape(shape)
        if info.dtype == "BF16":
            return bf16_bits_to_f32(x)
        return x if x.dtype == np.float32 else x.astype(np.float32)

    def read_raw(self, name: str, dtype: np.dtype, index: int | None = None) -> np.ndarray:
        """Tensor `name`'s stored bytes as `dtype`, unconverted (packed codes, e8m0 scales);
        with `index`, only `tensor[index]` along the first axis.

        Shapes: -> shape(name) (or shape(name)[1:]), for a dtype of the stored element size
        """
        info = self.info(name)
        shape, begin, nbytes = info.shape, info.begin, info.end - info.begin
        if index is not None:
            if not shape or not 0 <= index < shape[0]:
                raise FormatError(f"{info.shard.name}: tensor {name} {list(shape)} has no index {index}")
            shape, nbytes = shape[1:], nbytes // shape[0]
            begin += index * nbytes
        return np.frombuffer(self._pread(info, begin, nbytes), dtype=dtype).reshape(shape)

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
