"""The pipeline flags of `strata generate` (`--hosts`, `--stage-layers`, ...) and what they run:
without `--pipeline-rank`, `mlx.launch` over the hosts (the same command on every host); with it
(what mlx.launch starts), this rank's part: rank 0 generates and prints, the others serve their
stage (docs/pipeline.md)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from strata.pipeline.launch import RANK_FLAG

__all__ = ["add_pipeline_flags", "pipelined", "run_pipelined"]

OWN_FLAGS = ("--hosts", "--starting-port")  # the launcher's: not passed on to the ranks


def add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    from strata.pipeline.plan import STOCK_TIMEOUT

    g = p.add_argument_group("pipeline (several hosts over mx.distributed; docs/pipeline.md)")
    g.add_argument("--hosts", default="", help="comma-separated IPs, one rank each (rank 0 first: it samples); "
                   "runs mlx.launch --backend ring; 127.0.0.1,127.0.0.1 tries it on one machine")
    g.add_argument("--starting-port", type=int, default=None, help="ring ports start here, one per rank (mlx.launch's)")
    g.add_argument("--stage-layers", default="", help="layers per stage, e.g. 10,14 (default: split by bytes)")
    g.add_argument("--stage-arena", default="", help="this rank's arena (min: the smallest legal; default --arena "
                   "or the budget rule on each host)")
    g.add_argument("--pipeline-timeout", type=float, default=STOCK_TIMEOUT,
                   help=f"seconds a rank waits for a neighbour before every rank stops (default {STOCK_TIMEOUT:g})")
    g.add_argument(RANK_FLAG, action="store_true", help=argparse.SUPPRESS)


def pipelined(args: argparse.Namespace) -> bool:
    return bool(args.hosts or args.pipeline_rank)


def _without_own_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in OWN_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in OWN_FLAGS)):
            out.append(a)
    return out


def run_pipelined(args: argparse.Namespace, model_path, config, generate_on) -> int:
    """`--hosts`: launch every rank and return mlx.launch's status. A launched rank: join and
    run its part; rank 0 calls `generate_on(engine)` (the generation and its printing)."""
    from strata.pipeline.launch import launch_command, open_pipeline
    from strata.pipeline.plan import PipelineOptions

    if not args.pipeline_rank:
        command = launch_command(args.hosts, _without_own_flags(args.argv), starting_port=args.starting_port)
        return subprocess.run(command).returncode
    options = PipelineOptions(stage_layers=args.stage_layers, timeout=args.pipeline_timeout,
                              connect_timeout=args.pipeline_timeout)
    engine = open_pipeline(model_path, config, options, arena=args.stage_arena)
    if engine is None:  # a serving rank: rank 0 closed the pipeline
        return 0
    with engine:
        generate_on(engine)
    sys.stdout.flush()
    return 0
