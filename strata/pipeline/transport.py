"""Framed messages between neighbouring ranks over `mx.distributed` (ring over TCP, JACCL over
Thunderbolt, MPI), with a deadline on every wait.

A message is a header, int64 [6] = (op, status, rows, cols, kind, arg), then, when rows > 0, a
payload [rows, cols] of `kind` (float32: hidden states and logits; uint8: text, e.g. an error or
a report). Stage i sends only to i + 1 and the last stage only to rank 0, so every hop is a ring
neighbour's (the ring backend connects neighbours only).

Why a watchdog and a hard exit: a `recv` blocks inside MLX's C++ and cannot be interrupted from
Python. The ring backend raises when a peer's socket closes (a rank that exited), but a rank that
never started, or one that is stuck, leaves its neighbours waiting forever. So every blocking
step runs under a deadline; past it the watchdog prints one line naming the rank, the peer and
the step, and ends the process (exit status EXIT_TIMEOUT). Joining the group is the exception:
`init` holds the GIL, so there a guard process ends this one at the deadline (`connect`). Its sockets close, so its neighbours
fail at once with "lost the connection", and the failure travels round the ring: every rank
stops with a clear error, none hangs.

Sends and receives run on the CPU stream: on a Mac the default stream is the GPU's, and a
receive that waits longer than Metal's command-buffer timeout (~5 s) kills the process (reported
for JACCL over Thunderbolt 5: github.com/ml-explore/mlx/issues/3207). A stage waiting for the
previous one is exactly such a wait.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from strata.errors import StrataError

__all__ = ["PipelineError", "Header", "Link", "connect", "EXIT_TIMEOUT", "OK", "FAILED"]

EXIT_TIMEOUT = 75  # EX_TEMPFAIL: the pipeline broke (a neighbour died, hung, or never came)
OK, FAILED = 0, 1  # header status
FLOAT32, TEXT = 0, 1  # header kind
_DTYPES = {FLOAT32: np.float32, TEXT: np.uint8}
HEADER_LEN = 6
WATCH_INTERVAL_S = 0.1  # how often the watchdog looks at the deadline


class PipelineError(StrataError):
    """The pipeline broke: a stage failed (its message is carried to every rank), a neighbour's
    connection was lost, or a wait passed its deadline."""


@dataclass(frozen=True)
class Header:
    op: int
    status: int = OK
    rows: int = 0
    cols: int = 0
    kind: int = FLOAT32
    arg: int = 0

    def to_array(self) -> np.ndarray:
        return np.array([self.op, self.status, self.rows, self.cols, self.kind, self.arg], dtype=np.int64)


class _Watchdog:
    """Ends the process when a blocking step outlives its deadline (module docstring: why)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._what = ""
        threading.Thread(target=self._watch, name="strata-pipeline-watchdog", daemon=True).start()

    @contextmanager
    def guard(self, what: str, seconds: float):
        with self._lock:
            self._deadline, self._what = time.monotonic() + seconds, f"{what} (waited more than {seconds:g} s)"
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL_S)
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                sys.stderr.write(f"error: pipeline rank {self.rank}: {what}; stopping this rank\n")
                sys.stderr.flush()
                os._exit(EXIT_TIMEOUT)


_INIT_GUARD = """
import os, signal, sys, time
pid, seconds, what = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(seconds)
sys.stderr.write(what + "\\n")
sys.stderr.flush()
os.kill(pid, signal.SIGTERM)
"""


def _why(e: Exception) -> str:
    text = " ".join(str(e).split())
    if "error: 98" in text:
        return f"{text}: its address is in use ({os.strerror(98)}); free the port or choose another --starting-port"
    return text


def connect(*, rank_hint: str = "?", timeout: float) -> "Link":
    """Join the group `mlx.launch` described (MLX_HOSTFILE / MLX_RANK for the ring backend),
    within `timeout` seconds."""
    import mlx.core as mx

    # `init` holds the GIL while it waits for the other ranks (measured: a Python thread's ticks
    # stop until it returns; `recv` releases it), so the in-process watchdog cannot run here: a
    # small process of its own ends this one at the deadline instead
    what = (f"error: pipeline rank {rank_hint}: the other ranks did not all connect within {timeout:g} s "
            "(is every rank started, and its port free?); stopping this rank")
    guard = subprocess.Popen([sys.executable, "-c", _INIT_GUARD, str(os.getpid()), str(timeout), what])
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as e:
        raise PipelineError(f"pipeline rank {rank_hint}: cannot join the group: {_why(e)}") from None
    finally:
        guard.kill()
        guard.wait()
    dog = _Watchdog(group.rank())
    if group.size() < 2:
        raise PipelineError("pipeline: the group has one rank; start the ranks with mlx.launch (docs/pipeline.md)")
    return Link(group, dog)


class Link:
    """One rank's end of the pipeline: send to a neighbour, receive from one, each under the
    watchdog. Counts what it moved and how long it waited (the stage's hand-off figures)."""

    def __init__(self, group, watchdog: _Watchdog) -> None:
        self.group, self.dog = group, watchdog
        self.rank, self.size = group.rank(), group.size()
        self.bytes_sent = 0  # every byte this rank sent (headers included)

    def send(self, dst: int, header: Header, payload: np.ndarray | None = None, *, timeout: float) -> None:
        import mlx.core as mx

        arrays = [header.to_array()]
        if header.rows:
            arrays.append(np.ascontiguousarray(payload, dtype=_DTYPES[header.kind]).reshape(header.rows, header.cols))
        with self.dog.guard(f"sending to rank {dst}", timeout):
            for a in arrays:
                try:
                    mx.eval(mx.distributed.send(mx.array(a), dst, group=self.group, stream=mx.cpu))
                except RuntimeError as e:
                    raise PipelineError(f"pipeline rank {self.rank}: lost the connection to rank {dst} while "
                                        f"sending ({_why(e)}; did it exit? see its output)") from None
                self.bytes_sent += a.nbytes

    def recv(self, src: int, *, timeout: float, what: str = "") -> tuple[Header, np.ndarray | None]:
        """The next message from `src`: (header, payload or None)."""
        import mlx.core as mx

        with self.dog.guard(f"no message from rank {src}" + (f" ({what})" if what else ""), timeout):
            head = Header(*(int(v) for v in self._recv(mx, (HEADER_LEN,), mx.int64, src)))
            payload = None
            if head.rows:
                dtype = mx.float32 if head.kind == FLOAT32 else mx.uint8
                payload = self._recv(mx, (head.rows, head.cols), dtype, src)
        return head, payload

    def _recv(self, mx, shape, dtype, src: int) -> np.ndarray:
        try:
            a = mx.distributed.recv(shape, dtype, src, group=self.group, stream=mx.cpu)
            mx.eval(a)
        except RuntimeError as e:
            raise PipelineError(f"pipeline rank {self.rank}: lost the connection to rank {src} ({_why(e)}; "
                                "did it exit? see its output)") from None
        return np.array(a)
