"""Stress the streaming MLX engine against the reference (GPU): the engine tests' tiny model, a
small arena and short prompt chunks (several passes per prompt layer), many runs per read mode
(O_DIRECT, buffered), counting runs whose logits leave the reference's tolerance.

    python tests/fuzz/stress_streaming.py [--runs 30] [--arena 40slots] [--chunk 3]

Prints one line per read mode and a JSON line. (The engine tests failed on the H200 twice, with
O_DIRECT reads only: 28 slots / 5-position chunks, then 40 slots / 3; this script then showed
1 of 40 O_DIRECT runs off and 0 of 80 buffered ones, and the MLX engine takes buffered reads on
CUDA since: `MlxArena.direct_reads_refused`.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from strata.config import Backend, Config  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.engines import open_engine  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.numpy_backend.engine import ReferenceEngine  # noqa: E402
from strata.testing.models import make_model  # noqa: E402

PROMPT = list(b"def fibonacci(n):")


def run(engine, steps: int = 4) -> np.ndarray:
    out = [engine.prefill(PROMPT)]
    for _ in range(steps):
        out.append(engine.decode(int(np.argmax(out[-1]))))
    return np.stack(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--arena", default="40slots")
    ap.add_argument("--chunk", type=int, default=3)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp())  # /tmp: on the H200 machine ext4, so O_DIRECT reads are real
    model = load(make_model(tmp / "tiny", "tiny", seed=0, dense_type=QuantType.F16).model_path)
    ref = run(ReferenceEngine(model.resident_params()))
    res = {"runs": args.runs, "arena": args.arena, "chunk": args.chunk}
    for direct in (True, False):
        bad, worst, note, t0 = [], 0.0, "", time.time()
        for i in range(args.runs):
            eng = open_engine(model, Config(backend=Backend.MLX, arena=args.arena, moce_lambda=0.0,
                                            prefill_chunk=args.chunk, direct_io=direct))
            try:
                got = run(eng)
                note = eng.report().io
            finally:
                eng.close()
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            worst = max(worst, err)
            if err > 1e-4:
                steps = [float(np.linalg.norm(g - r) / np.linalg.norm(r)) for g, r in zip(got, ref)]
                bad.append((i, [round(s, 3) for s in steps]))
        name = "direct_io" if direct else "buffered"  # direct_io: the default, O_DIRECT where the engine takes it
        res[name] = {"failed": len(bad), "worst_rel": worst, "io": note, "s": time.time() - t0, "bad": bad[:5]}
        print(f"{name:<9} {len(bad)}/{args.runs} runs off the reference (worst {worst:.3g}); {note}; "
              f"{time.time() - t0:.1f} s; first bad: {bad[:3]}")
    print("JSON " + json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
