"""One generation at a time, in arrival order, on one thread that owns the model.

The process holds one Model and so one engine and one arena; the engine's session is the
prompt cache (a prompt that extends what the session holds prefills only the new suffix), so
two requests may never interleave on it. Requests queue FIFO (`queue.Queue`) and the worker
thread runs them through `stream_generate` one after another. Generation stays off the event
loop, which keeps accepting, validating and streaming while a request computes.

Each Job hands its events to the event loop through `call_soon_threadsafe`. A cancelled job
(its client went away, or a stop sequence matched) is dropped before it starts, or stopped
after the token in flight: the worker checks between tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from strata.generate import GenerationResponse, stream_generate

log = logging.getLogger("strata.serve")


@dataclass(frozen=True)
class Sampling:
    """A request's sampling, as stream_generate takes it (every field but max_tokens by name)."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def options(self) -> dict:
        """The keyword arguments of stream_generate."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Started:
    queue_seconds: float  # time spent waiting behind earlier requests


@dataclass(frozen=True)
class Token:
    response: GenerationResponse


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Done:
    cancelled: bool


Event = Started | Token | Failed | Done


class Job:
    """One request's generation: prompt tokens and sampling in, events out to the event loop.
    Create it on the event loop (it binds the running loop)."""

    def __init__(self, tokens: list[int], sampling: Sampling) -> None:
        self.tokens = tokens
        self.sampling = sampling
        self.submitted = time.perf_counter()
        self._cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._getter: asyncio.Future | None = None

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def push(self, event: Event) -> None:
        """From the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (the server is stopping): nobody listens
            self.cancel()

    async def next_event(self, timeout: float) -> Event | None:
        """The next event, or None after `timeout` seconds without one. The pending `get` is
        kept across timeouts, never cancelled: a cancelled get can race with the item it was
        about to return, and a lost event would be a lost piece of text."""
        if self._getter is None:
            self._getter = asyncio.ensure_future(self._events.get())
        try:
            done, _ = await asyncio.wait({self._getter}, timeout=timeout)
        except asyncio.CancelledError:  # the request is gone: nobody will read the rest
            self._getter.cancel()
            raise
        if not done:
            return None
        getter, self._getter = self._getter, None
        return getter.result()


class Worker:
    """The generation thread. `generate` is `stream_generate` (tests pass a scripted one)."""

    def __init__(self, model, config, *, generate: Callable = stream_generate) -> None:
        self.model = model
        self.config = config
        self._generate = generate
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._running = 0

    @property
    def depth(self) -> int:
        """Requests waiting or running."""
        return self._queue.qsize() + self._running

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve_forever, name="strata-serve", daemon=True)
                self._thread.start()
        self._queue.put(job)

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the job in flight (queued jobs are dropped as cancelled)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _serve_forever(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._running = 1
            try:
                done = self._serve(job)
            finally:
                # not running before Done reaches the request: a client that reads /metrics right
                # after its answer sees the queue it left (a race seen under load)
                self._running = 0
            job.push(done)

    def _serve(self, job: Job) -> Done:
        """Run `job`, pushing its events; -> the Done event, for the caller to push."""
        if job.cancelled:
            return Done(cancelled=True)
        job.push(Started(time.perf_counter() - job.submitted))
        steps = self._generate(self.model, job.tokens, config=self.config, **job.sampling.options())
        try:
            for response in steps:
                if job.cancelled:
                    break
                job.push(Token(response))
        except Exception as e:  # reported to the request; the worker goes on to the next one
            log.exception("generation failed")
            job.push(Failed(e))
        finally:
            try:
                steps.close()  # a cut-short generation releases its engine's resources here
            except Exception:
                log.exception("closing a generation failed")
        return Done(cancelled=job.cancelled)
