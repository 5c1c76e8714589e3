"""The pipeline engine: rank 0's session (`PipelineEngine`, a SessionEngine the generation loop
drives) and the other ranks' loop (`serve_stage`).

Every operation starts on rank 0 and goes round the ring once: rank 0 runs its own layers and
sends (header, hidden [T, D]) to rank 1; stage i receives, runs its layers, sends on; the last
stage computes logits and sends them to rank 0, which samples (so sampling is one host's, with
the same seeds). Operations: PREFILL (the prompt path; the last position's logits [1, V]), WINDOW
(T decode positions; every position's logits [T, V]), TRIM (keep n positions), MARK (remember
the stage's totals under a number), REPORT (every stage's report since a mark, gathered as JSON
text), KEPT (the largest position <= n every stage can trim to: a recurrent layer restores only
its snapshots), CLOSE. A stage that fails sends its error on instead of a result; every rank raises it,
rank 0 as a PipelineError from the call.
"""

from __future__ import annotations

import json
import time
import traceback

import numpy as np

from strata.errors import StrataError
from strata.pipeline.report import PipelineReport, StageTotals, stage_record
from strata.pipeline.transport import FAILED, FLOAT32, OK, TEXT, Header, Link, PipelineError
from strata.session import SessionEngine

__all__ = ["PipelineEngine", "serve_stage", "hello", "PREFILL", "WINDOW", "TRIM", "MARK", "REPORT", "CLOSE", "HELLO",
           "KEPT"]

PREFILL, WINDOW, TRIM, MARK, REPORT, CLOSE, HELLO, KEPT = range(1, 9)
OP_NAMES = {PREFILL: "prefill", WINDOW: "decode window", TRIM: "trim", MARK: "mark", REPORT: "report",
            CLOSE: "close", HELLO: "opening the stages", KEPT: "kept position"}


def _text(s: str) -> np.ndarray:
    return np.frombuffer(s.encode(), dtype=np.uint8).reshape(1, -1)


def _untext(a: np.ndarray) -> str:
    return a.astype(np.uint8).tobytes().decode(errors="replace")


class _Stage:
    """What every rank does with one message: its layers, then the message for the next hop."""

    def __init__(self, engine, link: Link, timeout: float) -> None:
        self.engine, self.link, self.timeout = engine, link, timeout
        self.marks: dict[int, StageTotals] = {}
        self.sums = StageTotals()

    @property
    def next_rank(self) -> int:
        return (self.link.rank + 1) % self.link.size

    def totals(self) -> StageTotals:
        return self.sums.at(self.engine.ledger())

    def account(self, head: Header, *, compute_s: float = 0.0, wait_s: float = 0.0, send_s: float = 0.0,
                sent: int = 0) -> None:
        """Add one operation's figures: a decode window (as the stream report counts them: at
        most `window` positions) or a prompt; other operations are not counted."""
        if head.op in (PREFILL, WINDOW):
            decode = head.op == WINDOW and head.rows <= self.engine.cache_config.window
            self.sums = self.sums.plus(decode, compute_s=compute_s, wait_s=wait_s, send_s=send_s, sent=sent)

    def send(self, dst: int, head: Header, payload) -> None:
        before, start = self.link.bytes_sent, time.perf_counter()
        self.link.send(dst, head, payload, timeout=self.timeout)
        self.account(head, send_s=time.perf_counter() - start, sent=self.link.bytes_sent - before)

    def recv(self, src: int, what: str) -> tuple[Header, np.ndarray | None]:
        start = time.perf_counter()
        head, payload = self.link.recv(src, timeout=self.timeout, what=what)
        self.account(head, wait_s=time.perf_counter() - start)
        return head, payload

    def step(self, head: Header, payload) -> tuple[Header, np.ndarray | None]:
        """Apply one operation to this stage; the message it passes on."""
        e, op = self.engine, head.op
        if head.status == FAILED or op in (CLOSE, HELLO):
            return head, payload
        if op == TRIM:
            e._truncate(head.arg)
            return head, None
        if op == KEPT:  # the compute's: a stage engine's own session holds no tokens (rank 0's does)
            return Header(KEPT, OK, arg=e.compute.kept_position(head.arg)), None
        if op == MARK:
            self.marks[head.arg] = self.totals()
            return head, None
        if op == REPORT:
            mine = stage_record(self.link.rank, e, self.totals(), self.marks.get(head.arg))
            text = (_untext(payload) + "\n" if payload is not None else "") + json.dumps(mine, sort_keys=True)
            out = _text(text)
            return Header(REPORT, OK, 1, out.shape[1], TEXT, head.arg), out
        x = payload if e.stage.embeds is False else payload.reshape(-1).astype(np.int64)
        start = time.perf_counter()
        if op == PREFILL:
            y = e._prefill(x)  # a middle stage: every position's hidden state; the last: logits [V]
        elif op == WINDOW:
            y = e._timed_window(x) if len(x) <= e.cache_config.window else e._window(x)
        else:
            raise PipelineError(f"pipeline rank {self.link.rank}: unknown operation {op}")
        self.account(head, compute_s=time.perf_counter() - start)
        y = np.asarray(y, dtype=np.float32).reshape(-1, y.shape[-1])
        return Header(op, OK, y.shape[0], y.shape[1], FLOAT32, head.arg), y

    def failed(self, op: int, e: BaseException) -> tuple[Header, np.ndarray]:
        return _failure(self.link.rank, op, e)


def _failure(rank: int, op: int, e: BaseException) -> tuple[Header, np.ndarray]:
    """The message that carries a stage's failure round the ring."""
    if isinstance(e, PipelineError):
        msg = str(e)
    else:
        why = str(e) if isinstance(e, StrataError) else "".join(traceback.format_exception_only(e)).strip()
        msg = f"pipeline rank {rank} ({OP_NAMES.get(op, op)}): {why}"
    out = _text(msg)
    return Header(op, FAILED, 1, out.shape[1], TEXT), out


def hello(link: Link, error: BaseException | None, *, timeout: float, files: str = "") -> None:
    """The opening: two laps round the ring after every rank opened its stage (or failed to).
    The first gathers: rank 0 sends `files` (what names its model files' content); each rank
    passes on the first failure it heard of, else its own, else a mismatch of rank 0's files with
    its own. The second lap carries that verdict to every rank, so every rank raises the same
    PipelineError, the ranks before the one that failed too."""
    mine = _failure(link.rank, HELLO, error) if error is not None else None
    nxt, prev = (link.rank + 1) % link.size, link.rank - 1 if link.rank else link.size - 1
    if link.rank == 0:
        first = mine or (Header(HELLO, OK, 1, len(files.encode()) or 1, TEXT), _text(files or " "))
        link.send(nxt, *first, timeout=timeout)
        verdict = link.recv(prev, timeout=timeout, what="waiting for every stage to open")
    else:
        head, payload = link.recv(prev, timeout=timeout, what="waiting for the stages before to open")
        if mine is None and head.status != FAILED and _untext(payload).strip() != files:
            mine = _failure(link.rank, HELLO, PipelineError(
                f"pipeline rank {link.rank}: its model files are not rank 0's (rank 0: {_untext(payload).strip()}; "
                f"rank {link.rank}: {files}): copy the same .gguf and .experts to every host"))
        link.send(nxt, *((head, payload) if head.status == FAILED or mine is None else mine), timeout=timeout)
        verdict = link.recv(prev, timeout=timeout, what="waiting for the opening's verdict")
    link.send(nxt, *verdict, timeout=timeout)
    if link.rank == 0:  # the verdict came round: every rank has heard it
        link.recv(prev, timeout=timeout, what="waiting for every stage to hear the opening's verdict")
    head, payload = verdict
    if head.status == FAILED:
        raise PipelineError(_untext(payload))


def serve_stage(engine, link: Link, *, timeout: float) -> None:
    """Ranks 1.. : receive from the previous rank, compute, send on, until CLOSE. A failure
    (here or upstream) is passed on, then raised here as a PipelineError."""
    stage = _Stage(engine, link, timeout)
    prev = link.rank - 1
    try:
        while True:
            head, payload = stage.recv(prev, "waiting for the previous stage")
            try:
                out = stage.step(head, payload)
            except Exception as e:  # noqa: BLE001 - every failure must reach every rank
                out = stage.failed(head.op, e)
            stage.send(stage.next_rank, *out)
            if out[0].status == FAILED:
                raise PipelineError(_untext(out[1]))
            if head.op == CLOSE:
                return
    finally:
        engine.close()


class PipelineEngine(SessionEngine):
    """Rank 0's end: the Engine protocol over the whole pipeline (`engine`: rank 0's stage)."""

    kind = "pipeline"

    def __init__(self, engine, link: Link, *, timeout: float, plan=None) -> None:
        super().__init__(engine.model, engine.config)
        if link.rank != 0:
            raise PipelineError(f"PipelineEngine runs on rank 0, not rank {link.rank}")
        self.stage = _Stage(engine, link, timeout)
        self.link, self.timeout, self.plan = link, timeout, plan
        self._marks = 0
        self._broken: str | None = None

    # -------------------------------------------------------- one trip round the ring

    def _round(self, head: Header, payload=None) -> tuple[Header, np.ndarray | None]:
        if self._broken:
            raise PipelineError(f"the pipeline is broken: {self._broken}")
        try:
            out = self.stage.step(head, payload)
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
            out = self.stage.failed(head.op, e)
        try:
            self.stage.send(1, *out)
            back = self.stage.recv(self.link.size - 1, "waiting for the last stage")
        except PipelineError as e:
            self._broken = str(e)
            raise
        if back[0].status == FAILED:
            self._broken = _untext(back[1])
            raise PipelineError(self._broken)
        return back

    def _logits(self, op: int, tokens: np.ndarray) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
        _, logits = self._round(Header(op, OK, ids.shape[0], 1, FLOAT32), ids.astype(np.float32))
        return logits

    def _prefill(self, tokens: np.ndarray) -> np.ndarray:
        return self._logits(PREFILL, tokens)[-1]

    def _decode(self, token: int) -> np.ndarray:
        return self._logits(WINDOW, np.asarray([token]))[-1]

    def _window(self, tokens: np.ndarray) -> np.ndarray:
        return self._logits(WINDOW, tokens)

    def _truncate(self, n: int) -> None:
        self._round(Header(TRIM, arg=n))

    def kept_position(self, n: int) -> int:
        """The largest m <= n every stage can restore: each stage lowers n to its own kept
        position on the way round; rounds repeat until none lowers it (stages that saw the same
        calls keep the same positions, so one round is the rule)."""
        n = super().kept_position(n)
        while True:
            head, _ = self._round(Header(KEPT, arg=n))
            if head.arg == n:
                return n
            n = head.arg

    def _cache_totals(self):
        return self.stage.engine.streamer.totals  # rank 0's; the report has every stage's

    # -------------------------------------------------------- reports

    def ledger(self) -> int:
        """A mark every stage remembers its totals under (pass it to `report(since=...)`)."""
        self._marks += 1
        self._round(Header(MARK, arg=self._marks))
        return self._marks

    def report(self, since: int | None = None) -> PipelineReport:
        """Every stage's stream report since the mark `since` (default: the engines' lives)."""
        _, text = self._round(Header(REPORT, arg=since or 0))
        return PipelineReport.from_records([json.loads(line) for line in _untext(text).splitlines()])

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        try:
            if not self._broken:
                self.link.send(1, Header(CLOSE), timeout=self.timeout)
                self.link.recv(self.link.size - 1, timeout=self.timeout, what="closing")
        finally:
            self.stage.engine.close()
