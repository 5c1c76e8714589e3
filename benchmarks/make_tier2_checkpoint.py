"""A realistically sized random tier-2 checkpoint, made with mlx-lm's own classes and quantized
the way its `convert` quantizes: the input of benchmarks/tier2.py on a machine with no models.

    python benchmarks/make_tier2_checkpoint.py qwen3_next  --out /tmp/t2/qwen3_next      # hybrid
    python benchmarks/make_tier2_checkpoint.py deepseek_v3 --out /tmp/t2/deepseek_v3     # MLA
        [--layers N] [--hidden H] [--experts E] [--moe-hidden F] [--top-k K] [--vocab V]
        [--bits 4] [--group-size 64] [--recipe mixed_4_6] [--seed 0] [--set KEY=VALUE ...]

Each family is the real model's per-layer shape with fewer layers (SHAPES: Qwen3-Next-80B-A3B's
and DeepSeek-V3's config.json, DeepSeek-V3 with 64 of its 256 experts by default), so a decode
step reads what one of the real model's layers reads, a few GB in all. The steps are mlx-lm
0.32.2's `convert` without its download: mlx-lm's `Model(ModelArgs)` of the family, every float
parameter drawn at random (below), cast to bfloat16 as convert casts (the model's own
`cast_predicate` kept), `quantize_model` (affine 4 bit g64 by default: mlx-community's `-4bit`;
its own per-module predicate, or a mixed recipe of convert's `--quant-predicate`), `save_model`
and `save_config`; a byte-level tokenizer.json beside them. Prints a summary and one JSON line.

The weights are drawn on MLX's default device (the GPU where there is one), lazily, one layer at
a time under a progress bar: numpy's generator would take minutes for the ~10^10 values. The
rule: N(0, 0.5) / sqrt(fan-in) for matrices, 1 + N(0, 0.1) for norms, N(0, 0.01) for selection
biases (small beside the scores, as trained ones are: routing follows the token), N(0, 0.1) for
other vectors. Random weights route roughly uniformly, so streaming hit rates here are a lower
bound on a trained model's.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
from pathlib import Path

FAMILIES = ("qwen3_next", "deepseek_v3")

# model_type -> (the real model's config.json fields mlx-lm reads, layers made by default)
SHAPES: dict[str, tuple[dict, int]] = {
    # Qwen3-Next-80B-A3B: gated DeltaNet with full attention every 4th layer, 512 experts of 512, top-10
    "qwen3_next": (dict(hidden_size=2048, intermediate_size=5120, num_attention_heads=16, num_key_value_heads=2,
                        head_dim=256, linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10,
                        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=512,
                        shared_expert_intermediate_size=512, norm_topk_prob=True, rms_norm_eps=1e-6,
                        vocab_size=151936, rope_theta=10000000.0, partial_rotary_factor=0.25,
                        max_position_embeddings=262144, full_attention_interval=4, tie_word_embeddings=False), 8),
    # DeepSeek-V3: MLA, the first layer dense (of the real 3), experts of 2048 top-8 in 8 groups (4 eligible)
    "deepseek_v3": (dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
                         num_key_value_heads=128, n_shared_experts=1, n_routed_experts=64, routed_scaling_factor=2.5,
                         kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                         qk_nope_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                         n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=1,
                         max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=129280,
                         rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                         attention_bias=False), 4),
}

# the override flags -> each family's config key
KEYS = {"hidden": "hidden_size", "moe_hidden": "moe_intermediate_size", "vocab": "vocab_size"}
EXPERT_KEYS = {"qwen3_next": ("num_experts", "num_experts_per_tok"),
               "deepseek_v3": ("n_routed_experts", "num_experts_per_tok")}
SELECTION_BIASES = ("e_score_correction_bias", "expert_bias", "router_bias")
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")  # mlx-lm convert's --quant-predicate


class MakeError(ValueError):
    """A request this maker refuses, in one line."""


def family_config(family: str, *, layers: int | None = None, hidden: int | None = None,
                  experts: int | None = None, moe_hidden: int | None = None, top_k: int | None = None,
                  vocab: int | None = None, fields: dict | None = None) -> dict:
    """The config.json of `family` at its SHAPES with the overrides given (None: the shape's);
    `fields`: any other of the family's ModelArgs fields (`--set KEY=VALUE`)."""
    if family not in SHAPES:
        raise MakeError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    base, default_layers = SHAPES[family]
    config = {"model_type": family, **base, "num_hidden_layers": layers or default_layers}
    known = inspect.signature(importlib.import_module(f"mlx_lm.models.{family}").ModelArgs).parameters
    for key, value in (fields or {}).items():
        if key not in known or key == "model_type":  # mlx-lm's from_dict would drop it silently
            raise MakeError(f"--set {key}: not a field of mlx-lm's {family} ModelArgs")
        config[key] = value
    for flag, value in (("hidden", hidden), ("moe_hidden", moe_hidden), ("vocab", vocab)):
        if value is not None:
            config[KEYS[flag]] = value
    n_key, k_key = EXPERT_KEYS[family]
    if experts is not None:
        config[n_key] = experts
    if top_k is not None:
        config[k_key] = top_k
    if not 1 <= config[k_key] <= config[n_key]:
        raise MakeError(f"--top-k {config[k_key]} must be between 1 and the {config[n_key]} experts")
    if family == "deepseek_v3":
        if config[n_key] % config["n_group"]:
            raise MakeError(f"--experts {config[n_key]}: DeepSeek-V3 routes in {config['n_group']} groups, so the "
                            f"experts must be a multiple of {config['n_group']}")
        if config[k_key] > config[n_key] // config["n_group"] * config["topk_group"]:
            raise MakeError(f"--top-k {config[k_key]}: more than the {config['topk_group']} eligible groups of "
                            f"{config[n_key] // config['n_group']} experts hold")
        if config["num_hidden_layers"] <= config["first_k_dense_replace"]:
            raise MakeError(f"--layers {config['num_hidden_layers']}: the first {config['first_k_dense_replace']} "
                            "layer(s) are dense; make at least one more for the experts")
    return config


def _randomize_lazily(model, seed: int) -> None:
    """Replace every float parameter by a lazy random draw (the module doc's rule), in its dtype."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = [(n, a) for n, a in tree_flatten(model.parameters()) if mx.issubdtype(a.dtype, mx.floating)]
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for (name, a), key in zip(params, keys):
        shape = tuple(a.shape)
        z = mx.random.normal(shape, dtype=mx.float32, key=key)
        if len(shape) >= 2:
            v = z * (0.5 / shape[-1] ** 0.5)
        elif "norm" in name:
            v = 1 + 0.1 * z
        elif name.endswith(SELECTION_BIASES):
            v = 0.01 * z
        else:
            v = 0.1 * z
        new.append((name, v.astype(a.dtype)))
    model.update(tree_unflatten(new))


def _cast_as_convert(model, dtype) -> None:
    """convert's dtype cast: every float parameter to `dtype` but where the model's
    `cast_predicate` keeps it (DeepSeek-V3's selection bias stays float32)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))


def make_checkpoint(family: str, out: Path, *, bits: int = 4, group_size: int = 64, recipe: str | None = None,
                    seed: int = 0, progress: bool = True, **shape) -> dict:
    """Make the checkpoint (module doc) in `out`, which must not hold one; -> its summary.
    shape: family_config's overrides."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.models.switch_layers import SwitchGLU
    from mlx_lm.utils import quantize_model, save_config, save_model
    from tqdm import tqdm

    from strata.tokenizer import byte_level_tokenizer_json

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise MakeError(f"{out}: not empty; name a new directory (or delete this one)")
    if recipe is not None and recipe not in RECIPES:
        raise MakeError(f"--recipe {recipe!r}: one of {', '.join(RECIPES)}")
    config = family_config(family, **shape)
    for key in ("hidden_size", "moe_intermediate_size"):
        if config[key] % group_size:  # quantize_model would leave such a layer unquantized, silently
            raise MakeError(f"{key} {config[key]} is not a multiple of --group-size {group_size}")
    start = time.perf_counter()
    module = importlib.import_module(f"mlx_lm.models.{family}")
    model = module.Model(module.ModelArgs.from_dict(config))
    _randomize_lazily(model, seed)
    _cast_as_convert(model, mx.bfloat16)
    predicate = mixed_quant_predicate_builder(recipe, model, group_size) if recipe else None
    model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    layers = model.layers
    with tqdm(total=len(layers) + 1, desc=f"drawing and quantizing {family}", unit="layer", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        for layer in layers:  # one layer's draws at a time: the float32 draws of the whole model never coexist
            mx.eval(layer.parameters())
            bar.update(1)
        mx.eval(model.parameters())  # the embeddings, the head, the final norm
        bar.update(1)
    made = time.perf_counter() - start
    switches = [m for _, m in model.named_modules() if isinstance(m, SwitchGLU)]
    expert_bytes = [sum(a.nbytes for _, a in tree_flatten(m.parameters())) for m in switches]
    n_experts = config[EXPERT_KEYS[family][0]]
    top_k = config[EXPERT_KEYS[family][1]]
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    save_model(out, model)
    save_config(config, out / "config.json")
    (out / "tokenizer.json").write_text(byte_level_tokenizer_json())
    return {"family": family, "directory": str(out), "layers": config["num_hidden_layers"],
            "moe_layers": len(switches), "experts": n_experts, "top_k": top_k, "bits": bits, "group_size": group_size,
            "recipe": recipe, "bytes": total, "expert_bytes": sum(expert_bytes),
            "expert_bytes_per_token": sum(b * top_k // n_experts for b in expert_bytes),
            "dense_bytes": total - sum(expert_bytes), "make_s": round(made, 2),
            "total_s": round(time.perf_counter() - start, 2), "device": str(mx.default_device())}


def _field(text: str) -> tuple[str, object]:
    key, eq, value = text.partition("=")
    if not eq or not key:
        raise MakeError(f"--set {text!r}: write KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("family", choices=FAMILIES)
    ap.add_argument("--out", type=Path, required=True, help="a new (or empty) directory for the checkpoint")
    ap.add_argument("--layers", type=int, help="decoder layers (default: qwen3_next 8, deepseek_v3 4)")
    ap.add_argument("--hidden", type=int, help="hidden size (default: the real model's)")
    ap.add_argument("--experts", type=int,
                    help="routed experts per MoE layer (default: qwen3_next 512, deepseek_v3 64)")
    ap.add_argument("--moe-hidden", type=int, help="one expert's intermediate size (default: the real model's)")
    ap.add_argument("--top-k", type=int, help="experts a token selects (default: the real model's)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default: the real model's)")
    ap.add_argument("--bits", type=int, default=4, help="affine bits (default 4)")
    ap.add_argument("--group-size", type=int, default=64, help="quantization group size (default 64)")
    ap.add_argument("--recipe", choices=RECIPES, help="one of mlx-lm convert's mixed per-module recipes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="any other config field of the family's ModelArgs (VALUE as JSON, else a string)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        fields = dict(_field(s) for s in args.set)
        made = make_checkpoint(args.family, args.out, bits=args.bits, group_size=args.group_size, recipe=args.recipe,
                               seed=args.seed, progress=not args.quiet, layers=args.layers, hidden=args.hidden,
                               experts=args.experts, moe_hidden=args.moe_hidden, top_k=args.top_k, vocab=args.vocab,
                               fields=fields)
    except MakeError as e:
        print(f"make_tier2_checkpoint: {e}", file=sys.stderr)
        return 2
    gb = 1e9
    print(f"{made['family']} in {made['directory']}: {made['layers']} layers ({made['moe_layers']} MoE, "
          f"{made['experts']} experts top-{made['top_k']}), {made['bytes'] / gb:.2f} GB "
          f"(experts {made['expert_bytes'] / gb:.2f} GB, dense {made['dense_bytes'] / gb:.2f} GB), a decode step's "
          f"experts {made['expert_bytes_per_token'] / 1e6:.1f} MB; made in {made['make_s']:.1f} s, written by "
          f"{made['total_s']:.1f} s ({made['device']})")
    print(json.dumps({"benchmark": "make_tier2_checkpoint", **made}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
