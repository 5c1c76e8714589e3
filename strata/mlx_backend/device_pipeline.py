"""MlxEngine's greedy pipeline: decode steps whose next token never leaves the device.

Each pushed step decodes one token after the last pushed one and ends in the device's greedy
selection of its logits (greedy.py); a step pushed with no token takes the previous step's
selection as its token input, so the host enqueues step n + 1 before it has read token n, and
the GPU always has the next step queued while the host reads this one's small result. What the
host loop waited for per token (H200, seed shape, context 8): the round trip of the logits and
the encoding of the next step, 5.45 ms a token against 3.83 ms enqueued back to back.

The session changes only when a step is committed (`MlxEngine._commit`, when the loop goes on
past the token it decodes, as `decode` would have run then): a pushed step never committed (the
one enqueued past an end-of-text, or one left when the caller stops) is dropped and leaves
`length`, `tokens` and the state as they were. Its KV rows were written in
place at positions past the session's length, which every later step writes over before any
attention reads them (MlxModelState.trim's rule: later positions are written over).

The step: the engine's compiled decode (compiled.py, the GPU kernel path) where it has one,
else `model.decode_device` uncompiled (MLX's CPU build on the ops path, the emulated kernels,
or `compiled=False`): the same layers with the token input already on the device; the
positions are host-known either way. A first compiled call that fails (the trace) gives up the
compiled step as `MlxEngine._decode` does, and the same push runs uncompiled. MlxEngine offers
the pipeline where its kernel plan's `pipelined` is on (the default).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from strata.errors import StrataError
from strata.mlx_backend import compiled as compiled_step
from strata.mlx_backend.attention import MlxLayerKV, check_context
from strata.mlx_backend.kernel_plan import using_plan
from strata.mlx_backend.greedy import Selection, greedy_select, read_selection
from strata.mlx_backend.mla import MlxLatentKV
from strata.mlx_backend.model import MlxModelState, decode_device
from strata.reference.deltanet import DeltaNetState

__all__ = ["DevicePipeline"]


@dataclass(frozen=True)
class _Pushed:
    state: MlxModelState  # the session's state once this step is committed
    selection: mx.array  # int32 [MIN_INPUT_SIZE], greedy.py's layout (lazy until read)
    token: int | None  # the token decoded; None: the previous step's selection


def _arrays(state: MlxModelState, compiled: bool) -> list[mx.array]:
    """What to evaluate of a step's new state: the DeltaNet arrays (new each step); uncompiled
    also the KV arrays (new arrays on the ops path, where the cache is not written in place)."""
    out = []
    for s in state.layers:
        if isinstance(s, DeltaNetState):
            out += [s.conv, s.recurrent]
        elif not compiled and isinstance(s, MlxLayerKV):
            out += [s.keys, s.values]
        elif not compiled and isinstance(s, MlxLatentKV):
            out.append(s.buffer)
    return out


class DevicePipeline:
    """The GreedyPipeline (strata.device_greedy) of one MlxEngine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._pushed: deque[_Pushed] = deque()  # pushed, not committed, oldest first
        self._committed: _Pushed | None = None  # the last step committed
        self._read: Selection | None = None  # its selection, once read

    @property
    def pending(self) -> int:
        return len(self._pushed)

    def push(self, token: int | None) -> None:
        """Enqueue the decode of `token` (host-known), or with None of the token the last pushed
        (or committed) step selects, one position after it (or after the session's last)."""
        eng = self.engine
        if eng.closed:
            raise StrataError("decode: the engine is closed")
        last = self._pushed[-1] if self._pushed else self._committed
        if token is None and last is None:
            raise ValueError("greedy pipeline: a step without a token needs a step before it")
        state = self._pushed[-1].state if self._pushed else eng.state
        ids = last.selection if token is None else int(token)
        with using_plan(eng.plan):
            logits, new, compiled = self._decode_step(state, ids)
            selection = greedy_select(logits)
        mx.async_eval(selection, *_arrays(new, compiled))  # enqueued: the host goes on at once
        self._pushed.append(_Pushed(new, selection, None if token is None else int(token)))

    def commit(self) -> None:
        """The oldest pushed step becomes the session's next position (no wait: its token is
        host-known by now, the int it was pushed with or the selection read before it)."""
        step = self._pushed.popleft()
        token = step.token if step.token is not None else self.selection().token
        self.engine._commit(step.state, token)
        self._committed, self._read = step, None

    def selection(self) -> Selection:
        """The last committed step's selection: read once (it waits for that step only)."""
        if self._committed is None:
            raise ValueError("greedy pipeline: no step committed yet")
        if self._read is None:
            self._read = read_selection(self._committed.selection)
        return self._read

    def drop(self) -> None:
        """Forget every step pushed and not committed: the session keeps what was committed."""
        self._pushed.clear()

    def _decode_step(self, state: MlxModelState, token: int | mx.array) -> tuple[mx.array, MlxModelState, bool]:
        """(logits float32 [1, V] (lazy), the state one position on, whether compiled)."""
        eng = self.engine
        if isinstance(token, mx.array):
            compiled_step.check_device_token(token)
            check_context(eng.params.cfg, state.length, 1)
        else:
            compiled_step.check_decode(eng.params, state, token)
        step = eng._step  # bound to `state` by identity when it is the last step's (no per-layer scan)
        if step is None or not step.bound_to(state):
            step = eng._compiled_step()
        if step is not None:
            first = step.calls == 0
            try:
                logits, new = step(state, token)
                return logits, new, True
            except Exception as exc:  # the first call traces: any failure, uncompiled from now on
                if not first:
                    raise
                eng._give_up(f"{type(exc).__name__}: {exc}")
        ids = compiled_step.device_ids(token)
        # no device position: untraced, every layer takes state.length from the host, as `forward`
        # does (the ops attention refuses a device position)
        logits, new = decode_device(eng.params, state, ids, None)
        return logits, new, False
