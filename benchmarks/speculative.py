"""Speculative windows against plain decoding: bytes and ms per generated token, acceptance.

    python benchmarks/speculative.py [--backend numpy,mlx] [--models default,made] [--tokens 96]
                                     [--depths 1,2,3] [--engines resident,min,half] [--repeat 3]

For each model (the embedded strata/data/default.gguf, and a made demo-shaped model) and each
engine (resident: every expert in memory; min / half: streaming through the smallest legal
arena of the window, or half the experts), runs greedy generation over repetitive code prompts
with speculation off (T = 1) and with the suffix drafter at each depth, gate on and off, and
prints per configuration: ms per generated token, wall and process CPU (median over --repeat
runs, after a warm run; decode only: a 1-token call's time is subtracted),
bytes read per generated token (decode windows' expert reads x slot bytes; 0 when resident),
drafted-token acceptance, tokens per window, whether the gate switched off, and whether the
tokens equal T = 1's (they must: greedy speculation is lossless). λ = 0 everywhere, so the
streaming engines route as the model does and the outputs are comparable.

Ends with one JSON line (`JSON {...}`); docs/perf.md records the numbers. On the H200:
`python benchmarks/speculative.py --backend mlx` (or the `speculative` stage of
benchmarks/device_run.sh) measures the all-resident MLX engine (compiled T = 1 decode vs
uncompiled windows) and MLX streaming.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import strata  # noqa: E402
from strata.config import Config  # noqa: E402
from strata.engines import close_session  # noqa: E402
from strata.runtime.decode import arena_plan_for  # noqa: E402

PROMPTS = [  # repetitive code: where a draft from the context itself can be accepted
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "class Size:\n    def __init__(self, w, h):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
]


def made_model(directory: Path):
    from strata.testing.models import make_model

    path = directory / "demo"
    if not path.with_suffix(".gguf").exists():
        make_model(path, "demo", seed=1)
    return path.with_suffix(".gguf")


def engine_config(model, backend: str, engine: str, depth: int, gate: bool) -> Config:
    config = Config(backend=backend, moce_lambda=0.0, suffix_draft=depth, spec_gate=gate, window=4)
    if engine == "resident":
        return config
    least = arena_plan_for(model, config.replace(arena="100000slots")).min_slots  # window 4's: every depth's arena
    slots = least if engine == "min" else max(least, model.experts_file.header.n_records // 2)
    return config.replace(arena=f"{slots}slots")


def _timed(model, prompt, tokens: int, config: Config):
    """(result, wall s, cpu s) of one generation from a reset session (the arena stays)."""
    if model.session is not None:
        model.session.reset()  # no prefix reuse: every prompt is prefilled whole
    wall, cpu = time.perf_counter(), time.process_time()
    r = strata.generate(model, prompt, max_tokens=tokens, config=config)
    return r, time.perf_counter() - wall, time.process_time() - cpu


def run_config(model, config: Config, tokens: int, repeat: int) -> dict:
    """Greedy generation over every prompt: a warm run, then `repeat` timed runs. A token's cost
    is (the call generating `tokens`) - (the call generating 1: prefill and the first token),
    over the tokens after the first: decode only. Wall and process CPU time (the latter steadier
    on a shared host; it misses GPU time, so on MLX read the wall column)."""
    close_session(model)
    slot = model.experts_file.header.padded_bytes
    runs, outputs, spec = [], [], []
    for rep in range(repeat + 1):
        wall = cpu = generated = reads = 0
        for prompt in PROMPTS:
            _, wall1, cpu1 = _timed(model, prompt, 1, config)
            r, wall_n, cpu_n = _timed(model, prompt, tokens, config)
            wall, cpu, generated = wall + wall_n - wall1, cpu + cpu_n - cpu1, generated + len(r.tokens) - 1
            if r.report is not None:
                reads += r.report.reads_per_token * r.report.tokens
            if rep == 0:
                outputs.append(r.tokens)
            elif r.speculation is not None:
                spec.append(r.speculation)
        if rep:
            runs.append((1e3 * wall / generated, 1e3 * cpu / generated, reads * slot / generated))
    drafted, accepted = sum(s.drafted for s in spec), sum(s.accepted for s in spec)
    windows = sum(s.windows for s in spec)
    return {
        "ms_per_token": statistics.median(r[0] for r in runs), "cpu_ms_per_token": statistics.median(r[1] for r in runs),
        "bytes_per_token": statistics.median(r[2] for r in runs),
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_window": sum(s.tokens for s in spec) / windows if windows else 1.0,
        "gate_off": sum(any(e.startswith("off") for e in s.events) for s in spec), "runs": len(spec),
        "outputs": outputs, "engine": model.session.kind if model.session else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numpy", help="comma list: numpy, mlx")
    ap.add_argument("--models", default="default,made", help="comma list: default (embedded), made (demo shape)")
    ap.add_argument("--engines", default="resident,min,half", help="comma list: resident, min, half")
    ap.add_argument("--depths", default="1,2,3", help="suffix-draft depths")
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per configuration (median)")
    ap.add_argument("--dir", default=None, help="where the made model is kept (default: a temporary dir)")
    args = ap.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="strata-spec-"))
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"default": ROOT / "strata" / "data" / "default.gguf", "made": None}
    depths = [int(d) for d in args.depths.split(",") if d]
    rows, results = [], []
    for name in args.models.split(","):
        path = paths[name] if name == "default" else made_model(directory)
        model = strata.load(path)
        for backend in args.backend.split(","):
            for engine in args.engines.split(","):
                base = None
                for depth in [0] + depths:
                    for gate in ([True] if depth == 0 else [True, False]):
                        config = engine_config(model, backend, engine, depth, gate)
                        try:
                            r = run_config(model, config, args.tokens, args.repeat)
                        except Exception as exc:  # reported, the next configuration still runs
                            print(f"{name} {backend} {engine} depth {depth}: {type(exc).__name__}: {exc}",
                                  file=sys.stderr)
                            continue
                        base = base or r
                        same = r["outputs"] == base["outputs"]
                        label = "T=1 (off)" if depth == 0 else f"suffix-{depth} gate {'on' if gate else 'off'}"
                        row = dict(model=name, backend=backend, engine=engine, engine_kind=r["engine"],
                                   config=label, depth=depth, gate=gate, arena=config.arena or "all",
                                   ms_per_token=r["ms_per_token"], bytes_per_token=r["bytes_per_token"],
                                   ms_vs_t1=r["ms_per_token"] / base["ms_per_token"],
                                   cpu_ms_per_token=r["cpu_ms_per_token"],
                                   cpu_vs_t1=r["cpu_ms_per_token"] / base["cpu_ms_per_token"],
                                   bytes_vs_t1=(r["bytes_per_token"] / base["bytes_per_token"]
                                                if base["bytes_per_token"] else None),
                                   acceptance=r["acceptance"], tokens_per_window=r["tokens_per_window"],
                                   gate_off_runs=f"{r['gate_off']}/{r['runs']}" if depth else "-", same_tokens=same)
                        results.append(row)
                        rows.append(row)
                        print(_line(row), flush=True)
        close_session(model)
        model.close()
    print()
    print(_table(rows))
    print("JSON " + json.dumps({"bench": "speculative", "tokens": args.tokens, "repeat": args.repeat,
                                "prompts": len(PROMPTS), "results": results}, sort_keys=True, default=str))


def _line(r: dict) -> str:
    acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
    bvs = "-" if r["bytes_vs_t1"] is None else f"{r['bytes_vs_t1']:.2f}x"
    return (f"{r['model']:8s} {r['backend']:5s} {r['engine']:8s} {r['arena']:>9s} {r['config']:20s} "
            f"{r['ms_per_token']:8.2f} ms {r['ms_vs_t1']:5.2f}x  cpu {r['cpu_ms_per_token']:8.2f} ms {r['cpu_vs_t1']:5.2f}x  "
            f"{r['bytes_per_token'] / 1e3:8.1f} kB {bvs:>6s}  "
            f"acc {acc:>6s}  {r['tokens_per_window']:.2f} tok/win  gate-off {r['gate_off_runs']}  "
            f"same {r['same_tokens']}")


def _table(rows: list[dict]) -> str:
    head = ("| model | backend | engine | arena | config | ms/token | vs T=1 | CPU ms/token | vs T=1 | kB/token | "
            "vs T=1 | acceptance | tokens/window | gate off | same tokens |\n|" + "---|" * 15)
    out = [head]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
        bvs = "-" if r["bytes_vs_t1"] is None else f"{r['bytes_vs_t1']:.2f}x"
        out.append(f"| {r['model']} | {r['backend']} | {r['engine']} | {r['arena']} | {r['config']} | "
                   f"{r['ms_per_token']:.2f} | {r['ms_vs_t1']:.2f}x | {r['cpu_ms_per_token']:.2f} | {r['cpu_vs_t1']:.2f}x | "
                   f"{r['bytes_per_token'] / 1e3:.1f} | {bvs} | {acc} | "
                   f"{r['tokens_per_window']:.2f} | {r['gate_off_runs']} | {r['same_tokens']} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
