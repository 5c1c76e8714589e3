"""Pipelines of local processes for tests and the hand-off benchmark: what `mlx.launch` does for
the ring backend (a hostfile of 127.0.0.1 ports, MLX_HOSTFILE and MLX_RANK per process), with a
bound on the whole run, and the worker each process runs (`python -m strata.testing.pipeline
SPEC.json`); and a ring of threads in one process (`ThreadedPipeline` over `QueueLink`s),
which runs the same protocol, plan and stages without mx.distributed.

The worker's spec (JSON): model, config (Config fields), options (PipelineOptions fields), arenas
(one per rank: "min", "40slots", ""), prompt (token ids), max_tokens, window (token ids decoded as
one window after trimming back to the prompt), out (rank 0's .npz), and die (rank, after): that
rank ends itself (os._exit) when it receives its `after`-th message (a rank that dies mid-run;
after 0: before it connects, a rank that never starts).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["RankResult", "free_ports", "spawn_ranks", "run_ops", "QueueLink", "ThreadedPipeline"]


@dataclass(frozen=True)
class RankResult:
    rank: int
    returncode: int | None  # None: still running at the deadline (then killed)
    output: str  # stdout and stderr


def free_ports(n: int) -> list[int]:
    """n ports that were free a moment ago (the OS's choice of ephemeral ports)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawn_ranks(n: int, command: list[str], *, timeout: float, ports: list[int] | None = None,
                env: dict | None = None) -> list[RankResult]:
    """Run `command` as ranks 0..n-1 of a ring on 127.0.0.1; every rank's result. A rank still
    running after `timeout` seconds is killed (returncode None)."""
    ports = ports or free_ports(n)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
    logs = [tempfile.TemporaryFile("w+") for _ in range(n)]
    base = dict(os.environ, **(env or {}))
    procs = [subprocess.Popen(command, stdout=logs[r], stderr=subprocess.STDOUT,
                              env=dict(base, MLX_HOSTFILE=f.name, MLX_RANK=str(r))) for r in range(n)]
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p, c in zip(procs, codes):
        if c is None:
            p.kill()
            p.wait()
    os.unlink(f.name)
    out = []
    for r, log in enumerate(logs):
        log.seek(0)
        out.append(RankResult(r, codes[r], log.read()))
        log.close()
    return out


def run_ops(engine, prompt: list[int], max_tokens: int, window: list[int]) -> dict[str, np.ndarray]:
    """The operations the tests compare between a pipeline and one process: greedy decoding
    (every step's logits), then trim back to the prompt and one decode window."""
    logits = [engine.prefill(prompt)]
    tokens = []
    for _ in range(max_tokens):
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(engine.decode(tokens[-1]))
    out = {"tokens": np.array(tokens), "logits": np.stack(logits)}
    if window:
        engine.trim(len(prompt))
        out["window"] = engine.decode_window(window)
    return out


class QueueLink:
    """One rank's end of a ring of threads in one process: the `transport.Link` interface over
    queues (a payload is copied as the wire would carry it), so the pipeline's protocol, stages
    and plan run in-process without mx.distributed."""

    def __init__(self, rank: int, size: int, boxes: dict) -> None:
        self.rank, self.size, self._boxes = rank, size, boxes
        self.bytes_sent = 0

    def send(self, dst: int, header, payload=None, *, timeout: float) -> None:
        from strata.pipeline.transport import HEADER_LEN, _DTYPES

        data = None
        if header.rows:
            data = np.array(payload, dtype=_DTYPES[header.kind]).reshape(header.rows, header.cols)
        self._boxes[(self.rank, dst)].put((header, data))
        self.bytes_sent += HEADER_LEN * 8 + (data.nbytes if data is not None else 0)

    def recv(self, src: int, *, timeout: float, what: str = ""):
        from strata.pipeline.transport import PipelineError

        try:
            return self._boxes[(src, self.rank)].get(timeout=timeout)
        except queue.Empty:
            raise PipelineError(f"pipeline rank {self.rank}: no message from rank {src} within {timeout:g} s"
                                + (f" ({what})" if what else "")) from None


class ThreadedPipeline:
    """A pipeline of ranks in this process: `open` starts ranks 1.. on threads (each serves its
    stage) and returns rank 0's PipelineEngine (closing it ends the threads); `join` waits for
    the threads and gives what each raised (None: nothing)."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: dict[int, BaseException | None] = {}

    def open(self, model_path, config, options, arenas: list[str], *, rank_paths: list | None = None):
        """`rank_paths`: each rank's own model path (default: all `model_path`), as hosts with
        their own copies."""
        from strata.pipeline.launch import open_pipeline

        n = len(arenas)
        rank_paths = rank_paths or [model_path] * n
        boxes = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
        for r in range(1, n):
            self.errors[r] = None
            t = threading.Thread(target=self._serve, name=f"strata-pipeline-rank-{r}", daemon=True,
                                 args=(r, rank_paths[r], config, options, arenas[r], QueueLink(r, n, boxes)))
            t.start()
            self.threads.append(t)
        return open_pipeline(rank_paths[0], config, options, arena=arenas[0], link=QueueLink(0, n, boxes))

    def _serve(self, rank, model_path, config, options, arena, link) -> None:
        from strata.pipeline.launch import open_pipeline

        try:
            open_pipeline(model_path, config, options, arena=arena, link=link)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.errors[rank] = e

    def join(self, timeout: float) -> dict[int, BaseException | None]:
        for t in self.threads:
            t.join(timeout=timeout)
            if t.is_alive():
                raise TimeoutError(f"{t.name} still running after {timeout:g} s")
        return dict(self.errors)


def _die_after(link, after: int) -> None:
    """Make `link` end the process when its `after`-th message arrives."""
    recv, seen = link.recv, [0]

    def dying(*a, **kw):
        seen[0] += 1
        if seen[0] >= after:
            os._exit(9)
        return recv(*a, **kw)

    link.recv = dying


def _worker(spec_path: str) -> int:
    from strata.config import Config
    from strata.errors import StrataError
    from strata.pipeline.launch import open_pipeline
    from strata.pipeline.plan import PipelineOptions
    from strata.pipeline.transport import connect

    spec = json.loads(Path(spec_path).read_text())
    options = PipelineOptions(**spec.get("options", {}))
    die = spec.get("die")
    if die and die[1] == 0 and int(os.environ["MLX_RANK"]) == die[0]:
        os._exit(9)  # a rank that never starts (mlx.launch's variable: the rank is not known before connect)
    try:
        link = connect(timeout=options.connect_timeout)
        if die and die[0] == link.rank:
            _die_after(link, die[1])
        arenas = spec.get("arenas") or [""] * link.size
        engine = open_pipeline(spec["model"], Config(**spec.get("config", {})), options,
                               arena=arenas[link.rank], link=link)
        if engine is not None:
            with engine:
                out = run_ops(engine, spec["prompt"], spec["max_tokens"], spec.get("window", []))
                out["report"] = np.array(engine.report().to_json())
            np.savez(spec["out"], **out)
    except StrataError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
