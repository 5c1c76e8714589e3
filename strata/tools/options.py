"""Command-line options shared by the analysis subcommands (`strata replay`, `quality`, `sweep`):
how flags become `LoopConfig`s. Lists are comma-separated; several list flags make a grid.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace
from pathlib import Path

from strata.errors import ConfigError
from strata.sizes import parse_size
from strata.cache.types import min_capacity
from strata.reference.routing import STOCK_BONUS, STOCK_DROP_TAIL_RANK, STOCK_J, BonusScale, MoCEPolicy
from strata.tools.closed_loop import GuessRanking, LoopConfig

__all__ = ["add_policy_options", "add_cache_options", "loop_configs", "parse_capacity", "read_text",
           "parse_list", "tool_ops", "SEED_PRESET"]

SEED_PRESET = "seed"
_ON_OFF = {"on": (True,), "off": (False,), "both": (False, True)}


def parse_list(text: str, kind=float, what: str = "value") -> list:
    try:
        return [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{what}: expected a comma-separated list, got {text!r}") from None


def parse_capacity(text: str, *, n_layers: int, n_experts: int, top_k: int, prefetch_depth: int,
                   prefetch2: bool = False, split_turn: bool = True, window: int = 1) -> int:
    """'300' or '300slots' slots, '25%' of all experts (L·E), or 'min' (the smallest legal arena
    for windows of `window` positions): strata.sizes' grammar, less bytes (a trace knows no
    record size)."""
    t = str(text).strip().lower()
    if t == "min":
        return min_capacity(n_layers, top_k, prefetch_depth, prefetch2=prefetch2, split_turn=split_turn,
                            n_experts=n_experts, window=window)
    try:
        spec = parse_size(t, what="capacity")
    except ConfigError:
        raise ConfigError(f"capacity: expected slots (300, 300slots), a percentage (25%) or 'min', got {text!r}") from None
    if spec.nbytes or not (spec.slots or spec.percent):
        raise ConfigError(f"capacity {text!r}: a trace knows no record size; give slots (300), a percentage or 'min'")
    return spec.to_slots(1, n_layers * n_experts)


def read_text(arg: str) -> str:
    """TEXT as given, or the contents of a file when written '@path'."""
    if arg.startswith("@"):
        p = Path(arg[1:])
        if not p.exists():
            raise ConfigError(f"{p}: no such text file")
        return p.read_text(encoding="utf-8", errors="replace")
    return arg


def add_policy_options(p: argparse.ArgumentParser, *, lists: bool) -> None:
    many = " (comma-separated list: one run each)" if lists else ""
    p.add_argument("--J", dest="J", default=str(STOCK_J), help=f"MoCE protected top-J (default {STOCK_J}){many}")
    p.add_argument("--lambda", dest="lam", default=str(STOCK_BONUS),
                   help=f"MoCE bonus λ; 0 is the model's own routing (default {STOCK_BONUS}){many}")
    p.add_argument("--range", action="store_true", help="λ in units of the running logit range (Cache-Prior form)")
    p.add_argument("--margin", type=float, default=None, help="margin gating: cap the bonus at this many logits")
    p.add_argument("--drop-tail", type=float, default=0.0, metavar="W",
                   help="drop non-resident picks with weight < W (default 0: off)")
    p.add_argument("--drop-rank", type=int, default=STOCK_DROP_TAIL_RANK,
                   help=f"... at selected rank >= this (default {STOCK_DROP_TAIL_RANK})")


def add_cache_options(p: argparse.ArgumentParser, *, lists: bool) -> None:
    many = " (list)" if lists else ""
    p.add_argument("--K", dest="K", default="10", help=f"read-ahead depth, 0 = none (default 10){many}")
    p.add_argument("--touch", default="off", choices=sorted(_ON_OFF),
                   help="move resident guesses to the LRU front (default off; 'both' runs each)")
    p.add_argument("--two-ahead", action="store_true", help="also read ahead two layers ahead (prefetch2)")
    p.add_argument("--in-turn", action="store_true", help="the old order: read-ahead inside the host turn")
    p.add_argument("--f32-guess", action="store_true", help="guess on the float32 routers (default: Q8_0 copy)")
    p.add_argument("--moce-pre", action="store_true", help="unclaimed read-aheads count as resident for the bonus")
    p.add_argument("--guess", default="plain", choices=[g.value for g in GuessRanking],
                   help="rank read-ahead guesses by z (plain, the runtime's) or by the MoCE policy (the reference engine's)")
    p.add_argument("--warmup", type=int, default=0, help="tokens that fill the cache but are not counted (default 0)")


def _policies(args) -> list[MoCEPolicy]:
    js = parse_list(args.J, int, "--J")
    lams = parse_list(args.lam, float, "--lambda")
    out, seen = [], set()
    for j, lam in itertools.product(js, lams):
        try:
            pol = MoCEPolicy(protect_top_j=j, bonus=lam,
                             bonus_scale=BonusScale.RANGE if args.range else BonusScale.ABSOLUTE,
                             margin=args.margin, drop_tail_weight=args.drop_tail, drop_tail_min_rank=args.drop_rank)
        except ConfigError as e:
            raise ConfigError(str(e)) from None
        key = (None if lam == 0 else j, lam)  # λ = 0 routes alike whatever J
        if key not in seen:
            seen.add(key)
            out.append(pol)
    return out


def loop_configs(args, caps: list[str], *, n_layers: int, n_experts: int, top_k: int,
                 window: int = 1) -> list[LoopConfig]:
    """The grid caps × K × touch × policies the flags describe (or the reference engine preset's list);
    `window`: the longest decode window replayed ('min' is its smallest legal arena)."""
    if getattr(args, "preset", None) == SEED_PRESET:
        return seed_preset(caps, n_layers=n_layers, n_experts=n_experts, top_k=top_k)
    out = []
    for k, touch, pol in itertools.product(parse_list(args.K, int, "--K"), _ON_OFF[args.touch], _policies(args)):
        base = LoopConfig(capacity=1, prefetch_depth=k, prefetch_touch=touch, prefetch2=args.two_ahead,
                          split_turn=not args.in_turn, pred_q8=not args.f32_guess, policy=pol,
                          moce_pre=args.moce_pre, guess=GuessRanking(args.guess))
        for cap in caps:
            c = parse_capacity(cap, n_layers=n_layers, n_experts=n_experts, top_k=top_k, prefetch_depth=k,
                               prefetch2=base.prefetch2, split_turn=base.split_turn, window=window)
            out.append(replace(base, capacity=c, window=window))
    return out


def seed_preset(caps: list[str], *, n_layers: int, n_experts: int, top_k: int) -> list[LoopConfig]:
    """The reference engine's replay experiments (§1.1-§1.3), per capacity: stock (J3 λ0.85 K10, LRU touch
    of resident guesses, as the reference engine's engine did), K10/K16 with and without touch, no
    read-ahead with and without MoCE, λ = 0 with read-ahead, two layers ahead."""
    stock = MoCEPolicy()
    variants = [
        dict(prefetch_depth=10, prefetch_touch=True, policy=stock),
        dict(prefetch_depth=10, prefetch_touch=False, policy=stock),
        dict(prefetch_depth=16, prefetch_touch=True, policy=stock),
        dict(prefetch_depth=16, prefetch_touch=False, policy=stock),
        dict(prefetch_depth=0, policy=stock),
        dict(prefetch_depth=0, policy=None),
        dict(prefetch_depth=10, policy=None),
        dict(prefetch_depth=10, prefetch2=True, policy=stock),
    ]
    out = []
    for v in variants:
        base = LoopConfig(capacity=1, **v)
        for cap in caps:
            c = parse_capacity(cap, n_layers=n_layers, n_experts=n_experts, top_k=top_k,
                               prefetch_depth=base.prefetch_depth, prefetch2=base.prefetch2)
            out.append(replace(base, capacity=c))
    return out


def scoring_tokens(model, text_arg: str, max_tokens: int) -> list[int]:
    """The tokens `strata quality` / `strata sweep` score: TEXT (or @FILE), the first
    `max_tokens` of it (0: all), at least 2 and within the model's context."""
    from strata.errors import ConfigError

    tokens = model.tokenizer.encode(read_text(text_arg))
    if max_tokens > 0:
        tokens = tokens[:max_tokens]
    if len(tokens) < 2:
        raise ConfigError("the text needs at least 2 tokens")
    if len(tokens) > model.cfg.max_context:
        raise ConfigError(f"{len(tokens)} tokens exceed the model's context of {model.cfg.max_context} (use --max-tokens)")
    return tokens


def tool_ops(model, config=None):
    """The products the numpy engine computes `model` with under `config` (default: the
    configuration `generate` reads, STRATA_* variables applied): the compiled CPU kernels under
    `cpu_kernels` where they build, else the float32 reference's. The analysis tools compute on
    these (strata.tools.quality), so their logits and decisions are the runtime's bit for bit."""
    from strata.config import from_env
    from strata.numpy_backend.engine import cpu_ops

    return cpu_ops(from_env() if config is None else config)
