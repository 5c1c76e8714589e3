"""Decode speed of a Qwen4-Exp-shaped model on the engines that run it, and its per-token bytes.

    python benchmarks/qwen4_decode.py [--tokens 16] [--hidden 512] [--layers 8] [--experts 64]
        [--dense f32|f16|q8_0] [--bytes-only]

A made model (strata.testing.models, the `qwen4` shape scaled: hidden, layers (one indexed-
attention layer in four, PLE modules on every other DeltaNet layer), experts top-8, Q2_0 experts)
is decoded by the numpy reference engine, the numpy streaming engine (a quarter of the experts in
the arena; PLE rows resident) and the MLX engines (MLX ops; every expert resident, and streaming
through the same quarter arena; on the GPU where MLX has one). Prints a table and one JSON line;
the byte budget per decoded token is what the weights say: dense matrices read once, one
embedding row, each PLE layer's N rows, and k expert records per MoE layer.

With MLX, also what the MLX engines hold and read per token of dense weights: as stored (the
file's types: mlx_backend/dense.py) against float32 (what the MLX engines held before they kept them
as stored: every dense weight widened). --bytes-only prints those and the budget, untimed (MLX's
CPU build: its times say nothing of a GPU's).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

import strata
from strata.config import Backend, Config
from strata.formats.quant_types import QuantType
from strata.model_config import Ffn, LayerType, Mixer, TensorNames
from strata.families.qwen4_exp import Qwen4Names, ngram_heads, ple_layers
from strata.testing.models import SHAPES, make_model

PROMPT = list(b"def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)")


def shape(hidden: int, layers: int, experts: int):
    kinds = tuple(LayerType(Mixer.INDEXED_ATTENTION if (l + 1) % 4 == 0 else Mixer.DELTANET, Ffn.MOE)
                  for l in range(layers))
    ple = ",".join(str(l) for l in range(layers) if kinds[l].mixer is Mixer.DELTANET and l % 2 == 0)
    heads = hidden // 64
    return SHAPES["qwen4"].with_fields(
        hidden_size=hidden, n_layers=layers, layer_types=kinds, n_heads=heads, n_kv_heads=2,
        head_dim=64, rotary_dim=16, n_experts=experts, n_experts_per_token=8, expert_ffn_size=hidden // 2,
        shared_ffn_size=hidden // 2, linear_k_heads=heads // 2, linear_v_heads=heads, linear_k_head_dim=64,
        linear_v_head_dim=64, hc_lowrank=hidden // 8, indexer_heads=8, indexer_head_dim=64, indexer_budget=64,
        indexer_block=8, ple_layer_ids=ple, ple_embed_dim=hidden, ngram_heads_per_order=4, ngram_vocab_base=10007,
        max_context=1024)


def token_bytes(model) -> dict[str, int]:
    """Bytes one decoded token reads: dense (every matrix once, one embedding row), PLE rows, experts."""
    cfg, dense = model.cfg, model.dense
    tables = {TensorNames.block(l, Qwen4Names.ple_ngram) for l in ple_layers(cfg)}
    embed = dense[TensorNames.token_embd]
    dense_b = sum(a.nbytes for n, a in dense.items() if n not in tables and n != TensorNames.token_embd)
    dense_b += embed.nbytes // embed.shape[0]
    ple_b = sum(ngram_heads(cfg) * dense[t].nbytes // dense[t].shape[0] for t in tables)
    experts_b = cfg.n_moe_layers * cfg.n_experts_per_token * model.experts_file.header.padded_bytes
    return {"dense": dense_b, "ple_rows": ple_b, "experts": experts_b}


def mlx_dense_bytes(model) -> dict[str, int]:
    """MLX's dense weights for the all-resident engine: held and read per decoded token (every
    weight once, one embedding row unless the head is tied), as stored and as float32 (4 bytes a
    weight: what widening every tensor held)."""
    from strata.mlx_backend.model import dense_weights, to_mlx_params

    p = to_mlx_params(model.cfg, model.dense, pred_q8=False)
    weights = dense_weights(p)
    stored = sum(w.nbytes for w in weights)
    f32 = sum(4 * int(np.prod(w.shape)) for w in weights)
    embed_stored, embed_f32, v = p.embed.nbytes, 4 * int(np.prod(p.embed.shape)), p.embed.shape[0]
    tied = p.output is p.embed
    read_stored = stored if tied else stored - embed_stored + embed_stored // v
    read_f32 = f32 if tied else f32 - embed_f32 + embed_f32 // v
    return {"held_as_stored": stored, "held_float32": f32, "read_as_stored": read_stored, "read_float32": read_f32}


def ms_per_token(model, config: Config, tokens: int, stream: bool) -> float:
    with strata.open_engine(model, config, stream=stream) as engine:
        engine.prefill(np.asarray(PROMPT))
        token = PROMPT[-1]
        engine.decode(token)  # warm up
        start = time.perf_counter()
        for _ in range(tokens):
            token = int(np.argmax(engine.decode(token)))
        return (time.perf_counter() - start) * 1e3 / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dense", default="f32", choices=("f32", "f16", "q8_0"), help="the dense weights' stored type")
    ap.add_argument("--bytes-only", action="store_true", help="print the bytes, time nothing")
    args = ap.parse_args()
    cfg = shape(args.hidden, args.layers, args.experts)
    dense_type = {"f32": QuantType.F32, "f16": QuantType.F16, "q8_0": QuantType.Q8_0}[args.dense]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        made = make_model(f"{tmp}/qwen4", cfg, seed=1, expert_type=QuantType.Q2_0, dense_type=dense_type)
        made_s = time.perf_counter() - t0
        model = strata.load(made.model_path)
        quarter = f"{cfg.n_moe_layers * cfg.n_experts // 4}slots"
        runs = {"numpy reference": (Config(backend=Backend.NUMPY, moce_lambda=0.0), False),
                f"numpy streaming {quarter}": (Config(backend=Backend.NUMPY, moce_lambda=0.0, arena=quarter), True)}
        mlx_bytes = None
        try:
            import mlx.core as mx

            device = str(mx.default_device())
            runs["mlx (ops, resident)"] = (Config(backend=Backend.MLX, moce_lambda=0.0), False)
            runs[f"mlx streaming {quarter}"] = (Config(backend=Backend.MLX, moce_lambda=0.0, arena=quarter), True)
            mlx_bytes = mlx_dense_bytes(model)
        except ImportError:
            device = "none"
        rows = {} if args.bytes_only else {name: ms_per_token(model, conf, args.tokens, stream)
                                           for name, (conf, stream) in runs.items()}
        budget = token_bytes(model)
        model.close()
    print(f"qwen4 shape: hidden {cfg.hidden_size}, {cfg.n_layers} layers ({len(ple_layers(cfg))} PLE), "
          f"{cfg.n_experts} experts top-{cfg.n_experts_per_token}, dense {dense_type.name}; made in {made_s:.1f} s; "
          f"MLX device {device}")
    if rows:
        print(f"{'engine':36} {'ms/token':>9}")
        for name, ms in rows.items():
            print(f"{name:36} {ms:9.2f}")
    print("bytes per token (numpy, dense as float32): " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in budget.items()))
    if mlx_bytes is not None:
        print(f"\n| MLX dense weights | as stored ({dense_type.name}) | float32 (before) |\n| --- | --- | --- |")
        for what in ("held", "read"):
            label = "held" if what == "held" else "read per token"
            print(f"| {label} | {mlx_bytes[what + '_as_stored'] / 1e6:.2f} MB | {mlx_bytes[what + '_float32'] / 1e6:.2f} MB |")
    print("JSON " + json.dumps({"bench": "qwen4_decode", "hidden": cfg.hidden_size, "layers": cfg.n_layers,
                                "experts": cfg.n_experts, "dense": dense_type.name, "tokens": args.tokens,
                                "mlx_device": device, "ms_per_token": rows, "bytes_per_token": budget,
                                "mlx_dense_bytes": mlx_bytes}))


if __name__ == "__main__":
    main()
