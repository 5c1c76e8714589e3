"""Starting a pipeline: the per-rank entry point (`open_pipeline`) and the `mlx.launch` command
line that `strata generate --hosts ...` runs.

`mlx.launch --hosts A,B --backend ring -- python -m strata.pipeline.launch generate ...` starts
the same command on every host (rank = the host's place in --hosts); each rank joins the group,
plans the stages (every rank computes the same plan from its own copy of the model files), loads
and opens its own stage, and takes part in the opening round, which also refuses model files
that differ between ranks (`files_identity`). Rank 0 then runs the command
(generation, sampling) with a PipelineEngine; the other ranks serve their stage until rank 0
closes it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from strata.config import Config
from strata.errors import ConfigError
from strata.pipeline.plan import PipelineOptions, plan_stages

__all__ = ["open_pipeline", "launch_command", "files_identity", "RANK_FLAG"]

RANK_FLAG = "--pipeline-rank"  # the flag a launched rank's command carries (cli/generate.py)


def open_pipeline(model_path, config: Config, options: PipelineOptions, *, arena: str = "", link=None):
    """Join the pipeline and open this rank's stage. Rank 0: returns its PipelineEngine (the
    caller drives and closes it); other ranks: serve their stage until rank 0 closes, then
    return None. `arena`: this rank's arena ("min" for the smallest legal; default the config's)."""
    from strata.formats.experts_file import ExpertsFile
    from strata.formats.model_file import read_model_config
    from strata.errors import ParameterError
    from strata.loader import experts_path_for, load
    from strata.model_source import is_llama_cpp_gguf
    from strata.pipeline.engine import PipelineEngine, hello, serve_stage
    from strata.pipeline.stage import backend_note, open_stage
    from strata.pipeline.transport import connect

    link = link or connect(timeout=options.connect_timeout)
    engine, error, files = None, None, ""
    model_path = Path(model_path)
    try:
        if is_llama_cpp_gguf(model_path):  # run in place by one process only (strata/convert/gguf_in_place.py)
            raise ParameterError(f"{model_path}: pipeline stages run converted models only; run "
                                 f"`strata convert {model_path} OUT` first")
        cfg = read_model_config(model_path)
        with ExpertsFile.open(experts_path_for(model_path)) as xf:
            slot_bytes = xf.header.padded_bytes
            files = files_identity(model_path, xf)
        plan = plan_stages(cfg, link.size, expert_bytes=slot_bytes, stage_layers=options.stage_layers)
        stage = plan.stages[link.rank]
        model = load(model_path, layers=stage)
        note = backend_note(model, config)
        if note:  # said once at start on each rank it applies to, and kept in its stage's report
            # one write per line: print() writes the text and its newline apart, so two ranks
            # in one process (threads) could interleave them
            sys.stderr.write(f"pipeline rank {link.rank}: {note}\n")
            sys.stderr.flush()
        engine = open_stage(model, config, stage, arena=arena)
    except Exception as e:  # noqa: BLE001 - told to every rank in the opening round
        error = e
    try:
        hello(link, error, timeout=options.timeout, files=files)
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    if link.rank == 0:
        return PipelineEngine(engine, link, timeout=options.timeout, plan=plan)
    serve_stage(engine, link, timeout=options.timeout)
    return None


def files_identity(model_path: Path, experts) -> str:
    """What names a rank's model files by content, compared in the opening round (every rank
    plans the stages from its own copy, so copies that differ would compute a wrong model): the
    .gguf's recorded CRC-32 (its size where an older file has none) and the .experts identity
    (a hash of every record's CRC-32). Reads headers only."""
    from strata.formats.model_file import read_file_checksum

    crc = read_file_checksum(model_path)
    model = f"model crc32 {crc:#010x}" if crc is not None else f"model of {model_path.stat().st_size} bytes (no checksum)"
    return f"{model}, experts {experts.identity}"


def launch_command(hosts: str, argv: list[str], *, starting_port: int | None = None,
                   backend: str = "ring") -> list[str]:
    """The `mlx.launch` command that runs `strata <argv>` (without --hosts) on every host."""
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        raise ConfigError("hosts: mlx.launch is not on PATH (it ships with mlx; pip install mlx)")
    port = ["--starting-port", str(starting_port)] if starting_port else []
    return [launcher, "--hosts", hosts, "--backend", backend, *port, "--",
            sys.executable, "-m", "strata.pipeline.launch", *argv, RANK_FLAG]


if __name__ == "__main__":  # what mlx.launch runs on each rank
    from strata.cli.main import main

    sys.exit(main(sys.argv[1:]))
