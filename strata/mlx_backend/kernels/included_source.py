"""A CUDA kernel's source handed to MLX as an `#include` of a file named by its content.

Why: MLX's CUDA build hashes a custom kernel's whole source on every evaluation, compiled replays
included, to name its JIT module (`custom_kernel.cpp`: `std::hash` of the generated source, ~0.17
us a KB on the H200's hosts). At the seed shape a decoded token's launches carry ~2 MB of source:
~0.3 ms of host work a token, for a name. NVRTC reads `#include`d files from the file system when
it compiles (MLX's own prelude comes that way), so the header and the body are written once to
`<cache>/strata/cuda-src/<sha256>.cuh` and MLX is given two one-line includes: what it hashes a
launch falls from kilobytes to ~100 bytes plus its own signature. The file's name is its
content's hash, so a changed body is a new file, a new source string and a new module: MLX can
never pair a module name with other code (it keeps custom kernels in memory only, per process).

A source that spells `<input>_shape`, `_strides` or `_ndim` stays inline: MLX looks for those
names in the source string to decide which arguments to pass. So does any source when the
directory cannot be written (`source_dir` returns None): the same kernel, hashed in full.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Sequence

from strata.mlx_backend.jit_cache import cache_root

_dir: list[Path | None] = []  # asked once a process: [the directory, or None where none is writable]


def default_dir(env: dict | None = None) -> Path:
    """`$XDG_CACHE_HOME/strata/cuda-src` (jit_cache.cache_root: ~/.cache/strata by default)."""
    return cache_root(env) / "cuda-src"


def source_dir() -> Path | None:
    """The directory the included files live in, made on first use; None where it cannot be made
    or its path cannot stand in a C string literal (every source then stays inline)."""
    if not _dir:
        d: Path | None = default_dir().resolve()
        try:
            d.mkdir(parents=True, exist_ok=True)
            if not os.access(d, os.W_OK) or any(c in str(d) for c in '"\\\n'):
                d = None
        except OSError:
            d = None
        _dir.append(d)
    return _dir[0]


def _written(directory: Path, text: str) -> Path:
    """`text` in `directory/<sha256 of text>.cuh`, written atomically unless already there (read
    back and compared: once a kernel build, a few KB, and a damaged file is written again)."""
    data = text.encode()
    path = directory / (hashlib.sha256(data).hexdigest()[:32] + ".cuh")
    try:
        same = path.read_bytes() == data
    except OSError:
        same = False
    if not same:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # another process writing the same name writes the same bytes
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def _reads_shapes(body: str, input_names: Sequence[str]) -> bool:
    return any(n + suffix in body for n in input_names for suffix in ("_shape", "_strides", "_ndim"))


def included(header: str, body: str, input_names: Sequence[str]) -> tuple[str, str]:
    """(header, body) for `mx.fast.cuda_kernel`: each an `#include` of its file where that is
    possible (a writable directory, a body that names no input's shape), else as given.
    An empty header stays empty."""
    directory = source_dir()
    if directory is None or _reads_shapes(body, input_names):
        return header, body
    try:
        h = f'#include "{_written(directory, header)}"\n' if header.strip() else header
        b = f'#include "{_written(directory, body)}"\n'
    except OSError:
        return header, body
    return h, b
