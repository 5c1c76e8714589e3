"""Rewrite the locality curve (`locality.json`): replay strata's own models over held-out text.

    python -m strata.doctor.calibrate [--tokens 384] [--out strata/doctor/locality.json]

For each calibration model (the embedded model; the made `small` and `demo` shapes), record a
λ = 0 trace of the first TOKENS tokens of the held-out Python text, then replay it at arena
fractions from the smallest legal arena to every expert, at the default configuration
(`strata.Config()`: K = 10 and the stock MoCE policy).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

FRACTIONS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
MADE_SHAPES = ("small", "demo")


def curve_for(name: str, model, tokens: list[int], config) -> dict:
    from strata.tools.closed_loop import LoopConfig
    from strata.tools.quality import fast_params
    from strata.tools.replay import ReplayInputs, replay
    from strata.tools.trace import record_trace
    from strata.runtime.decode import cache_config_for

    trace = record_trace(fast_params(model.resident_params()), tokens)
    inputs = ReplayInputs(trace)
    total = trace.n_layers * trace.n_experts
    least = cache_config_for(model, config, 1).min_capacity
    caps = sorted({least} | {max(least, int(round(f * total))) for f in FRACTIONS})
    out = {"name": name, "fraction": [], "urgent_per_lookup": [], "reads_per_lookup": [], "total_experts": total}
    lookups = trace.n_layers * trace.top_k
    warmup = len(tokens) // 4
    for cap in caps:
        r = replay(inputs, LoopConfig.from_config(config, min(cap, total)), warmup=warmup)
        out["fraction"].append(cap / total)
        out["urgent_per_lookup"].append(r.urgent_per_token / lookups)
        out["reads_per_lookup"].append(r.reads_per_token / lookups)
        print(f"{name}: {cap} slots ({cap / total:.2f}): urgent {r.urgent_per_token:.2f}/token, "
              f"reads {r.reads_per_token:.2f}/token, hit {r.hit_rate:.4f}", flush=True)
    return out


def main(argv=None) -> int:
    from strata.config import Config
    from strata.default_model import default_model_path
    from strata.loader import load
    from strata.testing.models import make_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--out", default=str(Path(__file__).with_name("locality.json")))
    args = p.parse_args(argv)
    config = Config()  # what a run gets by default (its MoCE policy included)
    text = (Path(__file__).parents[1] / "data" / "heldout.txt").read_text()
    models = [("default", load(default_model_path()))]
    with tempfile.TemporaryDirectory() as d:
        for shape in MADE_SHAPES:
            made = make_model(Path(d) / shape, shape)
            models.append((shape, load(made.model_path)))
        curves = []
        for name, model in models:
            tokens = model.tokenizer.encode(text)[: min(args.tokens, model.cfg.max_context - 1)]
            curves.append(curve_for(name, model, tokens, config))
            model.experts_file.close()
    data = {"prefetch": config.prefetch, "lambda": config.moce_lambda, "J": config.moce_j, "tokens": args.tokens,
            "models": curves}
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}; mean urgent/lookup at 0.25: "
          f"{np.mean([np.interp(0.25, c['fraction'], c['urgent_per_lookup']) for c in curves]):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
