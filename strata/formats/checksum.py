"""The one checksum of strata's files: CRC-32 (zlib's; the IEEE 802.3 polynomial, as in gzip/PNG).

Used for every `.experts` record, the `.experts` header and the model `.gguf` as a whole
(docs/formats.md). Computed by the fastest implementation importable here; all give the same
values, so files never depend on which one wrote them.
"""

from __future__ import annotations

import zlib
from typing import Callable

import numpy as np


def _fast_crc32() -> tuple[Callable, str]:
    """The fastest implementation of zlib's CRC-32 (same polynomial, same values) importable here.

    ISA-L's (the `isal` package) runs at ~57 GB/s on one x86 core against zlib 1.2's ~4.2 GB/s
    (benchmarks/checksum.py; docs/perf.md, "Verifying reads"): 0.08 ms instead of 1.1 ms for a
    4.7 MB record, less than the read it checks. Both release the GIL, so the reader threads
    check in parallel. Without `isal` reads are still verified, at zlib's speed.
    """
    try:
        from isal import isal_zlib

        return isal_zlib.crc32, "isal"
    except ImportError:  # pragma: no cover - depends on the environment
        return zlib.crc32, "zlib"


_CRC32, CRC32_IMPL = _fast_crc32()


def checksum(data: bytes | memoryview | np.ndarray) -> int:
    """CRC-32 of data (for a record: its unpadded bytes)."""
    return _CRC32(data) & 0xFFFFFFFF


def checksum_update(data: bytes | memoryview | np.ndarray, crc: int) -> int:
    """The CRC-32 of (what gave `crc`) + data: `checksum(a + b) == checksum_update(b, checksum(a))`."""
    return _CRC32(data, crc) & 0xFFFFFFFF
