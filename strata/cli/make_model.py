"""`strata make-model PATH`: write a small random model with structured routing (tests, demos)."""

from __future__ import annotations

import argparse


def add_parser(sub, name: str) -> None:
    from strata.testing.models import SHAPES

    p = sub.add_parser(name, help="write a small random test model", description=(
        "Write PATH.gguf and PATH.experts: a random model whose routing has the skew and "
        "token-to-token locality of a trained one (docs/testing.md)."))
    p.add_argument("path", help="output path (PATH.gguf and PATH.experts are written)")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES), help="size preset (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--experts", default="q2_0", help="expert type: q2_0, q4_0, q8_0, f16, f32 (default q2_0)")
    p.add_argument("--dense", default="f32", help="dense matrix type: f32, f16, q8_0 (default f32)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from strata.errors import ConfigError
    from strata.formats.quant_types import parse_quant_type
    from strata.reference.quants import QUANTIZABLE
    from strata.testing.models import make_model

    try:
        expert_type, dense_type = parse_quant_type(args.experts), parse_quant_type(args.dense)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if expert_type not in QUANTIZABLE:  # llama.cpp's types are read from GGUFs, never made
        raise ConfigError(f"expert type {args.experts!r} cannot be made (it is only read, as a GGUF stores it); "
                          f"use one of {', '.join(q.name.lower() for q in QUANTIZABLE)}")
    made = make_model(args.path, args.shape, args.seed, expert_type=expert_type, dense_type=dense_type, progress=True)
    print(f"wrote {made.model_path} and {made.experts_path}")
    return 0
