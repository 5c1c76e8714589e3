"""The compiled CPU kernels (native/quant_gemv.c): built once per machine at first use with the
system's C compiler, cached, loaded through ctypes.

Why at first use rather than at install: `pip install -e .` stays pure Python (no compiler needed
to install, no wheels per platform), and the build targets the machine it runs on (-march=native:
AVX2 / AVX-512 on x86_64, the host's NEON on arm64), which a portable wheel could not without
dispatching at run time. It costs ~0.3-0.8 s once (2-core machine), then a cached library loads in
~1 ms. Where no compiler is found or the build fails, `library()` returns None and `reason()`
says why in one line: the numpy engines then compute with the float32 reference (docs/cpu.md).

What a machine needs: a C99 compiler on PATH (`cc`, `gcc` or `clang`, or `$CC`) and its math
library; no Python headers (the library is loaded through ctypes, not imported). x86_64 gets the
AVX2 path where `-march=native` offers AVX2, FMA and F16C; every other target the portable loops
(the compiler vectorizes them: NEON on arm64). Debian / Ubuntu: `apt-get install gcc`; macOS:
`xcode-select --install`.

The library is named by a hash of the source, the compiler's version line and the flags, so an
edited source or another compiler builds anew; several processes building at once each compile
to their own file and rename it into place (the last one wins; all are the same bytes' worth).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = ["library", "reason", "build", "SOURCE", "FLAG_SETS", "PORTABLE_FLAGS", "GEMV_TYPES"]

SOURCE = Path(__file__).with_name("native") / "quant_gemv.c"
# the types whose GEMV the source defines, by the lower-case name in its symbol (strata_<name>_gemv)
GEMV_TYPES = ("q8_0", "q4_0", "q2_0", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_nl", "iq4_xs", "mxfp4", "q5_1")
# tried in order: the first that compiles is used (-march=native is not accepted by every
# compiler for every target: Apple clang on arm64 takes -mcpu=native)
PORTABLE_FLAGS = ("-O3",)  # the target's baseline instruction set: the portable C loops (tests build it too)
FLAG_SETS = (("-O3", "-march=native"), ("-O3", "-mcpu=native"), PORTABLE_FLAGS)
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "lib": the CDLL or None, "reason": why None


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.splitlines()[0] if out.stdout else ""


def cache_dir() -> Path:
    """Where built libraries are kept: the system temp dir, per user (a reboot costs one rebuild)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"strata-cpu-{uid}"


def _build(cc: str, code: bytes, flag_sets: tuple[tuple[str, ...], ...]) -> tuple[Path | None, str]:
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    ident = f"{_version(cc)}|{platform.machine()}|{platform.system()}"
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256(code + ident.encode() + " ".join(flags).encode()).hexdigest()[:20]
        so = d / f"quant_gemv_{key}.so"
        if so.exists():
            return so, ""
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cc, *flags, "-fPIC", "-shared", "-pthread", "-o", str(tmp), str(SOURCE), "-lm"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{' '.join(cmd)}: {e}")
            continue
        if proc.returncode == 0:
            os.replace(tmp, so)
            return so, ""
        tmp.unlink(missing_ok=True)
        errors.append(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return None, f"{cc} could not build {SOURCE.name} ({errors[-1] if errors else 'no flags tried'})"


def build(flag_sets: tuple[tuple[str, ...], ...] = FLAG_SETS) -> tuple[ctypes.CDLL | None, str]:
    """Build (or find built) and load the kernels with the first of `flag_sets` that compiles:
    (library, "") or (None, why)."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler on PATH (cc, gcc or clang; or set CC)"
    so, why = _build(cc, SOURCE.read_bytes(), flag_sets)
    if so is None:
        return None, why
    lib = ctypes.CDLL(str(so))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in GEMV_TYPES:
        gemv = getattr(lib, f"strata_{name}_gemv")
        gemv.argtypes = [p, p, i64, i64, p, i64, p, i64, i64]
        gemv.restype = None
    # the fused experts: the three projections' GEMVs (addresses of the functions above), then the planes
    lib.strata_swiglu.argtypes = [p, p, p, i64, p, p, p, p, p, p, i64, i64, p, p, p]
    lib.strata_swiglu.restype = None
    # the same split over threads inside the call (its own workers): the GEMV's address first, then
    # its arguments less the row range, then the thread count; the experts' with one scratch per thread
    lib.strata_gemv_threads.argtypes = [p, p, p, i64, i64, p, i64, p, i64]
    lib.strata_gemv_threads.restype = None
    lib.strata_swiglu_threads.argtypes = [p, p, p, i64, p, p, p, p, p, p, i64, i64, p, p, p, i64]
    lib.strata_swiglu_threads.restype = None
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first call, then cached), or None where they cannot be."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"], _loaded["reason"] = build()
        return _loaded["lib"]


def reason() -> str:
    """Why `library()` is None ("" where it loaded)."""
    library()
    return str(_loaded["reason"])
