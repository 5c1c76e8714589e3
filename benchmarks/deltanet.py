"""The DeltaNet decode kernels (GPU): the decode step's time against its bytes (the recurrent state
read + written, the conv state, the conv weights, the projection row), the three-launch mixer of a
decoded DeltaNet layer (input projection, step, output projection) against its bytes (weights
read + state), and the MLX-ops delta rule for comparison, at Qwen3.5-397B's shape (hidden 4096,
16 k heads and 64 v heads of 128, conv 4). Prints a table, then one JSON line.

Two numbers first (docs/mlx_backend.md has the prediction): a step moves 8.9 MB (2.6 us at
~3.4 TB/s) and one custom-kernel call costs ~8 us of host dispatch, so a single call measures
dispatch. The step is timed over LAYERS launches in one evaluation, each layer with its own state
(45 x 8.4 MB, far past the 60 MB L2): the wall time per launch includes the gaps between
launches; ncu gives the GPU time alone (`--ncu`, device_run.sh's ncu_deltanet stage).

    python benchmarks/deltanet.py            # full size (GPU)
    python benchmarks/deltanet.py --small    # smoke test: small heads, the emulated path on a CPU
    python benchmarks/deltanet.py --ncu      # a few launches of the step and the mixer for ncu
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from _measure import copy_bandwidth, device_name, kernel_bench_path, median_time, part, print_rows  # noqa: E402
from strata.mlx_backend import deltanet as mdn  # noqa: E402
from strata.mlx_backend.kernels import deltanet as step_kernel  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, KernelPath, using_path  # noqa: E402
from strata.model_config import ModelConfig  # noqa: E402
from strata.reference.deltanet import L2NORM_EPS, SOFTPLUS_THRESHOLD, DeltaNetState, conv_channels  # noqa: E402
from strata.testing.mlx_params import QWEN35_397B_SHAPE, random_deltanet  # noqa: E402

LAYERS = 45  # Qwen3.5-397B's DeltaNet layers: one launch each per timed evaluation
MIXER_LAYERS = 16  # 16 x 236 MB of projection weights per evaluation
SMALL = QWEN35_397B_SHAPE.with_fields(hidden_size=256, linear_k_heads=2, linear_v_heads=4, linear_k_head_dim=32,
                linear_v_head_dim=32)


def step_bytes(cfg: ModelConfig) -> int:
    """HBM bytes one decode step must move: the state read and written, the conv state read and
    written, the conv weights (float16), the projection row read and the output written."""
    dn = cfg.deltanet
    hv, dk, dv, kc = dn.linear_v_heads, dn.linear_k_head_dim, dn.linear_v_head_dim, dn.linear_conv_kernel
    c = conv_channels(cfg)
    proj = c + hv * dv + 2 * hv
    return 2 * 4 * hv * dk * dv + 2 * 4 * c * (kc - 1) + 2 * c * kc + 4 * proj + 4 * hv * dv


def _layer_inputs(cfg: ModelConfig, n: int, seed: int):
    """n layers' weights, states and projection rows, made on the device and evaluated."""
    keys = mx.random.split(mx.random.key(seed), 3 * n)
    dn = cfg.deltanet
    c, hv = conv_channels(cfg), dn.linear_v_heads
    width = c + hv * dn.linear_v_head_dim + 2 * hv
    ws = [random_deltanet(cfg, keys[3 * i]) for i in range(n)]
    states = [DeltaNetState(mx.random.normal((c, dn.linear_conv_kernel - 1), key=keys[3 * i + 1]),
                            mx.random.normal((hv, dn.linear_k_head_dim, dn.linear_v_head_dim), key=keys[3 * i + 2]) * 0.1)
              for i in range(n)]
    projs = [mx.random.normal((1, width), key=keys[3 * i + 1]) for i in range(n)]
    xs = [mx.random.normal((1, cfg.hidden_size), key=keys[3 * i + 2]) for i in range(n)]
    mx.eval(*[a for w in ws for a in w.arrays()], *[a for s in states for a in (s.conv, s.recurrent)], *projs, *xs)
    return ws, states, projs, xs


def _step(cfg: ModelConfig, w: mdn.DeltaNetWeights, s: DeltaNetState, proj: mx.array):
    return step_kernel.deltanet_step(proj, s.conv, w.conv, w.a, w.dt_bias, w.out_norm, s.recurrent,
                                     k_heads=cfg.deltanet.linear_k_heads, eps=cfg.rms_norm_eps, l2_eps=L2NORM_EPS,
                                     softplus_max=SOFTPLUS_THRESHOLD)


def _ops_rule(cfg: ModelConfig, s: DeltaNetState, q, k, v, g, beta):
    """The delta rule alone in MLX ops (one position), what the step replaces besides its conv and norms."""
    o, states = mdn.recurrent(s.recurrent, q, k, v, g, beta)
    return o, states[-1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="small heads; on a CPU the emulated path (a smoke test)")
    ap.add_argument("--ncu", action="store_true", help="only a few launches of the step and the mixer, for ncu")
    args = ap.parse_args()
    path = kernel_bench_path(args.small)
    if path is None:
        return 1
    cfg = SMALL if args.small else QWEN35_397B_SHAPE
    n_layers, n_mixer = (4, 2) if args.small else (LAYERS, MIXER_LAYERS)
    nbytes = step_bytes(cfg)
    dn = cfg.deltanet
    res: dict = {"device": device_name(), "path": path.value, "hidden": cfg.hidden_size, "k_heads": dn.linear_k_heads,
                 "v_heads": dn.linear_v_heads, "dk": dn.linear_k_head_dim, "dv": dn.linear_v_head_dim,
                 "conv": dn.linear_conv_kernel, "step_bytes": nbytes,
                 "step_threads": step_kernel.threads_for(dn.linear_k_head_dim, dn.linear_v_head_dim)}
    rows: list = []
    with using_path(path):
        ws, states, projs, xs = _layer_inputs(cfg, n_layers, seed=0)
        if args.ncu:  # 3 steps, then one mixer (3 launches), each evaluated alone
            for i in range(3):
                mx.eval(*_step(cfg, ws[i], states[i], projs[i]))
            mx.eval(mdn.deltanet_partials(cfg, ws[0], states[0], xs[0])[0])
            return 0
        bw = copy_bandwidth((64 << 20) if args.small else (2 << 30))
        res["copy_GBps"] = bw["copy_Bps"] / 1e9
        rows.append(("copy bandwidth (read+write)", f"{res['copy_GBps']:.0f} GB/s", ""))
        reps = dict(warmup=1, reps=3) if args.small else {}

        with part("step", res, rows):
            t = median_time(lambda: mx.eval([a for i in range(n_layers) for a in _step(cfg, ws[i], states[i], projs[i])]),
                            **reps) / n_layers
            res.update({"step_us": t * 1e6, "step_GBps": nbytes / t / 1e9, "step_fraction_of_copy": nbytes / t / bw["copy_Bps"]})
            rows.append((f"decode step: {n_layers} launches per eval", f"{t * 1e6:.1f} us/launch",
                         f"{nbytes / 1e6:.2f} MB: {nbytes / t / 1e9:.0f} GB/s = {nbytes / t / bw['copy_Bps'] * 100:.0f}% of copy"))
            rows.append(("  floor: bytes / copy bandwidth", f"{nbytes / bw['copy_Bps'] * 1e6:.2f} us", "prediction 3-5 us (GPU time)"))

        with part("ops_rule", res, rows):
            hv, dk, dv = cfg.deltanet.linear_v_heads, cfg.deltanet.linear_k_head_dim, cfg.deltanet.linear_v_head_dim
            key = mx.random.split(mx.random.key(7), 5)
            q, k = mx.random.normal((hv, 1, dk), key=key[0]) * 0.1, mx.random.normal((hv, 1, dk), key=key[1]) * 0.1
            v, g = mx.random.normal((hv, 1, dv), key=key[2]), -mx.random.uniform(0, 1, (hv, 1), key=key[3])
            beta = mx.random.uniform(0, 1, (hv, 1), key=key[4])
            mx.eval(q, k, v, g, beta)
            with using_path(KernelPath.OPS):
                t = median_time(lambda: mx.eval([a for i in range(n_layers) for a in _ops_rule(cfg, states[i], q, k, v, g, beta)]),
                                **reps) / n_layers
            res["ops_rule_us"] = t * 1e6
            rows.append(("MLX ops: the delta rule alone (no conv, norms)", f"{t * 1e6:.1f} us/layer",
                         f"{2 * 4 * hv * dk * dv / t / 1e9:.0f} GB/s of state"))

        with part("mixer", res, rows):
            ws_m = ws[:n_mixer]
            wbytes = sum(a.nbytes for a in (ws_m[0].norm, ws_m[0].w_in, ws_m[0].wo, ws_m[0].conv, ws_m[0].out_norm))
            before = sum(LAUNCHES.values())
            mx.eval(mdn.deltanet_partials(cfg, ws_m[0], states[0], xs[0])[0])
            res["mixer_launches"] = sum(LAUNCHES.values()) - before
            t = median_time(lambda: mx.eval([mdn.deltanet_partials(cfg, ws_m[i], states[i], xs[i])[0] for i in range(n_mixer)]),
                            **reps) / n_mixer
            mb = wbytes + nbytes
            res.update({"mixer_us": t * 1e6, "mixer_bytes": mb, "mixer_GBps": mb / t / 1e9,
                        "mixer_fraction_of_copy": mb / t / bw["copy_Bps"]})
            rows.append((f"decoded DeltaNet mixer ({res['mixer_launches']} launches), {n_mixer} layers per eval",
                         f"{t * 1e6:.1f} us/layer",
                         f"{mb / 1e6:.1f} MB: {mb / t / 1e9:.0f} GB/s = {mb / t / bw['copy_Bps'] * 100:.0f}% of copy"))

    print(f"\n## DeltaNet decode kernels on {res['device']} (path {res['path']}, MLX {mx.__version__})")
    if path is KernelPath.EMULATED:
        print("(emulated: the CPU emulator's times, not a GPU's; this run checks the benchmark runs)")
    print_rows(rows)
    print("JSON " + json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    t0 = time.time()
    rc = main()
    print(f"[deltanet.py {time.time() - t0:.1f} s]")
    sys.exit(rc)
