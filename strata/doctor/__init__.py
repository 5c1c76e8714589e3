"""`strata doctor`: will this model run on this machine, and how fast — without reading a weight.

    from strata.doctor import diagnose
    d = diagnose("~/hf/Qwen3-30B-A3B/config.json", cache_dir=Path("~/.cache/strata"))
    print(d.text())

Modules, one concept each: `families` (weights by part, per family), `byte_budget` (bytes in
memory and per token, by quant type), `source` (reading SOURCE), `locality` (hit rate at an
arena: the model's own trace, or a curve calibrated on strata's own models; `calibrate`
rewrites it), `profile` (what a probe measured), `probe` (this machine, measured once and cached), `probe_engine` (the probe's
engine cases and how they are run), `engine_fit` (the engine costs from those runs), `measure`
(one measured run in a fresh process), `pool` (warmed processes, measured one run at a time),
`joint` (the quick probe's cases and a validation's over one pool), `predict` (arena, tok/s, peak
memory, verdict), `report` (text and JSON).
"""

from strata.doctor.report import Diagnosis, diagnose

__all__ = ["Diagnosis", "diagnose"]
