"""Which backend is faster on this machine: numpy vs MLX, all-resident decode of one model.

    python benchmarks/backends.py [MODEL] [--tokens 32]

This is the measurement behind `Backend.AUTO` (strata.generate.resolve_backend): on a machine
without an MLX GPU, MLX runs on its CPU backend. Prints a table and one JSON line (ratios from
one run on one machine).
"""

from __future__ import annotations

import argparse
import json
import time

import strata
from strata.config import Backend, Config
from strata.default_model import EMBEDDED

PROMPT = "def fibonacci(n):"


def ms_per_token(model, config: Config, tokens: int) -> float:
    strata.generate(model, PROMPT, max_tokens=2, config=config)  # warm up: kernels, caches
    start = time.perf_counter()
    result = strata.generate(model, PROMPT, max_tokens=tokens, config=config)
    return (time.perf_counter() - start) * 1e3 / max(len(result.tokens), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(EMBEDDED))
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    model = strata.load(args.model)
    import mlx.core as mx

    device = str(mx.default_device())
    quarter = f"{model.cfg.n_layers * model.cfg.n_experts // 4}slots"
    rows = {}
    for mode, arena in (("all-resident", ""), (f"streaming {quarter}", quarter)):
        for b in (Backend.NUMPY, Backend.MLX):
            rows[f"{b.value} {mode}"] = ms_per_token(model, Config(backend=b, arena=arena), args.tokens)
    print(f"{'backend, mode':32} {'ms/token':>9}   ({args.tokens} tokens, MLX device {device})")
    for name, ms in rows.items():
        print(f"{name:32} {ms:9.2f}")
    ratios = {mode: rows[f"mlx {mode}"] / rows[f"numpy {mode}"] for mode in ("all-resident", f"streaming {quarter}")}
    for mode, r in ratios.items():
        print(f"mlx / numpy, {mode}: {r:.2f}x")
    print("JSON " + json.dumps({"model": args.model, "tokens": args.tokens, "mlx_device": device,
                                "ms_per_token": rows, "mlx_over_numpy": ratios}))


if __name__ == "__main__":
    main()
