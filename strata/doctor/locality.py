"""How often an arena of a given size hits: the locality model.

Two sources, best first:
- **the model's own trace** (`strata trace`): the closed-loop replay (`strata.tools.replay`) at
  exactly the planned arena and configuration: the figures `strata replay` would print;
- **the calibrated curve**: urgent misses and reads per lookup as a function of the arena's
  fraction of all experts, measured by that same replay on strata's own models (the embedded
  model and the made `small` and `demo` shapes, on the held-out Python text), at the default
  configuration (`strata.Config()`: K = 10, the stock MoCE J = 3, λ = 0.85). `python -m strata.doctor.calibrate` rewrites
  `locality.json` beside this file. Between calibrated fractions it interpolates linearly; the
  spread between the calibration models is kept as the figure's uncertainty. A real model's
  routing may be more or less local than these small ones: the curve is a guide, the trace is
  the measurement.

A lookup is one (token, MoE layer, selected expert); a token makes `top_k × moe_layers`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Locality", "from_curve", "from_trace", "load_curve", "CURVE_PATH"]

CURVE_PATH = Path(__file__).with_name("locality.json")
TRACE_WARMUP_FRACTION = 0.25  # replay tokens that fill the cache before counting starts


@dataclass(frozen=True)
class Locality:
    hit_rate: float  # lookups served without an urgent read
    urgent_per_token: float
    reads_per_token: float  # urgent + read-ahead reads issued
    source: str  # "trace PATH" or "calibrated curve (...)"
    spread: float = 0.0  # +- on urgent_per_token from the calibration models' disagreement


def load_curve(path: Path = CURVE_PATH) -> dict:
    return json.loads(Path(path).read_text())


def from_curve(fraction: float, lookups_per_token: int, curve: dict | None = None, *, fill_per_token: float = 0.0
               ) -> Locality:
    """Urgent misses and reads per token at an arena holding `fraction` of all experts, in the
    steady state; `fill_per_token`: reads a short run adds filling a cold arena (slots / tokens)."""
    curve = curve or load_curve()
    if fraction >= 1.0:
        return Locality(1.0, 0.0, 0.0, "every expert resident")
    models = curve["models"]
    urgent, reads = [], []
    for m in models:
        xs = np.array(m["fraction"])
        urgent.append(float(np.interp(fraction, xs, m["urgent_per_lookup"])))
        reads.append(float(np.interp(fraction, xs, m["reads_per_lookup"])))
    u, r = float(np.mean(urgent)), float(np.mean(reads))
    names = ", ".join(m["name"] for m in models)
    below = fraction < min(m["fraction"][0] for m in models)
    return Locality(hit_rate=1.0 - u, urgent_per_token=u * lookups_per_token,
                    reads_per_token=r * lookups_per_token + fill_per_token,
                    source=f"calibrated curve ({names}; K={curve['prefetch']}, λ={curve['lambda']:g})"
                           + ("; below its smallest arena: a lower bound on misses" if below else ""),
                    spread=float(np.ptp(urgent)) / 2 * lookups_per_token)


def from_trace(trace_path: str | Path, config, capacity: int, *, horizon: int = 0, prompt: int = 0) -> Locality:
    """Replay the model's own trace at `capacity` slots under `config` (a strata.Config).

    horizon 0: the steady state (the first quarter of the trace fills the cache uncounted);
    horizon N: a run from a cold arena, `prompt` tokens then N decoded ones, counting the N
    (a short run pays for filling the arena)."""
    import dataclasses

    from strata.tools.closed_loop import LoopConfig
    from strata.tools.replay import replay
    from strata.tools.trace import load_trace

    trace = load_trace(trace_path)
    total = trace.n_layers * trace.n_experts
    if capacity >= total:
        return Locality(1.0, 0.0, 0.0, f"every expert resident (trace {Path(trace_path).name})")
    if horizon:
        n = min(trace.n_tokens, prompt + horizon)
        trace = dataclasses.replace(trace, tokens=trace.tokens[:n], router_inputs=trace.router_inputs[:n],
                                    logits=trace.logits[:n], selected=trace.selected[:n], weights=trace.weights[:n])
        warmup = min(prompt, n - 1)
    else:
        warmup = int(trace.n_tokens * TRACE_WARMUP_FRACTION)
    r = replay(trace, LoopConfig.from_config(config, capacity), warmup=warmup)
    return Locality(hit_rate=r.hit_rate, urgent_per_token=r.urgent_per_token, reads_per_token=r.reads_per_token,
                    source=f"trace {Path(trace_path).name} ({r.tokens} tokens replayed)")
