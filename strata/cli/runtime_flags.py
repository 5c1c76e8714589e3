"""The runtime's command-line flags (SPEC §6): every Config knob is reachable, as its own flag
or through `--set KEY=VALUE`. Flags left out keep the `STRATA_*` variable or the default; the
mapping they produce goes to `strata.config.load_config`, the one place that reads either."""

from __future__ import annotations

import argparse

# (flag, Config field, type or "bool", help). Booleans get --x and --no-x.
FLAGS: tuple[tuple[str, str, object, str], ...] = (
    ("--arena", "arena", str, "arena size: 2GB, 512MB, 300slots (default: the budget rule; streams when set)"),
    ("--force-arena", "force_arena", "bool", "run an --arena above this machine's budget anyway (default off: refused)"),
    ("--keep", "keep", str, "memory the budget rule leaves to the system (default auto: 7GB per 24GB of RAM)"),
    ("--prefetch", "prefetch", int, "read-ahead depth K (default 10; 16 recommended; 0 off)"),
    ("--prefetch-touch", "prefetch_touch", "bool", "move resident guesses to the LRU front (default off)"),
    ("--prefetch2", "prefetch2", "bool", "also read ahead two layers ahead (default off)"),
    ("--split-turn", "split_turn", "bool", "read-ahead bookkeeping after compute is handed off (default on)"),
    ("--shexp-overlap", "shexp_overlap", "bool", "shared expert during the host turn (default on)"),
    ("--pred-q8", "pred_q8", "bool", "read-ahead guess on a Q8_0 router copy (default on)"),
    ("--moce-j", "moce_j", int, "MoCE: protected top-J (default 3)"),
    ("--moce-lambda", "moce_lambda", float, "MoCE: resident bonus λ (default 0.85; 0 = the model's routing)"),
    ("--moce-scale", "moce_scale", str, "MoCE: bonus in absolute logits or scaled by the logit range"),
    ("--moce-margin", "moce_margin", float, "MoCE: margin gating in logits (default 0: off)"),
    ("--moce-drop-tail", "moce_drop_tail", float, "MoCE: drop non-resident picks with weight below this"),
    ("--moce-drop-rank", "moce_drop_rank", int, "MoCE: ... at selected rank >= this (default 6)"),
    ("--moce-pre", "moce_pre", "bool", "MoCE: unclaimed read-aheads count as resident (default off)"),
    ("--mlock-dense", "mlock_dense", "bool", "wire the dense weights (default off)"),
    ("--wire-arena", "wire_arena", "bool", "wire the arena (default off)"),
    ("--verify-reads", "verify_reads", "bool", "check each record's CRC-32 when it lands (default off)"),
    ("--direct-io", "direct_io", "bool", "O_DIRECT reads where allowed (default on)"),
    ("--io-threads", "io_threads", int, "reader threads (default 4)"),
    ("--io-switch-ms", "io_switch_ms", float, "thread switch interval while streaming (default 0.2; 0: Python's)"),
    ("--prefill-chunk", "prefill_chunk", int, "prompt positions per chunk (default 64)"),
    ("--profile", "profile", "bool", "per-phase ms/token in the stream report"),
    ("--logpos", "logpos", str, "append every position's logits (float32 rows) to this file, for KLD"),
    ("--backend", "backend", str, "auto, numpy or mlx (default auto)"),
)


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("runtime (streaming; every flag is a Config field, also STRATA_<FIELD>)")
    for flag, field, kind, text in FLAGS:
        if kind == "bool":
            g.add_argument(flag, dest=f"cfg_{field}", action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            g.add_argument(flag, dest=f"cfg_{field}", type=kind, default=None, metavar=field.upper(), help=text)
    g.add_argument("--set", dest="cfg_set", action="append", default=[], metavar="KEY=VALUE",
                   help="any Config field, e.g. --set io_timeout=30 (repeatable)")
    g.add_argument("--report-json", metavar="PATH", help="write the stream report as JSON to PATH")


def config_from_args(args: argparse.Namespace):
    """The run's Config: defaults < STRATA_* < --set < the named flags."""
    from strata.config import load_config, parse_assignments

    values: dict[str, object] = parse_assignments(args.cfg_set)
    for _, field, _, _ in FLAGS:
        value = getattr(args, f"cfg_{field}")
        if value is not None:
            values[field] = value
    return load_config(values)


def print_report(args: argparse.Namespace, last, file) -> None:
    """The stream report line after a run (unless --quiet) and --report-json."""
    import json

    report = last.report if last is not None else None
    if report is not None and not args.quiet:
        print(report.text(), file=file)
    if args.report_json:
        data = report.to_dict() if report is not None else {"streaming": False}
        with open(args.report_json, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
