"""Tier 2 against mlx-lm's own loop: decode ms/token on the same checkpoint directory.

    python benchmarks/tier2.py DIR [--tokens 64] [--prompt-tokens 64]

Rows: mlx-lm's own `generate_step` with every expert resident; tier 2 with every expert in the
arena (the acceptance bound: within 10% of mlx-lm); tier 2 streaming a quarter of the experts
with the read-ahead on (depth 16) and off, with urgent misses and read-ahead hits per token from
the stream report. DIR is an mlx-community checkpoint, or one made at a real model's per-layer
shape by benchmarks/make_tier2_checkpoint.py (the GPU runs: `bash benchmarks/device_run.sh tier2`
makes a qwen3_next and a deepseek_v3 one and runs this on each). Greedy, the same
prompt token ids for every row, one warm-up call each. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def mlx_lm_ms_per_token(directory: Path, prompt: list[int], tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model = load_model(directory)[0]
    for _ in generate_step(mx.array(prompt), model, max_tokens=2):  # warm up
        pass
    start, n = None, 0
    for _ in generate_step(mx.array(prompt), model, max_tokens=tokens + 1):
        if start is None:  # the first token ends the prompt: time the decode steps after it
            start = time.perf_counter()
        else:
            n += 1
    return (time.perf_counter() - start) * 1e3 / max(n, 1)


def tier2_row(directory: Path, prompt: list[int], tokens: int, config) -> dict:
    import strata

    with strata.load(directory) as model:
        strata.generate(model, prompt[:8], max_tokens=2, config=config)  # warm up (and open the engine)
        result = strata.generate(model, prompt, max_tokens=tokens, config=config)
    r = result.report
    return {"ms_per_token": r.ms_per_token, "urgent_misses_per_token": r.urgent_misses_per_token,
            "readahead_hits_per_token": r.readahead_hits_per_token, "arena_slots": r.arena_slots}


def main() -> None:
    from strata.config import Config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    args = ap.parse_args()
    import mlx.core as mx

    import strata

    from strata.tier2.engine import cache_config_for

    with strata.load(args.directory) as model:  # a quarter of the experts, or the smallest legal arena if larger
        least = cache_config_for(model, Config(prefetch=16), 1).min_capacity
        vocab, quarter = model.cfg.vocab_size, max(model.tensors.n_records // 4, least)
    prompt = np.random.default_rng(0).integers(100, min(vocab, 30000), args.prompt_tokens).tolist()
    rows = {"mlx-lm generate_step, all resident": {"ms_per_token": mlx_lm_ms_per_token(args.directory, prompt,
                                                                                       args.tokens)}}
    rows["tier 2, all resident"] = tier2_row(args.directory, prompt, args.tokens, Config(prefetch=16))
    for name, k in (("read-ahead 16", 16), ("read-ahead off", 0)):
        rows[f"tier 2, quarter arena, {name}"] = tier2_row(args.directory, prompt, args.tokens,
                                                           Config(prefetch=k, arena=f"{quarter}slots"))
    base = rows["mlx-lm generate_step, all resident"]["ms_per_token"]
    print(f"{'row':42} {'ms/token':>9} {'vs mlx-lm':>9} {'misses/tok':>10} {'ahead hits/tok':>14}"
          f"   ({args.directory.name}, {args.tokens} tokens, MLX device {mx.default_device()})")
    for name, r in rows.items():
        print(f"{name:42} {r['ms_per_token']:9.2f} {r['ms_per_token'] / base:9.2f} "
              f"{r.get('urgent_misses_per_token', 0):10.2f} {r.get('readahead_hits_per_token', 0):14.2f}")
    print(json.dumps({"benchmark": "tier2", "model": args.directory.name, "tokens": args.tokens,
                      "device": str(mx.default_device()), "rows": rows}))


if __name__ == "__main__":
    main()
