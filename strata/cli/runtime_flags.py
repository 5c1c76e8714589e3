"""The runtime's command-line flags (design §6), derived from the Config fields: each field with a
flag becomes `--field-name` (booleans get --x and --no-x, enums their choices) with the field's
own help; every other field is reachable through `--set KEY=VALUE`. Flags left out keep the
`STRATA_*` variable or the default; the mapping they produce goes to `strata.config.load_config`,
the one place that reads either."""

from __future__ import annotations

import argparse
import dataclasses
import enum

from strata.config import Config, field_types


def flag_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Config) if f.metadata.get("flag", False)]


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("runtime (streaming; every flag is a Config field, also STRATA_<FIELD>)")
    types = field_types()
    for f in flag_fields():
        flag, kind, text = "--" + f.name.replace("_", "-"), types[f.name], f.metadata["help"].replace("%", "%%")
        if kind is bool:
            g.add_argument(flag, dest=f"cfg_{f.name}", action=argparse.BooleanOptionalAction, default=None, help=text)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            g.add_argument(flag, dest=f"cfg_{f.name}", choices=[m.value for m in kind], default=None, help=text)
        else:
            g.add_argument(flag, dest=f"cfg_{f.name}", type=str if kind is str else kind, default=None,
                           metavar=f.name.upper(), help=text)
    g.add_argument("--set", dest="cfg_set", action="append", default=[], metavar="KEY=VALUE",
                   help="any Config field, e.g. --set io_timeout=30 (repeatable)")
    g.add_argument("--report-json", metavar="PATH", help="write the stream report as JSON to PATH")


def config_from_args(args: argparse.Namespace):
    """The run's Config: defaults < STRATA_* < --set < the named flags."""
    from strata.config import load_config, parse_assignments

    values: dict[str, object] = parse_assignments(args.cfg_set)
    for f in flag_fields():
        value = getattr(args, f"cfg_{f.name}")
        if value is not None:
            values[f.name] = value
    if getattr(args, "cfg_logpos", None):  # named as the flag here; Config's own check names the field
        from strata.cli.paths import check_output_path

        check_output_path(args.cfg_logpos, "--logpos")
    return load_config(values)


def print_report(args: argparse.Namespace, last, file) -> None:
    """The stream report line after a run (unless --quiet) and --report-json."""
    import json

    report = last.report if last is not None else None
    speculation = last.speculation if last is not None else None
    if report is not None and not args.quiet:
        print(report.text(), file=file)
    if speculation is not None and not args.quiet:
        print(speculation.text(), file=file)
    if args.report_json:
        data = report.to_dict() if report is not None else {"streaming": False}
        if speculation is not None:
            data["speculation"] = speculation.to_dict()
        with open(args.report_json, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
