"""strata against mlx-lm on the same shape, in one run (issue 19): decode at contexts 8 and 2048,
prompts of 512 and 2048 tokens, printed as ratios (mlx-lm's time over strata's: >= 2 is the
target on every row), a table and one JSON line.

Both models have random weights at the issue's shape (the seed without a shared expert: 48
layers, 256 experts top-10, hidden 2560, expert ffn 576, 16 q / 4 kv heads of 128, vocab 32768):
- mlx-lm: its own `qwen3_moe.Model` (the same layer: q/k RMSNorm per head, softmax-then-top-k
  routing with the top-k weights renormalised, SwiGLU experts), float16 dense weights, the
  experts quantized by `nn.quantize` to 2 bits in groups of 32 (what `mlx_lm.convert -q --q-bits 2
  --q-group-size 32` makes of them), timed through a greedy loop written as its `generate_step`
  runs (prefill in pieces of 2048, then each token evaluated asynchronously one step ahead);
- strata: the same shape made by `strata.testing.mlx_params.random_params` (float16 dense, Q2_0
  experts: 2 bits, groups of 32), all resident in an `MlxEngine`, timed through strata's own
  `stream_generate` (greedy: on a GPU the compiled step, each next token chosen on the device and
  its step enqueued before the host reads the token, as mlx-lm's loop does), stamped as mlx-lm's
  loop is: when each token reaches the caller.
A prompt's time is its time to the first token (prefill and the first token); a decode
row is the median time per token after it. Each prompt length runs once on other tokens first, on
both sides: a kernel's first call in a process compiles it, which is start-up, not prompt time.

mlx-lm is needed only here (not a strata dependency), and only its model files, which need MLX
alone: `pip install --no-deps mlx-lm` into the environment that runs the benchmark, or
`pip install --no-deps --target DIR mlx-lm` and PYTHONPATH=DIR (its wheel alone on a GPU machine).

    python benchmarks/peers.py            # the issue's shape (GPU)
    python benchmarks/peers.py --small    # a small shape (any machine, MLX's CPU build too)
    python benchmarks/peers.py --rows decode --tokens 16    # the two decode rows only
    python benchmarks/peers.py --processes 5   # each side in 5 fresh processes, alternating: medians

A GPU machine's host is noisy from process to process (a decoded token is bound by the host's
work: on the H200 one session read mlx-lm's decode at 8 as 10.3 to 18.3 ms), so `--processes N`
runs each side N times, each in a process of its own, the sides alternating, and reports every
row's median and range, the ratios of the medians, and strata's decode at the long context over
decode at 8 per process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import device_name, part  # noqa: E402
from decode_context import SHAPE  # noqa: E402
from decode_memory import resident_distinct  # noqa: E402
from strata.generate import stream_generate  # noqa: E402
from strata.mlx_backend.engine import MlxEngine  # noqa: E402
from strata.mlx_backend.kernels.launch import current_path  # noqa: E402
from strata.testing.mlx_params import random_params  # noqa: E402
from strata.testing.stand_in_model import stand_in_model  # noqa: E402

SMALL = replace(SHAPE, n_layers=4, hidden_size=256, n_experts=32, n_experts_per_token=4, expert_ffn_size=64,
                n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=1024, max_context=2304)
GROUP, BITS = 32, 2


def mlx_lm_module(name: str):
    """A module of mlx-lm (`models.qwen3_moe`, `models.cache`, `_version`) without running the
    package's __init__, which imports transformers for its tokenizers: the model files need only
    MLX, so a GPU machine needs mlx-lm's wheel alone (where mlx_lm is already imported whole, that)."""
    import importlib
    import importlib.util
    import types

    if "mlx_lm" not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None:
            raise ModuleNotFoundError("mlx_lm is not installed (pip install mlx-lm: for this benchmark only)")
        pkg = types.ModuleType("mlx_lm")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["mlx_lm"] = pkg
    return importlib.import_module(f"mlx_lm.{name}")


def mlx_lm_model(cfg):
    """mlx-lm's Qwen3-MoE at cfg's shape: float16 dense, experts 2-bit g32, random weights."""
    import mlx.nn as nn

    qwen3_moe = mlx_lm_module("models.qwen3_moe")
    SwitchLinear = mlx_lm_module("models.switch_layers").SwitchLinear

    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
        intermediate_size=cfg.expert_ffn_size, num_attention_heads=cfg.n_heads, num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.n_experts_per_token, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=cfg.expert_ffn_size, rms_norm_eps=cfg.rms_norm_eps, vocab_size=cfg.vocab_size,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, max_position_embeddings=cfg.max_context, norm_topk_prob=True)
    model = qwen3_moe.Model(args)  # lazy: nothing is made until evaluated
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=GROUP, bits=BITS, class_predicate=lambda _, m: isinstance(m, SwitchLinear))
    for layer in model.layers:  # one layer's float experts at a time (4.5 GB at the shape)
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


PREFILL_STEP = 2048  # mlx-lm's generate_step default: the prompt in pieces of this many tokens


def mlx_lm_tokens(model, prompt: np.ndarray, n: int):
    """Greedy tokens as mlx-lm's `generate_step` makes them (read in mlx_lm/generate.py 0.32.2 and
    written again here, to leave its tokenizer imports out): the prompt but its last token in
    pieces of PREFILL_STEP into the model's cache, each evaluated; then each step's token
    evaluated asynchronously while the host waits for the previous one."""
    cache = mlx_lm_module("models.cache").make_prompt_cache(model)
    stream = mx.new_stream(mx.default_device())
    step = lambda y: mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)  # noqa: E731  [L] -> [1]
    with mx.stream(stream):
        ids = mx.array(prompt)
        while ids.size > 1:
            piece, ids = ids[:min(PREFILL_STEP, ids.size - 1)], ids[min(PREFILL_STEP, ids.size - 1):]
            model(piece[None], cache=cache)
            mx.eval([c.state for c in cache])
        y = step(ids)
        mx.async_eval(y)
        for i in range(n):
            nxt = step(y) if i + 1 < n else None
            if nxt is not None:
                mx.async_eval(nxt)
            yield int(y.item())
            y = nxt


def time_mlx_lm(model, prompt: np.ndarray, n_decode: int) -> tuple[float, float | None]:
    """(time to the first token, median s per decoded token or None) through mlx-lm's loop."""
    t0 = time.perf_counter()
    stamps = []
    for _ in mlx_lm_tokens(model, prompt, n_decode + 1):
        stamps.append(time.perf_counter())
    gaps = np.diff(stamps)
    return stamps[0] - t0, (float(np.median(gaps[1:] if len(gaps) > 2 else gaps)) if n_decode else None)


def time_strata(eng: MlxEngine, prompt: np.ndarray, n_decode: int) -> tuple[float, float | None]:
    """(time to the first token, median s per decoded token or None) through strata's own
    `stream_generate`, greedy, as a user gets it: on a GPU each next token chosen on the device
    and its step enqueued before the host reads the token (strata/device_greedy.py). Timed as
    mlx-lm's loop is: a stamp when each token reaches the caller."""
    eng.reset()
    t0 = time.perf_counter()
    stamps = []
    for _ in stream_generate(eng, [int(t) for t in prompt], max_tokens=n_decode + 1):
        stamps.append(time.perf_counter())
    gaps = np.diff(stamps)
    return stamps[0] - t0, (float(np.median(gaps[1:] if len(gaps) > 2 else gaps)) if n_decode else None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="a small shape (any machine)")
    ap.add_argument("--tokens", type=int, default=16, help="decoded tokens per decode row")
    ap.add_argument("--only", default="", help="comma list: mlx_lm, strata (default both)")
    ap.add_argument("--lengths", default="", help="the short and the long prompt (default 512,2048; --small 64,256: "
                                                  "mlx-lm's 2-bit experts on the CPU take minutes at 2048)")
    ap.add_argument("--rows", default="decode,prompt", help="comma list: decode (contexts 8 and the long prompt), "
                                                         "prompt (both lengths' time to the first token)")
    ap.add_argument("--processes", type=int, default=1,
                    help="each side in this many fresh processes, alternating: medians and ranges (default 1: one "
                         "process, both sides in it)")
    args = ap.parse_args()
    if args.processes < 1:
        ap.error(f"--processes: at least 1, got {args.processes}")
    if args.processes > 1:
        return in_processes(args)
    cfg = SMALL if args.small else SHAPE
    n = 4 if args.small else args.tokens
    short, long = (int(v) for v in (args.lengths or ("64,256" if args.small else "512,2048")).split(","))
    rows_asked = set(r for r in args.rows.split(",") if r)
    if not rows_asked or rows_asked - {"decode", "prompt"}:
        ap.error(f"--rows: decode and/or prompt, got {args.rows!r}")
    # (prompt length, decoded tokens): the long prompt then decode at its context, decode at 8 after 8
    plan = ((short, 0), (long, n), (8, n)) if "prompt" in rows_asked else ((long, n), (8, n))
    if "decode" not in rows_asked:
        plan = ((short, 0), (long, 0))
    rng = np.random.default_rng(0)
    prompts = {length: rng.integers(0, cfg.vocab_size, length) for length, _ in plan}
    warm = {length: rng.integers(0, cfg.vocab_size, length) for length, _ in plan}
    res: dict = {"device": device_name(), "mlx": mx.__version__, "path": current_path().value, "layers": cfg.n_layers,
                 "experts": cfg.n_experts, "k": cfg.n_experts_per_token, "hidden": cfg.hidden_size,
                 "expert_ffn": cfg.expert_ffn_size, "times_s": {}}
    rows: list = []
    who = [w for w in (args.only or "mlx_lm,strata").split(",") if w]
    for name in who:
        with part(name, res, rows):
            t0 = time.time()
            if name == "mlx_lm":
                res["mlx_lm"] = mlx_lm_module("_version").__version__
                model = mlx_lm_model(cfg)
                run = lambda pr, k: time_mlx_lm(model, pr, k)  # noqa: E731
            else:
                # no end-of-text: a random model's greedy tokens would stop a row anywhere
                eng = MlxEngine(random_params(cfg, seed=0, pred_q8=False, distinct_records=resident_distinct(cfg)),
                                model=stand_in_model(cfg, eos=frozenset()))
                run = lambda pr, k: time_strata(eng, pr, k)  # noqa: E731
            res[f"{name}_build_s"] = time.time() - t0
            run(prompts[8], 2)  # warm: kernels built, the compiled step traced
            for length, _ in plan if "prompt" in rows_asked else ():  # and each prompt length once on other
                run(warm[length], 2)  # tokens, two decoded after it: a custom kernel's first call in a process
                # compiles it (seconds), which is not the prompt's time; the decoded two build the decode kernels of
                # that context (the split attention past 256 positions), whose first call a timed prompt row would
                # otherwise hold: the first token reaches the caller after its next step is enqueued (H200: 4.86 s
                # at 2048 with the warm-up at 0 decoded, against ~0.11 s for the prompt path's own time)
            for length, k in plan:
                first, per = run(prompts[length], k)
                res["times_s"].setdefault(name, {})[f"prompt {length}"] = first
                if per is not None:
                    res["times_s"][name][f"decode at {length}"] = per
            del run
    t = res["times_s"]
    ratios = {}
    print(f"## strata vs mlx-lm on {res['device']} (MLX {mx.__version__}, mlx-lm {res.get('mlx_lm', '-')}; "
          f"{cfg.n_layers} layers, {cfg.n_experts} experts top-{cfg.n_experts_per_token}, D={cfg.hidden_size}, "
          f"F={cfg.expert_ffn_size}; experts 2-bit g32)")
    print(f"{'row':<18} {'mlx-lm':>12} {'strata':>12} {'mlx-lm / strata':>16}")
    keys = (["decode at 8", f"decode at {long}"] if "decode" in rows_asked else []) + \
        ([f"prompt {short}", f"prompt {long}"] if "prompt" in rows_asked else [])
    for key in keys:
        a, b = t.get("mlx_lm", {}).get(key), t.get("strata", {}).get(key)
        unit = (lambda s: f"{s * 1e3:.2f} ms") if key.startswith("decode") else (lambda s: f"{s:.3f} s")
        ratio = a / b if a and b else None
        ratios[key] = ratio
        print(f"{key:<18} {unit(a) if a else '-':>12} {unit(b) if b else '-':>12} "
              f"{f'{ratio:.2f}x' if ratio else '-':>16}")
    res["ratios"] = ratios
    res["all_at_least_2x"] = at_least_2x(ratios)
    for name, val, note in rows:
        print(f"{name:<28} {val:>16}  {note}")
    print("JSON " + json.dumps(res, sort_keys=True, default=str))
    return 0


def at_least_2x(ratios: dict) -> bool | None:
    """Whether every row's mlx-lm / strata ratio is at least 2; None where a row has no ratio (a
    side not run: `--only`), not a verdict of False."""
    if not ratios or any(r is None for r in ratios.values()):
        return None
    return all(r >= 2 for r in ratios.values())


def in_processes(args) -> int:
    """`--processes N`: this benchmark N times a side, each run a process of its own (the sides
    alternating, so a slow spell of the host falls on both), then each row's median and range."""
    who = [w for w in (args.only or "mlx_lm,strata").split(",") if w]
    base = [sys.executable, str(Path(__file__).resolve()), "--tokens", str(args.tokens), "--rows", args.rows]
    base += (["--small"] if args.small else []) + (["--lengths", args.lengths] if args.lengths else [])
    runs: dict[str, list[dict]] = {w: [] for w in who}
    last: dict = {}
    for i in range(args.processes):
        for name in who:
            out = subprocess.run(base + ["--only", name], capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("JSON ")]
            if out.returncode != 0 or not lines:
                print(f"peers: process {i + 1} of {name} failed (exit {out.returncode}): "
                      f"{(out.stderr.strip().splitlines() or ['no output'])[-1]}")
                return 1
            last = json.loads(lines[-1][5:])
            runs[name].append(last["times_s"].get(name, {}))
            print(f"process {i + 1}/{args.processes} {name}: "
                  + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(runs[name][-1].items())), flush=True)
    rows = sorted({k for r in runs.values() for t in r for k in t})
    med = {name: {k: statistics.median([t[k] for t in r if k in t]) for k in rows if any(k in t for t in r)}
           for name, r in runs.items()}
    ratios = {k: (med["mlx_lm"][k] / med["strata"][k] if "mlx_lm" in med and "strata" in med
                  and k in med["mlx_lm"] and k in med["strata"] else None) for k in rows}
    long_key = next((k for k in rows if k.startswith("decode at") and k != "decode at 8"), None)
    over = ([t[long_key] / t["decode at 8"] for t in runs.get("strata", []) if long_key in t and "decode at 8" in t]
            if long_key else [])
    print(f"## strata vs mlx-lm over {args.processes} processes a side on {last.get('device', '-')} "
          f"(MLX {last.get('mlx', '-')}, mlx-lm {last.get('mlx_lm', '-')}): median [min - max]")
    print(f"{'row':<18} {'mlx-lm':>26} {'strata':>26} {'ratio of medians':>17}")
    for k in rows:
        cells = []
        for name in ("mlx_lm", "strata"):
            vals = [t[k] for t in runs.get(name, []) if k in t]
            cells.append(f"{statistics.median(vals) * 1e3:.2f} [{min(vals) * 1e3:.2f} - {max(vals) * 1e3:.2f}] ms"
                         if vals else "-")
        print(f"{k:<18} {cells[0]:>26} {cells[1]:>26} {f'{ratios[k]:.2f}x' if ratios[k] else '-':>17}")
    if over:
        print(f"strata {long_key} / decode at 8, per process: " + ", ".join(f"{r:.2f}x" for r in over)
              + f" (median {statistics.median(over):.2f}x)")
    res = {"device": last.get("device"), "mlx": last.get("mlx"), "mlx_lm": last.get("mlx_lm"),
           "processes": args.processes, "times_s": runs, "median_s": med, "ratios": ratios,
           "all_at_least_2x": at_least_2x(ratios),
           "long_over_8": over}
    print("JSON " + json.dumps(res, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
