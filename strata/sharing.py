"""How callers share one engine's session: every `generate` / `stream_generate` call on a Model (or
on an engine) gives exactly what the same call gives alone, whichever threads and interleaved
iterators share it.

A call works on the engine in steps (its prompt, then each token), each step holding the engine's
lock; between steps (while an iterator is suspended at a `yield`) the engine is free. Two ways to
share it, by what the engine's state is:

- taking snapshots (`engine.snapshot()` is a value: the reference engine's frozen ModelState):
  when another call takes the engine over, the state of the call that held it is kept as a
  snapshot and restored, exactly, at that call's next step. Threads and iterators interleave
  token by token.
- taking turns (every other engine: MLX's KV buffers are written in place; a streaming engine's
  single arena steers MoCE routing and holds the cache machine's state): one call at a time
  holds the session from its first step to its end. A call from another thread waits for it; a
  call on the thread that holds an unfinished iterator cannot wait for it (that iterator only
  advances when this thread advances it) and is refused with SessionBusyError.

Either way a change made outside the calls (engine.prefill / decode / trim between an iterator's
steps) is refused at that iterator's next step, never computed over.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from strata.errors import SessionBusyError

__all__ = ["Call", "SharedSession"]


class Call:
    """One generate / stream_generate call's claim on an engine's session."""

    def __init__(self) -> None:
        self.started = False  # it has run a step: the engine held its positions
        self.version = -1  # the engine's version at the end of its last step
        self.saved = None  # its snapshot while another call holds the engine (taking snapshots)
        self.thread: int | None = None  # the thread that ran its last step


class SharedSession:
    """The calls on one engine, and the lock each of their steps holds."""

    def __init__(self, engine) -> None:
        self.engine = engine
        # reentrant: an abandoned iterator's generator may be finalized (its `finish`) by the
        # garbage collector on a thread that is inside a step
        self._turn = threading.Condition(threading.RLock())
        self._active: list[Call] = []  # started, not finished, in the order they started
        self._owner: Call | None = None  # the unfinished call whose positions the engine holds

    @property
    def snapshots(self) -> bool:
        return self.engine.takes_snapshots

    @contextmanager
    def step(self, call: Call):
        """Hold the engine for one of `call`'s steps, holding `call`'s own positions."""
        with self._turn:
            if not call.started:
                self._wait_for_turn(call)
                self._active.append(call)
            self._hand_over(call)
            try:
                yield self.engine
            finally:
                call.started, call.version = True, self.engine.version
                call.thread = threading.get_ident()

    def finish(self, call: Call) -> None:
        """`call` is over (done, failed, or its iterator closed): the engine goes on holding its
        positions for the next call's prefix reuse, and a waiting call may start."""
        with self._turn:
            if call in self._active:
                self._active.remove(call)
            if self._owner is call:
                self._owner = None
            call.saved = None
            self._turn.notify_all()

    def wait_until_idle(self, why: str) -> None:
        """Block until no call is unfinished (before the engine is replaced or closed); refused on
        a thread that holds an unfinished iterator itself."""
        with self._turn:
            while self._active:
                self._refuse_on_own_thread(why)
                self._turn.wait()

    # -------------------------------------------------------- inside the lock

    def _wait_for_turn(self, call: Call) -> None:
        if self.snapshots:
            return
        while self._active:
            self._refuse_on_own_thread(f"its engine ({self.engine.kind}) runs one call at a time")
            self._turn.wait()

    def _refuse_on_own_thread(self, why: str) -> None:
        me = threading.get_ident()
        if any(c.thread == me for c in self._active):
            raise SessionBusyError(
                f"this model's session is held by an unfinished stream_generate iterator on this thread and {why}: "
                "finish or close() that iterator first, or give this call its own engine "
                "(engine = strata.open_engine(model, config); stream_generate(engine, ...))")

    def _hand_over(self, call: Call) -> None:
        """Make the engine hold `call`'s positions (its own, exactly, or refuse)."""
        engine = self.engine
        if self._owner is call or not call.started:
            if call.started and engine.version != call.version:
                raise _changed_outside()
            if self._owner is not None and self._owner is not call:  # a new call takes over: keep the holder's
                self._keep(self._owner)
            self._owner = call
            return
        if self._owner is not None:
            self._keep(self._owner)
        if call.saved is None:  # its positions were changed outside the calls before it was kept
            raise _changed_outside()
        engine.restore(call.saved)
        call.saved, self._owner = None, call

    def _keep(self, holder: Call) -> None:
        """The engine's positions are `holder`'s: keep them as its snapshot (None where they were
        changed outside the calls since its last step: that call is then refused)."""
        if holder.started and self.engine.version == holder.version:
            holder.saved = self.engine.snapshot()
        else:
            holder.saved = None


def _changed_outside() -> SessionBusyError:
    return SessionBusyError(
        "the engine's positions were changed outside this stream_generate call while it was suspended "
        "(engine.prefill / decode / trim / reset between its tokens): run such calls after the iterator "
        "finishes, or on another engine (strata.open_engine)")
