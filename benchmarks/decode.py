"""Decode benchmarks (GPU): ms/token of a full-size made model (48 layers, 256 experts, top-10,
shared expert; random valid Q2_0 experts), broken into bytes / bandwidth, kernel launches x
measured dispatch, and host round trips, all measured in this run:

1. all-resident (MlxEngine: every expert in one MLX arena, routing on the GPU);
2. a capped arena streaming misses from host memory (StreamingEngine + MlxArena + MlxCompute;
   the `.experts` file lives in /dev/shm, so a miss is a memory copy, not a disk read);
3. the per-layer host synchronisation cost (the reference engine's handshake bench, MLX form).

Prints a table, then one JSON line.

    python benchmarks/decode.py             # full size (GPU; ~17 GB arena, ~17 GB file in /dev/shm)
    python benchmarks/decode.py --small     # smoke test (any machine)
    python benchmarks/decode.py --shape qwen3.5-397b --layers 40   # the hybrid's per-layer shape, 40 layers
    python benchmarks/decode.py --shape qwen3.5-397b --small       # a small hybrid (smoke test)
    python benchmarks/decode.py --shape qwen4-seed --ple-gb 24     # the reference engine's own model (qwen4_seed.py)
    python benchmarks/decode.py --shape deepseek-v3 --layers 8     # DeepSeek-V3's per-layer shape, 8 layers
    python benchmarks/decode.py --expert-type Q4_K --skip streaming  # llama.cpp's Q4_K experts kept as stored
                                    # (gate/up Q4_K, the 576-wide down in Q5_0 as llama.cpp writes it), all-resident

Memory is checked before anything is built: all-resident needs the dense weights, every expert,
the KV caches and the DeltaNet snapshots in device memory (Qwen3.5-397B's 60 layers: ~146 GB, past
an H200's 139 GiB once MLX's own needs are counted), streaming needs the `.experts` file in
/dev/shm or the temporary directory (121 GB at 60 layers). A part that does not fit is skipped
with a note saying what it needs; `--layers N` keeps the per-layer shape with fewer layers.
DeepSeek-V3's 61 layers (3 dense, 58 of 256 experts of 3 x 7168 x 2048) are ~237 GB all-resident
and a 204 GB `.experts` file: neither an H200's 139 GiB nor its 64 GiB disk (or 128 GiB of RAM)
holds them, so its runs take --layers N and the table adds the per-layer ms and the 61 layers
extrapolated from them (`deepseek_extrapolation`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from _measure import copy_bandwidth, device_name, dispatch_costs, graph_launches, median_time, part, phase, print_rows  # noqa: E402
from strata.config import Backend, Config  # noqa: E402
from strata.formats.experts_file import ExpertsFile  # noqa: E402
from strata.mlx_backend.arena import MlxArena  # noqa: E402
from strata.mlx_backend.compute import MlxCompute  # noqa: E402
from strata.mlx_backend.engine import MlxEngine  # noqa: E402
from strata.mlx_backend.kernels import combine as combine_kernel  # noqa: E402
from strata.mlx_backend.kernels.launch import HOST_INPUTS, LAUNCHES, KernelPath, current_path  # noqa: E402
from strata.mlx_backend.kernel_plan import KernelPlan  # noqa: E402
from strata.mlx_backend.model import MlxParams, forward  # noqa: E402
from strata.mlx_backend.deltanet import DeltaNetWeights  # noqa: E402
from strata.mlx_backend.mla import MlaWeights  # noqa: E402
from strata.testing.mlx_params import DEEPSEEK_V3_SHAPE, QWEN35_397B_SHAPE, SEED_SHAPE, random_params, selection_bias  # noqa: E402
from strata.model_config import ModelConfig, TensorNames  # noqa: E402
from decode_memory import fit_note, resident_bytes, resident_distinct, stream_dir  # noqa: E402
from decode_deepseek import SMALL_DEEPSEEK, deepseek_extrapolation  # noqa: E402
from _random_experts import make_experts_file  # noqa: E402,F401  (prompt_mlx.py imports it from here)

SMALL = replace(SEED_SHAPE, n_layers=4, hidden_size=256, n_experts=32, n_experts_per_token=4, expert_ffn_size=64,
                shared_ffn_size=64, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512, max_context=256)
# the hybrid's pattern at SMALL's size: three DeltaNet layers, then gated attention with partial rotary
SMALL_HYBRID = QWEN35_397B_SHAPE.with_fields(n_layers=4, layer_types=QWEN35_397B_SHAPE.layer_types[:4], hidden_size=256,
                       n_experts=32, n_experts_per_token=4, expert_ffn_size=64, shared_ffn_size=64, n_heads=4,
                       n_kv_heads=2, head_dim=64, rotary_dim=16, vocab_size=512, max_context=256, linear_k_heads=2,
                       linear_v_heads=4, linear_k_head_dim=32, linear_v_head_dim=32)


def bytes_per_token(p: MlxParams, context: int) -> int:
    """Bytes one decoded token must read: every dense weight once, k experts per layer, the KV cache."""
    cfg = p.cfg
    total = p.out_norm.nbytes + p.output.nbytes + cfg.hidden_size * 2
    for lw in p.layers:
        a = lw.attn
        if isinstance(a, MlaWeights):  # weights, and the latent cache instead of keys and values
            total += sum(x.nbytes for x in a.arrays()) + lw.ffn_norm.nbytes
            total += lw.router.nbytes if lw.router is not None else 0
            total += 4 * context * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
            total -= 2 * cfg.n_kv_heads * context * cfg.head_dim * 4  # (added below)
        elif isinstance(a, DeltaNetWeights):  # weights, and the recurrent state read and written
            total += sum(x.nbytes for x in a.arrays()) + lw.ffn_norm.nbytes + lw.router.nbytes
            dn = cfg.deltanet
            total += 2 * 4 * dn.linear_v_heads * dn.linear_k_head_dim * dn.linear_v_head_dim
            total -= 2 * cfg.n_kv_heads * context * cfg.head_dim * 4  # no KV cache (added below)
        else:
            total += sum(x.nbytes for x in (a.norm, a.wqkv, a.wo, lw.ffn_norm, lw.router) if x is not None)
            total += sum(x.nbytes for x in (a.q_norm, a.k_norm, a.bqkv) if x is not None)
        if lw.shared is not None:
            total += lw.shared.gate.nbytes + lw.shared.up.nbytes + lw.shared.down.nbytes
            total += lw.shared.gate_inp.nbytes if lw.shared.gate_inp is not None else 0
        if lw.dense is not None:  # a dense FFN layer: its SwiGLU, no experts
            total += lw.dense.gate.nbytes + lw.dense.up.nbytes + lw.dense.down.nbytes
        else:
            total += cfg.n_experts_per_token * p.rec.record_bytes
        total += 2 * cfg.n_kv_heads * context * cfg.head_dim * 4
    return total


def all_resident(cfg: ModelConfig, n_prompt: int, n_decode: int, costs: dict, bw: dict, rows: list, res: dict, *,
                 sweep_eval: bool = True, expert_layout=None) -> None:
    """expert_layout: records of llama.cpp's types (ggml_records.ggml_layout) instead of Q2_0."""
    t0 = time.time()
    t = time.perf_counter()
    p = random_params(cfg, seed=0, pred_q8=False, distinct_records=resident_distinct(cfg), expert_layout=expert_layout)
    res["build_s"] = time.time() - t0
    res["resident_distinct_records"] = resident_distinct(cfg)
    t = phase(res, "resident_build", t)
    eng = MlxEngine(p)
    rng = np.random.default_rng(0)
    eng.prefill(list(rng.integers(0, cfg.vocab_size, n_prompt)))
    t = phase(res, "resident_prefill (first calls compile)", t)
    # launches of one decode token, from its lazy graph (routing on the GPU: no sync inside)
    logits, state = forward(p, eng.state, np.array([1]), eval_every=0)  # the whole graph, lazy
    launches = graph_launches(logits)
    mx.eval(logits)
    eng.state = state
    t = phase(res, "resident_first_decode (first calls compile)", t)
    custom = launches.get("CustomKernel", 0)
    n_launch = sum(launches.values())
    before, host_before = sum(LAUNCHES.values()), sum(HOST_INPUTS.values())
    def run(every: int) -> tuple[float, float]:
        """n_decode tokens like MlxEngine.decode, the host's graph building timed apart -> medians (s)."""
        times, builds = [], []
        for _ in range(n_decode):
            t = time.perf_counter()
            logits, state = forward(p, eng.state, np.array([int(rng.integers(0, cfg.vocab_size))]), eval_every=every)
            tb = time.perf_counter()
            np.array(logits[-1], dtype=np.float32)
            eng.state = state
            times.append(time.perf_counter() - t)
            builds.append(tb - t)
        med = lambda v: float(np.median(v[2:] if len(v) > 4 else v))  # noqa: E731
        return med(times), med(builds)

    # the default (the kernel plan's eval_every: one evaluation a token) and the alternatives, in one run
    default_every = KernelPlan().eval_every
    by_every = {}
    for every in dict.fromkeys((default_every, 0, 4) if sweep_eval else (default_every,)):
        by_every[every] = run(every)
        t = phase(res, f"resident_uncompiled_eval_every_{every}", t)
    res["kernel_calls_per_token"] = (sum(LAUNCHES.values()) - before) / (n_decode * len(by_every))
    res["resident_host_inputs_per_token"] = (sum(HOST_INPUTS.values()) - host_before) / (n_decode * len(by_every))
    res["resident_ms_by_eval_every"] = {str(k): v[0] * 1e3 for k, v in by_every.items()}
    ms, build_ms = by_every[default_every][0] * 1e3, by_every[default_every][1] * 1e3
    res["resident_build_ms"] = build_ms
    nbytes = bytes_per_token(p, eng.length)
    # before the compiled step's first call (its trace and compiles): a run cut there keeps this
    print(f"RESULT all-resident uncompiled decode {ms:.2f} ms/token, {nbytes / 1e9:.2f} GB/token", flush=True)
    t_bytes = nbytes / bw["read_Bps"]
    per_kernel = costs.get("kernel_s", costs["op_s"])
    t_launch = custom * per_kernel + (n_launch - custom) * costs["op_s"]
    t_trips = 1 * costs["round_trip_s"]
    floor = max(t_bytes, t_launch + t_trips)
    res.update({"resident_ms_per_token": ms, "resident_bytes_per_token": nbytes, "resident_launches_per_token": n_launch,
                "resident_custom_kernels_per_token": custom, "resident_launches_per_layer": n_launch / cfg.n_layers,
                "resident_custom_per_layer": custom / cfg.n_layers, "resident_graph_ops": launches,
                "resident_bytes_ms": t_bytes * 1e3, "resident_launch_ms": t_launch * 1e3,
                "resident_round_trip_ms": t_trips * 1e3, "resident_floor_ms": floor * 1e3,
                "resident_ratio_to_floor": ms / (floor * 1e3)})
    rows += [("all-resident decode", f"{ms:.2f} ms/token", f"{1e3 / ms:.0f} tok/s"),
             ("  of it: the host builds the token's graph", f"{build_ms:.2f} ms", "Python + MLX, before the eval"),
             ("  bytes / read bandwidth", f"{t_bytes * 1e3:.2f} ms", f"{nbytes / 1e9:.2f} GB/token"),
             ("  launches x dispatch", f"{t_launch * 1e3:.2f} ms",
              f"{n_launch} launches/token ({custom} custom; {n_launch / cfg.n_layers:.1f}/layer)"),
             ("  host round trips", f"{t_trips * 1e3:.3f} ms", "1 per token (the logits)"),
             ("  ratio to max(bytes, launches + trips)", f"{ms / (floor * 1e3):.2f}x", "target <= 1.5x"),
             ("  kernel inputs made from host memory", f"{res['resident_host_inputs_per_token']:.1f} /token", "target 0")]
    rows += [(f"  asynchronous evaluation every {k} layers" if k else "  one evaluation per token",
              f"{v[0] * 1e3:.2f} ms/token", f"graph built in {v[1] * 1e3:.2f} ms" + (" (default)" if k == default_every else ""))
             for k, v in by_every.items()]
    # the compiled decode step (strata/mlx_backend/compiled.py) from the same state: the first call
    # traces (timed apart), the rest replay; a failure is a row, not a lost part
    from strata.mlx_backend.compiled import CompiledDecode, unsupported

    res["resident_compiled_ms_per_token"] = None
    why, times, calls = unsupported(p), [], []
    try:
        t = time.perf_counter()
        step = CompiledDecode(p, eng.state) if why is None else None
        phase(res, "resident_compiled_built", t)
        for _ in range(n_decode + 1 if step else 0):
            t = time.perf_counter()
            logits, state = step(eng.state, int(rng.integers(0, cfg.vocab_size)))
            tc = time.perf_counter()
            np.array(logits[-1], dtype=np.float32)
            eng.state = state
            times.append(time.perf_counter() - t)
            calls.append(tc - t)
            if len(times) == 1:
                phase(res, "resident_compiled_first (trace, compiles)", t)
    except Exception as exc:  # reported in the table and the JSON
        why = res["resident_compiled_error"] = f"failed: {type(exc).__name__}: {exc}"
    if why is None:
        cms, call_ms = float(np.median(times[1:])) * 1e3, float(np.median(calls[1:])) * 1e3
        print(f"RESULT all-resident compiled decode {cms:.2f} ms/token (first call {times[0]:.1f} s)", flush=True)
        res.update({"resident_compiled_ms_per_token": cms, "resident_compiled_call_ms": call_ms,
                    "resident_compiled_first_ms": times[0] * 1e3})
        rows.append(("compiled decode step (MlxEngine's default on a GPU)", f"{cms:.2f} ms/token",
                     f"{1e3 / cms:.0f} tok/s; call {call_ms:.2f} ms; first (trace) {times[0] * 1e3:.0f} ms"))
        rows.append(("  compiled: ratio to max(bytes, launches + trips)", f"{cms / (floor * 1e3):.2f}x", "target <= 1.5x"))
        res["resident_compiled_ratio_to_floor"] = cms / (floor * 1e3)
    else:
        rows.append(("compiled decode step", "n/a", why[:100]))
    # what MlxEngine.decode runs: the compiled step where it runs, else the uncompiled graph
    res["resident_engine_ms_per_token"] = res["resident_compiled_ms_per_token"] or ms
    res["resident_engine_ratio_to_floor"] = res["resident_engine_ms_per_token"] / (floor * 1e3)
    del eng, p


def streaming(cfg: ModelConfig, n_prompt: int, n_decode: int, slots: int, rows: list, res: dict) -> None:
    from strata.loader import Model
    from strata.runtime.decode import StreamingEngine
    from strata.runtime.io import ReaderPool

    base = stream_dir(cfg)
    path = base / f"strata_bench_{os.getpid()}.experts"
    t0 = time.time()
    t = time.perf_counter()
    made = make_experts_file(path, cfg, 1)
    res["experts_file_s"] = time.time() - t0
    res["experts_file_dir"] = str(base)
    res.update({f"experts_file_{k}": v for k, v in made.items()})
    t = phase(res, f"stream_experts_file ({made['bytes'] / 1e9:.1f} GB at {made['write_GBps']:.1f} GB/s)", t)
    xf = ExpertsFile.open(path)
    try:
        from strata.runtime.decode import cache_config_for

        # the runtime routes with the model's selection biases (sigmoid rules): random_params' own
        biases = {TensorNames.block(l, TensorNames.exp_probs_b): selection_bias(cfg, 0, l) for l in cfg.moe_layers
                  if cfg.sigmoid.router_bias}
        model = Model(cfg, biases, None, xf, path.with_suffix(".gguf"))
        least = cache_config_for(model, Config(), 1).min_capacity
        slots = max(slots, least)
        config = Config(backend=Backend.MLX, arena=f"{slots}slots")
        params = random_params(cfg, seed=0, experts=False, pred_q8=config.pred_q8)
        t = phase(res, "stream_dense_build", t)
        runs: dict[str, list] = {}
        variants = list(stream_variants().items())
        # PASSES passes over the variants, each starting one variant later (the host's speed drifts,
        # and a variant's place in the pass should not decide it); per variant the median run is kept
        # (the process's first run is slower: kernels built, pages first touched)
        order = [variants[(p + i) % len(variants)] for p in range(PASSES) for i in range(len(variants))]
        for name, variant in order:
            arena = MlxArena(slots, xf.header.padded_bytes)
            pool = ReaderPool(xf, arena, threads=config.io_threads, direct=config.direct_io, verify=False,
                              timeout=config.io_timeout, switch_interval=config.io_switch_ms / 1e3)
            compute = MlxCompute(params, arena, xf.layout, pred_q8=config.pred_q8)
            eng = StreamingEngine(model, config.replace(**variant.get("config", {})), arena, compute, pool,
                                  notes=("mlx backend",))
            rng = np.random.default_rng(0)
            eng.prefill(list(rng.integers(0, cfg.vocab_size, n_prompt)))
            host_before, launches_before = sum(HOST_INPUTS.values()), sum(LAUNCHES.values())
            for _ in range(n_decode):
                eng.decode(int(rng.integers(0, cfg.vocab_size)))
            if not runs:
                res["stream_host_inputs_per_layer"] = (sum(HOST_INPUTS.values()) - host_before) / n_decode / cfg.n_layers
                res["stream_custom_kernels_per_layer"] = (sum(LAUNCHES.values()) - launches_before) / n_decode / cfg.n_layers
            runs.setdefault(name, []).append(eng.report())
            t = phase(res, f"stream_run_{len(sum(runs.values(), []))}", t)
            eng.close()
            del eng, compute, pool, arena
    finally:
        xf.close()
        path.unlink(missing_ok=True)
    turn = lambda r: (r.host_ms_per_window - r.waiting_ms_per_window) / cfg.n_layers * 1e3  # noqa: E731
    reports = {k: sorted(v, key=lambda r: r.ms_per_token)[len(v) // 2] for k, v in runs.items()}
    turn_us = {k: sorted(turn(r) for r in v)[len(v) // 2] for k, v in runs.items()}
    first = variants[0][0]
    r, host_turn_us = reports[first], turn_us[first]
    res.update({"stream_ms_per_token": r.ms_per_token, "stream_urgent_misses_per_token": r.urgent_misses_per_token,
                "stream_readahead_hits_per_token": r.readahead_hits_per_token, "stream_reads_per_token": r.reads_per_token,
                "stream_hit_rate": r.hit_rate, "stream_host_ms_per_window": r.host_ms_per_window,
                "stream_waiting_ms_per_window": r.waiting_ms_per_window, "stream_after_ms": r.after_ms,
                "stream_host_turn_us_per_layer": host_turn_us, "stream_arena_slots": slots,
                "stream_arena_GB": slots * xf.header.padded_bytes / 1e9, "stream_io_switch_ms": config.io_switch_ms,
                "stream_by_variant": {k: {"ms_per_token": v.ms_per_token, "host_turn_us": turn_us[k],
                                          "waiting_ms_per_window": v.waiting_ms_per_window, "hit_rate": v.hit_rate,
                                          "runs_ms_per_token": [r.ms_per_token for r in runs[k]],
                                          "runs_host_turn_us": [turn(r) for r in runs[k]]}
                                      for k, v in reports.items()}})
    rows += [(f"streaming decode, arena {slots} slots ({res['stream_arena_GB']:.1f} GB)", f"{r.ms_per_token:.2f} ms/token",
              f"hit rate {r.hit_rate:.3f}"),
             ("  urgent misses / read-ahead hits / reads per token",
              f"{r.urgent_misses_per_token:.1f} / {r.readahead_hits_per_token:.1f} / {r.reads_per_token:.1f}", "random routing"),
             ("  host per window, of it waiting", f"{r.host_ms_per_window:.2f} / {r.waiting_ms_per_window:.2f} ms", ""),
             ("  host turn (non-wait) per layer", f"{host_turn_us:.1f} us", f"target < 50 us ({first})"),
             ("  kernel inputs made from host memory", f"{res['stream_host_inputs_per_layer']:.1f} /layer",
              "the routed slots and weights"),
             ("  custom-kernel launches per layer", f"{res['stream_custom_kernels_per_layer']:.1f}", "target 7 (GPU path)")]
    rows += [(f"  {k}", f"{v.ms_per_token:.2f} ms/token", f"host turn {turn_us[k]:.1f} us/layer")
             for k, v in reports.items() if k != first]
    rows += [(f"  runs: {k}", " / ".join(f"{r.ms_per_token:.1f}" for r in v) + " ms",
              "turn " + " / ".join(f"{turn(r):.1f}" for r in v) + " us") for k, v in runs.items()]


PASSES = 3  # streaming runs per variant


def stream_variants() -> dict:
    """The streaming runs, the first as strata runs by default (the only one now). The third
    session's runs compared here: the reader threads kept off the decode thread's CPU, the
    decode thread held on its CPU, 2 reader threads, reads completing unread (no reader threads
    at all: the turn was no cheaper), and the turn prepared while the GPU computed the router
    logits (46.3 vs 49.4 us over nine runs each, within the host's noise): none is kept
    (docs/perf.md). A variant is {"config": {Config field: value}}."""
    return {"strata defaults": {}}


def handshake(segments: int, nbytes: int, rows: list, res: dict) -> None:
    """The reference engine's hs bench in MLX form: 48 segments of two 4 MB dispatches; one eval for all, a host
    round trip per segment, and a round trip with one more dispatch queued between signal and wait."""
    n = nbytes // 4
    bufs = [mx.random.uniform(shape=(n,)) for _ in range(2)]
    mx.eval(*bufs)

    def seg(x):
        return (x * 1.0001) + 1.0

    def one_eval():
        x = bufs[0]
        for _ in range(segments):
            x = seg(x)
        mx.eval(x)

    def per_segment():
        x = bufs[0]
        for _ in range(segments):
            x = seg(x)
            np.array(x[:1])  # signal + host answers at once + wait

    def with_side_work():
        x, side = bufs[0], bufs[1]
        for _ in range(segments):
            x = seg(x)
            mx.async_eval(x)
            side = side * 1.0001  # queued while the host takes its turn
            mx.async_eval(side)
            np.array(x[:1])
        mx.eval(side)

    t_a = median_time(one_eval)
    t_b = median_time(per_segment)
    t_c = median_time(with_side_work)
    res.update({"hs_one_eval_ms": t_a * 1e3, "hs_round_trips_ms": t_b * 1e3, "hs_side_work_ms": t_c * 1e3,
                "hs_cost_per_segment_us": (t_b - t_a) / segments * 1e6})
    rows += [(f"handshake: {segments} x 2 x {nbytes >> 20} MB, one eval", f"{t_a * 1e3:.3f} ms", ""),
             ("  + host round trip per segment", f"{t_b * 1e3:.3f} ms",
              f"{(t_b - t_a) / segments * 1e6:.1f} us per segment"),
             ("  + 1 dispatch between signal and wait", f"{t_c * 1e3:.3f} ms", "the shared-expert overlap")]


def main() -> int:
    if "qwen4-seed" in sys.argv[1:]:  # the Qwen4-Exp synthetic has its own engines and files (qwen4_seed.py)
        import qwen4_seed

        rest = [a for a in sys.argv[1:] if a not in ("--shape", "qwen4-seed", "--shape=qwen4-seed")]
        return qwen4_seed.main(["--tiny" if a == "--small" else a for a in rest])
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--shape", choices=("seed", "qwen3.5-397b", "qwen4-seed", "deepseek-v3"), default="seed",
                    help="full-size synthetic: the reference engine shape, Qwen3.5-397B's hybrid per-layer shape, "
                         "the reference engine's own model (Qwen4-Exp: benchmarks/qwen4_seed.py, --ple-gb G), "
                         "or DeepSeek-V3's (MLA, sigmoid routing in groups, 3 dense layers)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--slots", type=int, default=0, help="streaming arena slots (default: a quarter of the experts)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: resident,streaming,handshake")
    ap.add_argument("--layers", type=int, default=0, help="keep the shape's first N layers (0: all)")
    ap.add_argument("--prompt", type=int, default=8,
                    help="prompt tokens before decoding (1: the prefill launches only what a decoded token does, "
                         "so it compiles nothing more; 8 adds the many-token expert and combine kernels)")
    ap.add_argument("--expert-type", default="Q2_0",
                    help="all-resident experts of llama.cpp's type kept as stored (Q4_K, Q6_K, Q8_0, Q5_K, IQ4_NL, "
                         "IQ4_XS, MXFP4, Q5_1, Q5_0, Q3_K, Q2_K, IQ3_S, IQ2_XXS: kernels/moe_ggml.py), a projection whose rows are not "
                         "whole blocks in llama.cpp's fallback type; streaming stays Q2_0 (skipped for another type)")
    ap.add_argument("--no-eval-sweep", action="store_true",
                    help="all-resident: only the default evaluation interval uncompiled, then the compiled step "
                         "(fewer positions, fewer kernel specialisations to compile: a run under a tight limit)")
    args = ap.parse_args()
    if args.small:
        cfg = {"seed": SMALL, "qwen3.5-397b": SMALL_HYBRID, "deepseek-v3": SMALL_DEEPSEEK}[args.shape]
    else:
        cfg = {"seed": SEED_SHAPE, "qwen3.5-397b": QWEN35_397B_SHAPE, "deepseek-v3": DEEPSEEK_V3_SHAPE}[args.shape]
    full = cfg
    if args.layers:
        if not 0 < args.layers <= cfg.n_layers:
            ap.error(f"--layers must be in [1, {cfg.n_layers}]")
        cfg = replace(cfg, n_layers=args.layers, layer_types=cfg.layer_types[:args.layers])
    skip = set(filter(None, args.skip.split(",")))
    expert_layout = None
    if args.expert_type.upper() != "Q2_0":
        from _ggml_experts import parse_types
        from strata.testing.ggml_records import ggml_layout

        expert_layout = ggml_layout(parse_types(args.expert_type)[0], cfg.hidden_size, cfg.expert_ffn_size)
        skip.add("streaming")  # its .experts file is made of Q2_0 records
    res: dict = {"device": device_name(), "path": current_path().value, "layers": cfg.n_layers, "experts": cfg.n_experts,
                 "k": cfg.n_experts_per_token, "hidden": cfg.hidden_size, "expert_ffn": cfg.expert_ffn_size,
                 "mlx_max_ops_per_buffer": os.environ.get("MLX_MAX_OPS_PER_BUFFER"),  # MLX CUDA: graph size
                 "expert_type": "Q2_0" if expert_layout is None else expert_layout.type_names}
    rows: list = []
    t_setup = time.perf_counter()
    bw = copy_bandwidth((64 << 20) if args.small else (1 << 30))
    kop = None
    if current_path() is KernelPath.GPU:
        xs = mx.zeros((1, 8, 8))
        kop = lambda y: combine_kernel.combine(y.reshape(1, 8), xs, None, y.reshape(1, 8), None).reshape(8)  # noqa: E731
    costs = dispatch_costs(kernel_op=kop)
    res.update({"read_GBps": bw["read_Bps"] / 1e9, "copy_GBps": bw["copy_Bps"] / 1e9, "dispatch_op_us": costs["op_s"] * 1e6,
                "dispatch_kernel_us": costs.get("kernel_s", float("nan")) * 1e6, "round_trip_us": costs["round_trip_s"] * 1e6})
    rows += [("read / copy bandwidth", f"{bw['read_Bps'] / 1e9:.0f} / {bw['copy_Bps'] / 1e9:.0f} GB/s", ""),
             ("dispatch per op / per custom kernel", f"{costs['op_s'] * 1e6:.1f} / {costs.get('kernel_s', float('nan')) * 1e6:.1f} us", ""),
             ("host round trip", f"{costs['round_trip_s'] * 1e6:.1f} us", "")]
    phase(res, "setup (bandwidth, dispatch costs)", t_setup)
    if args.shape == "deepseek-v3":  # the byte budget now: a RESULT's ms times their ratio is the 61 layers' estimate
        print("\n".join(f"  {a:<50} {b:>22}  {c}" for a, b, c in deepseek_extrapolation(full, cfg, res)), flush=True)
    n_prompt = args.prompt
    slots = args.slots or cfg.n_moe_layers * cfg.n_experts // 4  # a quarter of the routed experts
    for name in ("resident", "streaming"):
        if name in skip:
            continue
        note = fit_note(name, cfg, slots, current_path() is KernelPath.GPU)
        res[f"{name}_memory"] = note
        rows.append((f"{name}: memory", "fits" if note.startswith("fits") else "SKIPPED", note))
        if not note.startswith("fits"):
            skip.add(name)
    res["resident_bytes_needed"] = resident_bytes(cfg)
    res["deltanet_layers"] = sum(1 for t in cfg.kinds if t.mixer.value == "deltanet")
    for name, fn in (("resident", lambda: all_resident(cfg, n_prompt, args.tokens, costs, bw, rows, res,
                                                         sweep_eval=not args.no_eval_sweep, expert_layout=expert_layout)),
                     ("handshake", lambda: handshake(48, 4 << 20, rows, res)),
                     ("streaming", lambda: streaming(cfg, n_prompt, args.tokens, slots, rows, res))):
        if name in skip:
            continue
        t0 = time.time()
        with part(name, res, rows):
            try:
                fn()
            finally:
                res[f"{name}_s"] = time.time() - t0
        print("\n".join(f"  {a:<50} {b:>22}  {c}" for a, b, c in rows), flush=True)
        if args.shape == "deepseek-v3":  # after every part: a later part's kill keeps them
            print("\n".join(f"  {a:<50} {b:>22}  {c}" for a, b, c in deepseek_extrapolation(full, cfg, res)), flush=True)
    if args.shape == "deepseek-v3":
        rows += deepseek_extrapolation(full, cfg, res)
    print(f"\n## decode on {res['device']} (path {res['path']}, MLX {mx.__version__}; {cfg.n_layers} layers, "
          f"{cfg.n_experts} experts, top-{cfg.n_experts_per_token}, D={cfg.hidden_size}, F={cfg.expert_ffn_size}, "
          f"experts {res['expert_type']})")
    print_rows(rows, value_width=22)
    print("JSON " + json.dumps(res, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"[decode.py {time.time() - t0:.1f} s]")
    sys.exit(rc)
