"""Fuzz strata's API surfaces: one Model shared by threads and iterators, Config values, convert's
pass-through of stored blocks, and the server's connections.

    PYTHONPATH=$PWD python tests/fuzz/fuzz_api.py [--sharing 40] [--config 200] [--convert 24] \
        [--serve 120] [--seed 0] [--timeout 30] [--json out.json] [--by-kind]

The sibling of tests/fuzz/fuzz_files.py (files and reads), with its outcomes:

- `refused`: a strata error (or the API's JSON error) in one line: the intended outcome here;
- `same`: the call gave what it gives alone (sharing), a valid value was taken (config), a
  clean source converted, a valid request was served;
- `WRONG`: other tokens than the call alone, a bad value accepted, a non-finite block sealed
  into the `.experts`, a bad request served (the failures this script exists to find);
- `TRACEBACK`: any other exception, a message of several lines, a response that is not the API's
  JSON, or an error with a traceback in the server's log;
- `HANG`: no result within --timeout seconds (a thread still running, a socket never closed).

Groups:
- sharing: random plans of 1-3 threads, each interleaving 1-4 generate / stream_generate calls
  on one model (greedy or sampled, prompts that share prefixes), resident (the reference
  engine) and streaming at the smallest arena; each call against the same call made alone on a
  model of its own. On a streaming model a second iterator on the thread that holds the session
  is refused (SessionBusyError: `refused`); anywhere else a refusal is WRONG.
- config: a random field given None, NaN, an infinity, a list, a negative number, a path in a
  missing directory, or /dev/full (which only a streaming run's write can refuse).
- convert: a llama.cpp GGUF (Q8_0, Q4_0 or F16 experts, copied through as stored) with one
  random block's scale, or one F16 weight, set to NaN or an infinity (and clean controls).
- serve: raw requests to a live uvicorn server on 127.0.0.1 (as `strata serve` runs it): a
  Content-Length larger than the body, a huge chunk declared, a client leaving mid-body, bytes
  that are not HTTP, a field of the wrong type (Anthropic's stop_sequences as a string, ...),
  and valid requests.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import strata  # noqa: E402
from strata.config import Config, field_types  # noqa: E402
from strata.errors import ConfigError, StrataError  # noqa: E402
from strata.runtime.decode import arena_plan_for  # noqa: E402
from strata.testing.models import make_model  # noqa: E402
from strata.testing.sharing import REFUSED, call_kwargs, run_threads  # noqa: E402

from outcomes import OUTCOMES, close, table, totals_of  # noqa: E402  (beside this file)

PROMPTS = (list(b"def f(x):"), list(b"def f(x): return x"), list(b"hello"), list(b"def g"))
SERVE_BODY_TIMEOUT = 0.5


def one_line(e: BaseException) -> tuple[str, str]:
    msg = str(e)
    if isinstance(e, StrataError) and msg and "\n" not in msg:
        return "refused", msg
    return "TRACEBACK", f"{type(e).__name__}: {' '.join(msg.split())[:200]}"


# ---------------------------------------------------------------- sharing


def sharing_cases(model_path: Path, rng, count: int, timeout: float):
    """Yield (kind, mode, outcome, detail) per call."""
    for mode in ("resident", "streaming"):
        model, alone_model = strata.load(model_path), strata.load(model_path)
        config = Config(backend="numpy")
        if mode == "streaming":
            slots = arena_plan_for(model, config.replace(arena="100000slots")).min_slots
            config = config.replace(arena=f"{slots}slots")
        alone: dict = {}
        try:
            for _ in range(count):
                plans = [_plan(rng) for _ in range(int(rng.integers(1, 4)))]
                kind = f"{len(plans)} thread{'s' if len(plans) > 1 else ''}"
                results, errors, finished = run_threads(model, config, plans, PROMPTS, timeout)
                if not finished:
                    yield kind, mode, "HANG", f"a thread still running after {timeout:g} s"
                    break  # the model is held by the hung thread
                for e in errors:
                    yield kind, mode, *one_line(e)
                for (calls, _), outcomes in zip(plans, results):
                    for call, got in zip(calls, outcomes or []):
                        key = call[1:]
                        if key not in alone:
                            kwargs = call_kwargs(call, PROMPTS)
                            alone[key] = strata.generate(alone_model, **kwargs, config=config).tokens
                        if got == REFUSED:
                            yield kind, mode, *(("refused", "SessionBusyError") if mode == "streaming" else
                                                ("WRONG", "refused on an engine that takes snapshots"))
                        elif got == alone[key]:
                            yield kind, mode, "same", ""
                        else:
                            yield kind, mode, "WRONG", f"call {call}: {got} vs alone {alone[key]}"
        finally:
            model.close()
            alone_model.close()


def _plan(rng) -> tuple[list, list]:
    calls = []
    for _ in range(int(rng.integers(1, 5))):
        temperature = float(rng.choice([0.0, 0.9]))
        calls.append((bool(rng.integers(0, 2)), int(rng.integers(0, len(PROMPTS))), int(rng.integers(1, 6)),
                      temperature, int(rng.integers(0, 4)) if temperature else 0))
    return calls, [int(x) for x in rng.integers(0, 4, size=int(rng.integers(0, 24)))]


# ---------------------------------------------------------------- config


def config_cases(model_path: Path, work: Path, rng, count: int):
    """Yield (kind, mode, outcome, detail)."""
    types = field_types()
    names = sorted(types)
    values = {"None": None, "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "a list": [3], "negative": -5,
              "missing dir": str(work / "missing" / "rows.bin"), "/dev/full": "/dev/full"}
    for i in range(count):
        kind = list(values)[i % len(values)]
        name = "logpos" if kind in ("missing dir", "/dev/full") else names[int(rng.integers(0, len(names)))]
        value = values[kind]
        must_refuse = value is None or (types[name] is float and isinstance(value, float)) or kind in (
            "missing dir", "/dev/full")
        try:
            config = Config(**{name: value})
            if kind == "/dev/full":  # opens fine; every write fails
                with strata.load(model_path) as model:
                    strata.generate(model, PROMPTS[0], max_tokens=2, config=config.replace(backend="numpy",
                                                                                           arena="100%"))
        except ConfigError as e:
            outcome, detail = one_line(e)
            if outcome == "refused" and not str(e).startswith(name):
                outcome, detail = "TRACEBACK", f"does not name {name}: {e}"
            yield f"{kind}", "api", outcome, detail
            continue
        except BaseException as e:  # noqa: BLE001 - counting them is the point
            yield kind, "api", "TRACEBACK", f"{name}={value!r}: {type(e).__name__}: {e}"
            continue
        yield kind, "api", *(("WRONG", f"{name}={value!r} accepted") if must_refuse else ("same", ""))


# ---------------------------------------------------------------- convert's pass-through


def convert_cases(work: Path, rng, count: int):
    """Yield (kind, mode, outcome, detail). The GGUFs are made from the checked-in test checkpoint
    (tests/fixtures), the way the GGUF tests make them."""
    import gguf

    from strata.convert import convert
    from tests import gguf_models, hf_fixtures

    hf_dir = hf_fixtures.copy_checkpoint("qwen3_moe", work / "hf")
    sources = {}
    for qtype in ("Q8_0", "Q4_0", "F16"):
        path = gguf_models.write_gguf(hf_dir, work / f"src_{qtype}.gguf", experts=qtype)
        experts = [t for t in gguf.GGUFReader(path).tensors if t.name.endswith("_exps.weight")]
        sources[qtype] = (path.read_bytes(), [(t.name, int(t.data_offset), np.asarray(t.data).shape,
                                               int(np.asarray(t.data).nbytes)) for t in experts])
    case = work / "case.gguf"
    for i in range(count):
        qtype = ("Q8_0", "Q4_0", "F16")[i % 3]
        raw, tensors = sources[qtype]
        raw = bytearray(raw)
        clean = i % 6 == 5
        name, offset, shape, nbytes = tensors[int(rng.integers(0, len(tensors)))]
        if not clean:
            poison = float(rng.choice([np.nan, np.inf, -np.inf]))
            if qtype == "F16":
                at = offset + 2 * int(rng.integers(0, nbytes // 2))
            else:  # a block: its f16 scale, then its codes (34 bytes a Q8_0 block, 18 a Q4_0)
                block = 34 if qtype == "Q8_0" else 18
                at = offset + block * int(rng.integers(0, nbytes // block))
            raw[at: at + 2] = np.float16(poison).tobytes()
        case.write_bytes(bytes(raw))
        out = work / f"out{i}"
        kind = f"{qtype} {'clean' if clean else 'non-finite'}"
        try:
            convert(case, out)
        except StrataError as e:
            outcome, detail = one_line(e)
            if clean or "non-finite" not in detail:
                outcome = "TRACEBACK" if outcome != "refused" else "WRONG"
            yield kind, "convert", outcome, detail
        except BaseException as e:  # noqa: BLE001
            yield kind, "convert", "TRACEBACK", f"{type(e).__name__}: {e}"
        else:
            yield kind, "convert", *(("same", "") if clean else ("WRONG", f"{name}: a non-finite value sealed"))
        for f in work.glob(f"out{i}*"):
            f.unlink()


# ---------------------------------------------------------------- serve


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


def serve_cases(model_path: Path, rng, count: int, timeout: float):
    """Yield (kind, mode, outcome, detail)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: serve_support
    from serve_support import NAME, live_server, make_app

    errors = _Errors()
    for logger in ("strata.serve", "uvicorn.error"):
        logging.getLogger(logger).addHandler(errors)
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    wrong_types = [("stop_sequences", "END"), ("stop_sequences", [3]), ("max_tokens", "2"), ("messages", {"a": 1}),
                   ("temperature", "hot"), ("stream", "yes"), ("system", 5), ("max_tokens", 2.5)]
    kinds = ["short body", "huge chunk", "leave mid-body", "not http", "wrong type", "valid"]
    with strata.load(model_path) as model, live_server(make_app(model, body_timeout_seconds=SERVE_BODY_TIMEOUT)) as url:
        port = int(url.rsplit(":", 1)[1])
        for i in range(count):
            kind = kinds[i % len(kinds)]
            path = str(rng.choice(["/v1/messages", "/v1/chat/completions"]))
            payload = dict(body)
            if kind == "wrong type":
                field, value = wrong_types[int(rng.integers(0, len(wrong_types)))]
                payload[field] = value
                kind = f"wrong type {field}"
            data = json.dumps(payload).encode()
            head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            if kind == "short body":
                request = f"{head}content-length: {len(data) + int(rng.integers(1, 10**6))}\r\n\r\n".encode() + data
            elif kind == "huge chunk":
                size = int(rng.integers(2**20, 2**40))  # declared, never sent
                request = f"{head}transfer-encoding: chunked\r\n\r\n{size:x}\r\n".encode() + data
            elif kind == "leave mid-body":
                sent = data[: int(rng.integers(0, len(data)))]
                request = f"{head}content-length: {len(data) + 50}\r\n\r\n".encode() + sent
            elif kind == "not http":
                request = bytes(rng.integers(33, 127, size=int(rng.integers(1, 200)), dtype=np.uint8)) + b"\r\n\r\n"
            else:
                request = f"{head}content-length: {len(data)}\r\nconnection: close\r\n\r\n".encode() + data
            before = len(errors.records)
            outcome, detail = _exchange(port, request, kind, timeout)
            if len(errors.records) > before:
                r = errors.records[-1]
                outcome, detail = "TRACEBACK", f"server log: {r.levelname} {r.getMessage()[:150]}"
            yield kind, "serve", outcome, detail
    for logger in ("strata.serve", "uvicorn.error"):
        logging.getLogger(logger).removeHandler(errors)


def _exchange(port: int, request: bytes, kind: str, timeout: float) -> tuple[str, str]:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(request)
            if kind == "leave mid-body":
                time.sleep(0.1)  # the server's log of it lands before the next case's count
                return "refused", "left"
            got = b""
            while chunk := s.recv(65536):
                got += chunk
    except socket.timeout:
        return "HANG", f"no close within {timeout:g} s"
    except OSError as e:  # the server closed first (reset): not a hang, but no JSON either
        return "TRACEBACK", f"{type(e).__name__}: {e}"
    head, _, payload = got.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
        error = json.loads(payload)
    except (ValueError, IndexError):
        return "TRACEBACK", f"not JSON: {got[:120]!r}"
    if kind == "valid":
        return ("same", "") if status == 200 else ("WRONG", f"{status}: {payload[:120]!r}")
    if 400 <= status < 500 and isinstance(error.get("error"), dict) and error["error"].get("message"):
        return "refused", error["error"]["message"]
    return ("WRONG" if status == 200 else "TRACEBACK"), f"{status}: {payload[:120]!r}"


# ---------------------------------------------------------------- driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sharing", type=int, default=40, help="thread plans per mode (resident, streaming)")
    ap.add_argument("--config", type=int, default=200, help="Config values")
    ap.add_argument("--convert", type=int, default=24, help="GGUF sources converted (every sixth clean)")
    ap.add_argument("--serve", type=int, default=120, help="raw requests to a live server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds before a case counts as a hang")
    ap.add_argument("--json", help="write the counts and every bad case here")
    ap.add_argument("--by-kind", action="store_true", help="also print the outcomes per kind of case")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    work = Path(tempfile.mkdtemp(prefix="strata-fuzz-api-"))
    counts: dict = collections.defaultdict(collections.Counter)
    by_kind: dict = collections.defaultdict(collections.Counter)
    bad: list[dict] = []
    start = time.perf_counter()
    try:
        made = make_model(work / "tiny", "tiny", seed=3, max_context=2048)  # served as "tiny"
        groups = [("sharing", sharing_cases(made.model_path, rng, args.sharing, args.timeout)),
                  ("config", config_cases(made.model_path, work, rng, args.config)),
                  ("convert", convert_cases(work, rng, args.convert)),
                  ("serve", serve_cases(made.model_path, rng, args.serve, args.timeout))]
        for group, cases in groups:
            for kind, mode, outcome, detail in cases:
                counts[(group, mode)][outcome] += 1
                by_kind[(group, kind)][outcome] += 1
                if outcome not in ("refused", "same"):
                    bad.append({"group": group, "kind": kind, "mode": mode, "outcome": outcome, "detail": detail})
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table(counts, "mode", 10)
    totals = totals_of(counts)
    print(f"{sum(totals.values())} runs in {seconds:.0f} s; WRONG {totals['WRONG']}, TRACEBACK {totals['TRACEBACK']}, "
          f"HANG {totals['HANG']}")
    if args.by_kind:
        print()
        table(dict(sorted(by_kind.items())), "kind", 30)
    print(json.dumps({"bench": "fuzz_api", "runs": sum(totals.values()), **{o: totals[o] for o in OUTCOMES},
                      "seconds": round(seconds, 1)}))
    return close(bad=bad, counts=counts, by_kind=by_kind, totals=totals, seconds=seconds, args=args)


if __name__ == "__main__":
    sys.exit(main())
