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
from pathlib import Path

import strata
from strata.config import Backend, Config
from strata.default_model import EMBEDDED

HELDOUT = Path(strata.__file__).parent / "data" / "heldout.txt"

PROMPT = "def fibonacci(n):"


def ms_per_token(model, config: Config, tokens: int) -> float:
    strata.generate(model, PROMPT, max_tokens=2, config=config)  # warm up: kernels, caches
    start = time.perf_counter()
    result = strata.generate(model, PROMPT, max_tokens=tokens, config=config)
    return (time.perf_counter() - start) * 1e3 / max(len(result.tokens), 1)


def prompt_tok_s(model, config: Config, text: str) -> float:
    """Prompt tokens per second: one call that decodes a single token after `text`."""
    # the warm-up text shares no prefix with `text`: the session would otherwise reuse it
    strata.generate(model, text[-200:], max_tokens=1, config=config)
    return strata.generate(model, text, max_tokens=1, config=config).prompt_tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(EMBEDDED))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, default=2000, help="prompt length, characters of the held-out text")
    args = ap.parse_args()
    model = strata.load(args.model)
    import mlx.core as mx

    device = str(mx.default_device())
    quarter = f"{model.cfg.n_layers * model.cfg.n_experts // 4}slots"
    text = HELDOUT.read_text()[:args.prompt_chars]
    rows, prompt = {}, {}
    for mode, arena in (("all-resident", ""), (f"streaming {quarter}", quarter)):
        for b in (Backend.NUMPY, Backend.MLX):
            config = Config(backend=b, arena=arena)
            rows[f"{b.value} {mode}"] = ms_per_token(model, config, args.tokens)
            prompt[f"{b.value} {mode}"] = prompt_tok_s(model, config, text)
    print(f"{'backend, mode':32} {'decode ms/token':>15} {'prompt tok/s':>13}   ({args.tokens} tokens, MLX device {device})")
    for name, ms in rows.items():
        print(f"{name:32} {ms:15.2f} {prompt[name]:13.0f}")
    modes = ("all-resident", f"streaming {quarter}")
    ratios = {mode: rows[f"mlx {mode}"] / rows[f"numpy {mode}"] for mode in modes}
    prompt_ratios = {mode: prompt[f"mlx {mode}"] / prompt[f"numpy {mode}"] for mode in modes}
    for mode in modes:
        print(f"mlx / numpy, {mode}: decode time {ratios[mode]:.2f}x, prompt speed {prompt_ratios[mode]:.2f}x")
    print("JSON " + json.dumps({"model": args.model, "tokens": args.tokens, "mlx_device": device,
                                "ms_per_token": rows, "mlx_over_numpy": ratios, "prompt_tok_s": prompt,
                                "mlx_over_numpy_prompt_speed": prompt_ratios}))


if __name__ == "__main__":
    main()
