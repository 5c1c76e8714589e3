"""Fuzz strata's files and reads: mutated `.experts`, mutated `.gguf`, I/O fault schedules.

    PYTHONPATH=$PWD python tests/fuzz/fuzz_files.py [--experts 320] [--gguf 320] [--faults 220] \
        [--seed 0] [--timeout 30] [--json out.json] [--by-kind] [--no-verify-reads]

One small made model (the "tiny" shape, 32 experts) is the unmutated run. Each case mutates a
copy of its files (or, for a fault schedule, the reads) and runs it twice, resident (every
expert read at load, the reference engine) and streaming (the smallest legal arena, so most
experts are read while generating), with the default configuration (`verify_reads` on, λ = 0):
prompt, then 6 greedy tokens. A run ends in one of

- `refused`: a strata error with a one-line message (the intended outcome for a bad file);
- `same`: the same tokens and bit-identical logits as the unmutated run (the mutation did not
  matter, e.g. an expert the prompt never routes to, or the padding after a record);
- `WRONG`: different output and no error (the failure this script exists to find);
- `TRACEBACK`: any other exception, or a message of several lines;
- `HANG`: no result within --timeout seconds (SIGALRM in the main thread).

Mutations are raw (bytes flipped, zeroed, cut or added, with every checksum left as it was) and
structural (a field rewritten, then the checksums that cover it recomputed, so the reader's
own checks are what must refuse it: a tensor's type, offset or dims, `general.alignment`, counts,
lengths, config values, header fields, swapped records or checksum-table entries). Fault
schedules combine random delays with EIO, short reads, flipped bytes, a record overwritten on disk
mid-run, the file truncated mid-run, a reader that raises, and a read that stalls past
`io_timeout` (set to 2 s for the fault runs; 60 s by default). docs/reliability.md has results.
Its sibling tests/fuzz/fuzz_api.py fuzzes what is not a file: a Model shared by threads and
iterators, Config values, convert's pass-through of stored blocks, the server's connections.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import shutil
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import strata  # noqa: E402
from strata.config import Config  # noqa: E402
from strata.numpy_backend.engine import ReferenceEngine  # noqa: E402
from strata.errors import StrataError  # noqa: E402
from strata.formats import experts_file as xfmt  # noqa: E402
from strata.formats.checksum import checksum  # noqa: E402
from strata.formats.gguf_file import open_gguf  # noqa: E402
from strata.formats.model_file import KEY_FILE_CHECKSUM  # noqa: E402
from strata.runtime.decode import arena_plan_for  # noqa: E402
from strata.testing.faults import Faults, RandomDelays  # noqa: E402
from strata.testing.engines import open_numpy_streaming  # noqa: E402
from strata.testing.models import make_model  # noqa: E402

from outcomes import close, table, totals_of  # noqa: E402  (beside this file)

PROMPT = list(b"def fib(n):")
N_TOKENS = 6
BASE = Config(moce_lambda=0.0)  # every default but λ, which the lead's issue-23 work sets to 0 too
FAULT_IO_TIMEOUT = 2.0


class _Hang(BaseException):
    pass


def _alarm(signum, frame):
    raise _Hang()


# ---------------------------------------------------------------- running one case


def greedy(engine) -> tuple[list[int], np.ndarray]:
    logits = [engine.prefill(PROMPT)]
    tokens = []
    for _ in range(N_TOKENS):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(engine.decode(tokens[-1]))
    return tokens, np.stack(logits)


def run_resident(model_path: Path, config: Config):
    model = strata.load(model_path)
    try:
        return greedy(ReferenceEngine(model.resident_params()))
    finally:
        model.experts_file.close()


def run_streaming(model_path: Path, config: Config, hook=None, slots: int = 0):
    model = strata.load(model_path)
    try:
        cfg = config.replace(arena=f"{slots}slots")
        with open_numpy_streaming(model, cfg, hook=hook) as engine:
            return greedy(engine)
    finally:
        model.experts_file.close()


def classify(fn, baseline, timeout: float) -> tuple[str, str]:
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        tokens, logits = fn()
        outcome = "same" if tokens == baseline[0] and np.array_equal(logits, baseline[1]) else "WRONG"
        if outcome == "same":
            return outcome, ""
        if tokens == baseline[0]:
            return outcome, f"same tokens, logits differ by up to {float(np.max(np.abs(logits - baseline[1]))):.3g}"
        return outcome, f"tokens {tokens} vs {baseline[0]}"
    except _Hang:
        return "HANG", f"no result in {timeout:g} s"
    except StrataError as e:
        msg = str(e)
        return ("refused", msg) if "\n" not in msg and msg else ("TRACEBACK", f"multi-line: {msg!r}")
    except BaseException as e:  # noqa: BLE001 - counting them is the point
        return "TRACEBACK", f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


# ---------------------------------------------------------------- .experts mutations


def _reseal_experts(raw: bytearray) -> None:
    """Recompute the header checksum over [0, 176 + 4N) (N from the header as it now reads)."""
    v = xfmt._unpack_fields(bytes(raw[: xfmt.HEADER_SIZE]))
    n = v["n_layers"] * v["n_experts"]
    end = xfmt.HEADER_SIZE + 4 * n
    if end + 4 <= len(raw):
        raw[end: end + 4] = struct.pack("<I", checksum(bytes(raw[:end])))


def experts_mutations(pristine: bytes, other: bytes, rng: np.random.Generator, count: int):
    """Yield (kind, mutated bytes)."""
    v = xfmt._unpack_fields(pristine[: xfmt.HEADER_SIZE])
    n, data, stride, rec = v["n_layers"] * v["n_experts"], v["data_offset"], v["padded_bytes"], v["record_bytes"]
    table = xfmt.HEADER_SIZE
    field_at = {}
    off = 0
    for name, code in xfmt.HEADER_FIELDS:
        field_at[name] = (off, code)
        off += struct.calcsize(code)
    extremes = [0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
    kinds = ["flip header", "flip table", "flip header crc", "flip record", "flip padding", "truncate", "append",
             "zero record", "swap records", "other model's experts", "field", "field", "field",
             "swap table entries", "resealed record edit", "swap records with their checksums"]
    for i in range(count):
        kind = kinds[i % len(kinds)]
        raw = bytearray(pristine)
        if kind == "flip header":
            raw[int(rng.integers(0, xfmt.HEADER_SIZE))] ^= 1 << int(rng.integers(0, 8))
        elif kind == "flip table":
            raw[int(rng.integers(table, table + 4 * n))] ^= 1 << int(rng.integers(0, 8))
        elif kind == "flip header crc":
            raw[int(rng.integers(table + 4 * n, table + 4 * n + 4))] ^= 0xFF
        elif kind == "flip record":
            r = int(rng.integers(0, n))
            raw[data + r * stride + int(rng.integers(0, rec))] ^= 1 << int(rng.integers(0, 8))
        elif kind == "flip padding":
            r = int(rng.integers(0, n))
            raw[data + r * stride + int(rng.integers(rec, stride))] ^= 0xFF
        elif kind == "truncate":
            raw = raw[: int(rng.integers(0, len(raw)))]
        elif kind == "append":
            raw += bytes(int(rng.integers(1, 8192)))
        elif kind == "zero record":
            r = int(rng.integers(0, n))
            raw[data + r * stride: data + (r + 1) * stride] = bytes(stride)
        elif kind in ("swap records", "swap records with their checksums"):
            a, b = rng.choice(n, 2, replace=False)
            ra, rb = bytes(raw[data + a * stride: data + (a + 1) * stride]), bytes(raw[data + b * stride: data + (b + 1) * stride])
            raw[data + a * stride: data + (a + 1) * stride], raw[data + b * stride: data + (b + 1) * stride] = rb, ra
            if kind.endswith("checksums"):
                ta, tb = bytes(raw[table + 4 * a: table + 4 * a + 4]), bytes(raw[table + 4 * b: table + 4 * b + 4])
                raw[table + 4 * a: table + 4 * a + 4], raw[table + 4 * b: table + 4 * b + 4] = tb, ta
                _reseal_experts(raw)
        elif kind == "other model's experts":
            raw = bytearray(other)
        elif kind == "field":
            name = list(field_at)[int(rng.integers(1, len(field_at)))]  # not the magic
            at, code = field_at[name]
            bits = 32 if code == "I" else 64
            choice = rng.integers(0, 3)
            old = struct.unpack_from("<" + code, raw, at)[0]
            if choice == 0:
                new = int(extremes[int(rng.integers(0, len(extremes)))]) % (1 << bits)
            elif choice == 1:
                new = (old + int(rng.integers(-4096, 4097))) % (1 << bits)
            else:
                new = old ^ (1 << int(rng.integers(0, bits)))
            struct.pack_into("<" + code, raw, at, new)
            _reseal_experts(raw)
            kind = f"field {name}"
        elif kind == "swap table entries":
            a, b = rng.choice(n, 2, replace=False)
            ta, tb = bytes(raw[table + 4 * a: table + 4 * a + 4]), bytes(raw[table + 4 * b: table + 4 * b + 4])
            raw[table + 4 * a: table + 4 * a + 4], raw[table + 4 * b: table + 4 * b + 4] = tb, ta
            _reseal_experts(raw)
        elif kind == "resealed record edit":  # a valid, different expert set: only the identity tells
            r = int(rng.integers(0, n))
            start = data + r * stride
            raw[start + int(rng.integers(0, rec))] ^= 1 << int(rng.integers(0, 8))
            struct.pack_into("<I", raw, table + 4 * r, checksum(bytes(raw[start: start + rec])))
            _reseal_experts(raw)
        yield kind.split(" ")[0] if kind.startswith("field") else kind, bytes(raw)


# ---------------------------------------------------------------- .gguf mutations


class _GGUFMap:
    """Where the pristine file keeps what the structural mutations rewrite."""

    def __init__(self, path: Path) -> None:
        gf = open_gguf(path)
        try:
            self.fields = {k: (f.type, f.offset) for k, f in gf.fields.items()}
            self.seal_at = gf.fields[KEY_FILE_CHECKSUM].offset
            self.data_offset = gf.data_offset
            self.tensors = list(gf.tensors.values())
            raw = path.read_bytes()
            # tensor info records: find each name's bytes, then n_dims, dims, type, offset follow
            self.info_at = {}
            pos = 0
            for t in self.tensors:
                name = t.name.encode()
                at = raw.index(struct.pack("<Q", len(name)) + name, pos)
                p = at + 8 + len(name)
                self.info_at[t.name] = {"n_dims": p, "dims": p + 4, "type": p + 4 + 8 * len(t.dims),
                                        "offset": p + 4 + 8 * len(t.dims) + 4}
                pos = p
        finally:
            gf.close()


def _reseal_gguf(raw: bytearray, seal_at: int) -> None:
    raw[seal_at: seal_at + 4] = bytes(4)
    struct.pack_into("<I", raw, seal_at, checksum(bytes(raw)))


def gguf_mutations(pristine: bytes, m: _GGUFMap, rng: np.random.Generator, count: int):
    ggml_types = [0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 24, 26, 28, 30, 31, 255]  # F32 F16 Q4_0.. BF16, junk
    kinds = ["flip", "flip header", "truncate", "append", "zero range", "tensor type", "tensor offset",
             "tensor offset", "tensor dims", "n_dims", "alignment", "counts", "config value", "metadata type",
             "string length", "non-finite weight"]
    f32_tensors = [t for t in m.tensors if t.ggml_type == 0]
    for i in range(count):
        kind = kinds[i % len(kinds)]
        raw = bytearray(pristine)
        t = m.tensors[int(rng.integers(0, len(m.tensors)))]
        info = m.info_at[t.name]
        if kind == "flip":
            raw[int(rng.integers(0, len(raw)))] ^= 1 << int(rng.integers(0, 8))
        elif kind == "flip header":
            raw[int(rng.integers(0, m.data_offset))] ^= 1 << int(rng.integers(0, 8))
        elif kind == "truncate":
            raw = raw[: int(rng.integers(0, len(raw)))]
        elif kind == "append":
            raw += bytes(int(rng.integers(1, 256)))
        elif kind == "zero range":
            a = int(rng.integers(0, len(raw)))
            n = min(int(rng.integers(1, 64)), len(raw) - a)
            raw[a: a + n] = bytes(n)
        elif kind == "tensor type":  # the type changed without its bytes
            struct.pack_into("<I", raw, info["type"], int(rng.choice([x for x in ggml_types if x != t.ggml_type])))
        elif kind == "tensor offset":
            other = m.tensors[int(rng.integers(0, len(m.tensors)))]
            new = int(rng.choice([2**64 - 1, 2**63, t.offset + 1, t.offset + 32, max(t.offset - 32, 0), other.offset,
                                  0, t.offset + t.nbytes]))
            struct.pack_into("<Q", raw, info["offset"], new % 2**64)
        elif kind == "tensor dims":
            d = int(rng.integers(0, len(t.dims)))
            new = int(rng.choice([0, 1, 2 * t.dims[d], max(t.dims[d] // 2, 1), 2**63, 2**64 - 1, t.dims[d] + 32]))
            struct.pack_into("<Q", raw, info["dims"] + 8 * d, new % 2**64)
        elif kind == "n_dims":
            struct.pack_into("<I", raw, info["n_dims"], int(rng.choice([0, 1, 2, 3, 5, 2**32 - 1])))
        elif kind == "alignment":  # declare general.alignment = X over a file aligned to 32
            raw = bytearray(_with_alignment(pristine, int(rng.choice([1, 8, 16, 64, 128, 4096, 0, 3, 48]))))
            yield kind, bytes(raw)
            continue
        elif kind == "counts":
            at = int(rng.choice([8, 16]))
            old = struct.unpack_from("<Q", raw, at)[0]
            struct.pack_into("<Q", raw, at, int(rng.choice([0, old - 1, old + 1, 2**32, 2**64 - 1])) % 2**64)
        elif kind == "config value":
            key, value = _bad_config_value(rng)
            vtype, at = m.fields[key]
            struct.pack_into("<d" if vtype == 12 else "<I", raw, at, value)
        elif kind == "metadata type":  # a value's type tag, same size where one exists
            scalars = [k for k, (_, at) in m.fields.items() if at > 0]  # scalars: their value offset is known
            key = scalars[int(rng.integers(0, len(scalars)))]
            vtype, at = m.fields[key]
            struct.pack_into("<I", raw, at - 4, int(rng.choice([0, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 99])))
        elif kind == "string length":
            key = [k for k, (vt, _) in m.fields.items() if vt == 8][int(rng.integers(0, 3))]
            at = _string_len_at(pristine, key)
            old = struct.unpack_from("<Q", raw, at)[0]
            struct.pack_into("<Q", raw, at, int(rng.choice([0, old + 1, old - 1, 2**63, 2**64 - 1])) % 2**64)
        elif kind == "non-finite weight":
            t = f32_tensors[int(rng.integers(0, len(f32_tensors)))]
            at = m.data_offset + t.offset + 4 * int(rng.integers(0, t.nbytes // 4))
            struct.pack_into("<f", raw, at, float(rng.choice([np.nan, np.inf, -np.inf])))
        if kind not in ("flip", "flip header", "truncate", "append", "zero range"):
            _reseal_gguf(raw, m.seal_at)  # structural: only the reader's own checks can refuse it
        yield kind, bytes(raw)


def _string_len_at(raw: bytes, key: str) -> int:
    k = key.encode()
    return raw.index(struct.pack("<Q", len(k)) + k) + 8 + len(k) + 4


def _bad_config_value(rng) -> tuple[str, object]:
    cases = [("strata.rope_theta", float("nan")), ("strata.rope_theta", 0.0), ("strata.rope_theta", -1.0),
             ("strata.rope_theta", float("inf")), ("strata.rms_norm_eps", -1.0), ("strata.rms_norm_eps", float("nan")),
             ("strata.n_layers", 2**32 - 1), ("strata.n_layers", 0), ("strata.n_experts", 2**32 - 1),
             ("strata.vocab_size", 2**32 - 1), ("strata.hidden_size", 2**31), ("strata.n_experts_per_token", 999),
             ("strata.head_dim", 7), ("strata.max_context", 0)]
    return cases[int(rng.integers(0, len(cases)))]


def _with_alignment(pristine: bytes, alignment: int) -> bytes:
    """The pristine file with a `general.alignment` key added (everything else as it was: the
    data still sits where 32-byte alignment put it), resealed."""
    key = b"general.alignment"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<II", 4, alignment)
    n_kv = struct.unpack_from("<Q", pristine, 16)[0]
    raw = bytearray(pristine[:24] + kv + pristine[24:])
    struct.pack_into("<Q", raw, 16, n_kv + 1)
    gf_seal = bytes(pristine).index(struct.pack("<Q", len(KEY_FILE_CHECKSUM)) + KEY_FILE_CHECKSUM.encode())
    seal_at = gf_seal + 8 + len(KEY_FILE_CHECKSUM) + 4 + len(kv)
    _reseal_gguf(raw, seal_at)
    return bytes(raw)


# ---------------------------------------------------------------- fault schedules


class _DiskWriter:
    """After `after` reads, damage the file on disk once: overwrite a record or truncate."""

    def __init__(self, path: Path, after_reads: int, action: str, offset: int, nbytes: int) -> None:
        self.path, self.after_reads, self.action, self.offset, self.nbytes = path, after_reads, action, offset, nbytes
        self.reads, self.done = 0, False

    def before(self, req) -> None:
        self.reads += 1
        if self.reads >= self.after_reads and not self.done:
            self.done = True
            with open(self.path, "r+b") as f:
                if self.action == "overwrite":
                    f.seek(self.offset)
                    f.write(os.urandom(self.nbytes))
                else:
                    f.truncate(self.offset)

    def after(self, req, buf, got):  # noqa: D102 - IOHook
        return got


class _Chain:
    def __init__(self, *hooks) -> None:
        self.hooks = hooks

    def before(self, req) -> None:
        for h in self.hooks:
            h.before(req)

    def after(self, req, buf, got):
        for h in self.hooks:
            got = h.after(req, buf, got)
        return got


class _Raises:
    def __init__(self, keys, exc) -> None:
        self.keys, self.exc = keys, exc

    def before(self, req) -> None:
        if (req.layer, req.expert) in self.keys:
            raise self.exc

    def after(self, req, buf, got):
        return got


class _Stall:
    def __init__(self, keys, seconds: float) -> None:
        self.keys, self.seconds = keys, seconds

    def before(self, req) -> None:
        if (req.layer, req.expert) in self.keys:
            time.sleep(self.seconds)

    def after(self, req, buf, got):
        return got


def fault_schedules(rng, count: int, n_layers: int, n_experts: int):
    """Yield (kind, make_hook(experts_path, experts_file) -> hook)."""
    kinds = ["delays", "eio", "short", "corrupt", "mixed", "overwrite on disk", "truncate on disk",
             "reader raises", "stall past io_timeout"]
    for i in range(count):
        kind = kinds[i % len(kinds)]
        seed = int(rng.integers(0, 2**31))
        keys = {(int(rng.integers(0, n_layers)), int(rng.integers(0, n_experts))) for _ in range(int(rng.integers(1, 6)))}
        delays = RandomDelays(seed=seed, max_ms=float(rng.choice([0.2, 1.0, 3.0])))

        def make(path, xf, kind=kind, keys=keys, delays=delays, seed=seed):
            r = np.random.default_rng(seed)
            if kind == "delays":
                return delays
            if kind in ("eio", "short", "corrupt"):
                return Faults(**{kind: keys}, delays=delays)
            if kind == "mixed":
                ks = list(keys)
                return Faults(eio=ks[:1], short=ks[1:2], corrupt=ks[2:], delays=delays)
            if kind == "overwrite on disk":
                l, e = int(r.integers(0, n_layers)), int(r.integers(0, n_experts))
                w = _DiskWriter(path, int(r.integers(1, 40)), "overwrite", xf.record_offset(l, e) + int(r.integers(0, 512)),
                                int(r.integers(1, 4096)))
                return _Chain(delays, w)
            if kind == "truncate on disk":
                w = _DiskWriter(path, int(r.integers(1, 40)), "truncate", int(r.integers(0, xf.header.file_bytes)), 0)
                return _Chain(delays, w)
            if kind == "reader raises":
                exc = [OSError(errno.EIO, "I/O error"), RuntimeError("boom"), MemoryError(), ValueError("bad")][
                    int(r.integers(0, 4))]
                return _Chain(delays, _Raises(keys, exc))
            return _Chain(delays, _Stall(keys, FAULT_IO_TIMEOUT * 1.5))

        yield kind, make


# ---------------------------------------------------------------- driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=320, help="mutated .experts files")
    ap.add_argument("--gguf", type=int, default=320, help="mutated .gguf files")
    ap.add_argument("--faults", type=int, default=220, help="I/O fault schedules (streaming)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds before a run counts as a hang")
    ap.add_argument("--json", help="write the counts and every bad case here")
    ap.add_argument("--verbose", action="store_true", help="print every case")
    ap.add_argument("--by-kind", action="store_true", help="also print the outcomes per kind of mutation")
    ap.add_argument("--no-verify-reads", action="store_true",
                    help="the lossy knob: streaming reads unverified (shows what verification catches)")
    args = ap.parse_args(argv)
    global BASE
    if args.no_verify_reads:
        BASE = BASE.replace(verify_reads=False)
    signal.signal(signal.SIGALRM, _alarm)
    rng = np.random.default_rng(args.seed)
    work = Path(tempfile.mkdtemp(prefix="strata-fuzz-"))
    start = time.perf_counter()
    try:
        made = make_model(work / "base", "tiny", seed=3, n_experts=32)
        other = make_model(work / "other", "tiny", seed=4, n_experts=32)
        pristine_m, pristine_x = made.model_path.read_bytes(), made.experts_path.read_bytes()
        model = strata.load(made.model_path)
        slots = arena_plan_for(model, BASE.replace(arena="100000slots")).min_slots
        model.experts_file.close()
        base_res = run_resident(made.model_path, BASE)
        base_str = run_streaming(made.model_path, BASE, slots=slots)
        case_m, case_x = work / "case.gguf", work / "case.experts"

        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        bad: list[dict] = []

        by_kind: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)

        def record(group, kind, mode, outcome, detail):
            counts[(group, mode)][outcome] += 1
            by_kind[(group, kind)][outcome] += 1
            if outcome not in ("refused", "same"):
                bad.append({"group": group, "kind": kind, "mode": mode, "outcome": outcome, "detail": detail})
            if args.verbose:
                print(f"{group:8} {mode:9} {kind:34} {outcome:9} {detail[:150]}", flush=True)

        def file_case(group, kind, gguf_bytes, experts_bytes):
            for mode in ("resident", "streaming"):
                case_m.write_bytes(gguf_bytes)
                case_x.write_bytes(experts_bytes)
                if mode == "resident":
                    outcome, detail = classify(lambda: run_resident(case_m, BASE), base_res, args.timeout)
                else:
                    outcome, detail = classify(lambda: run_streaming(case_m, BASE, slots=slots), base_str, args.timeout)
                record(group, kind, mode, outcome, detail)

        for kind, raw in experts_mutations(pristine_x, other.experts_path.read_bytes(), rng, args.experts):
            file_case("experts", kind, pristine_m, raw)
        gmap = _GGUFMap(made.model_path)
        for kind, raw in gguf_mutations(pristine_m, gmap, rng, args.gguf):
            file_case("gguf", kind, raw, pristine_x)
        fault_cfg = BASE.replace(io_timeout=FAULT_IO_TIMEOUT)
        for kind, make in fault_schedules(rng, args.faults, made.cfg.n_moe_layers, made.cfg.n_experts):
            case_m.write_bytes(pristine_m)
            case_x.write_bytes(pristine_x)

            def go(make=make):
                model = strata.load(case_m)
                try:
                    hook = make(case_x, model.experts_file)
                    with open_numpy_streaming(model, fault_cfg.replace(arena=f"{slots}slots"), hook=hook) as engine:
                        return greedy(engine)
                finally:
                    model.experts_file.close()

            outcome, detail = classify(go, base_str, args.timeout)
            record("faults", kind, "streaming", outcome, detail)
        seconds = time.perf_counter() - start
    finally:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        shutil.rmtree(work, ignore_errors=True)

    table(counts, "mode", 10)
    totals = totals_of(counts)
    print(f"cases: {args.experts} .experts, {args.gguf} .gguf, {args.faults} fault schedules; "
          f"{sum(totals.values())} runs in {seconds:.0f} s; WRONG {totals['WRONG']}, TRACEBACK {totals['TRACEBACK']}, "
          f"HANG {totals['HANG']}")
    if args.by_kind:
        print()
        table(dict(sorted(by_kind.items())), "kind", 34)
    return close(bad=bad, counts=counts, by_kind=by_kind, totals=totals, seconds=seconds, args=args)


if __name__ == "__main__":
    sys.exit(main())
