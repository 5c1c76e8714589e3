"""The all-resident decode step under `mx.compile`: traced once, replayed from C++.

Why: on the H200 (MLX 0.32.4, CUDA) a decoded token of the seed model is 290 custom-kernel
launches; uncompiled it took ~9.4 ms, of which ~5.2 ms was Python and MLX building the lazy graph
(launch() and the kernel wrappers, per launch) against ~2.9 ms of GPU work. `mx.compile` traces
the step once and replays its graph on later calls with inputs of the same shapes, so the
wrappers' Python runs once per `CompiledDecode`, not once per token.

What the trace may and may not hold:
- the per-call scalars (the token id, the position) are INPUTS: int32 views into the device
  index table (`launch.index_param`), made here per call, outside the traced function (a Python
  int inside it would be baked into the graph: every token would embed the first token at the
  first position). Inside, the wrappers take them as device arrays (`model.decode_device`).
- everything else is a constant of the graph: the weights, the arena, the device constants
  (eps, absent inputs, slot bases), and each layer's KV buffers. The attend kernel writes the
  cache in place through its (const) kc / vc inputs, so the graph must hold the very buffers the
  engine's state holds: a `CompiledDecode` is bound to one state's buffers (`bound_to`), and
  `MlxLayerKV` keeps its buffers across steps on the kernel path.
- no evaluation inside (mx.async_eval raises under mx.compile): `eval_every` is 0 in the trace,
  so the whole token is one graph (MLX splits its command buffers by itself).
- the Python bookkeeping stays outside: the id's range, the context limit, the new
  MlxModelState (lengths + 1, the same buffers). The traced function returns the logits only.

Only T = 1 (decode) is compiled, routing on the device (no `select`: a host round trip inside
a traced graph is impossible), on the GPU kernel path (the emulator evaluates its inputs to
numpy, which a trace cannot). `MlxEngine` uses it when COMPILED_DECODE (or its `compiled` flag)
says so, and falls back to the uncompiled `forward` if the first (tracing) call raises.

Shapes: V vocab.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.attention import MlxLayerKV, check_context, kernel_applies
from strata.mlx_backend.kernels.launch import KernelPath, current_path, index_param
from strata.mlx_backend.model import MlxModelState, MlxParams, decode_device
from strata.reference.model import check_token_ids
from strata.model_config import Mixer

__all__ = ["COMPILED_DECODE", "CompiledDecode", "unsupported", "check_decode"]

# MlxEngine's default (its `compiled` argument overrides it): compile the decode step where the
# path allows (the GPU kernel path). False: every token runs the uncompiled `forward`.
COMPILED_DECODE = True


def unsupported(p: MlxParams, *, traced: bool = True) -> str | None:
    """Why `CompiledDecode` cannot run `p` on the current path, or None when it can. traced:
    under mx.compile (the GPU path only); untraced, any kernel path (tests on the emulator)."""
    path = current_path()
    if traced and path is not KernelPath.GPU:
        return f"the {path.value} path (mx.compile needs the GPU kernel path)"
    if path is KernelPath.OPS:
        return "the ops path (the position would be a Python int in its attention)"
    if p.arena is None:
        return "experts are not all resident (streaming decodes through MlxCompute)"
    recurrent = [l for l, t in enumerate(p.cfg.kinds) if t.mixer is Mixer.DELTANET]
    if recurrent:  # the compiled step is bound to KV buffers; a DeltaNet state is new arrays each step
        return f"layers {recurrent[:4]} are DeltaNet layers (the compiled step binds KV buffers only)"
    bad = [l for l, lw in enumerate(p.layers) if not kernel_applies(p.cfg, lw.attn)]
    if bad:
        return f"layers {bad[:4]} do not fit the attend kernel (their ops attention slices by a Python int)"
    return None


def check_decode(p: MlxParams, state: MlxModelState, token: int) -> None:
    """The host-side checks `forward` makes for one decoded token (same messages)."""
    check_token_ids(np.array([token]), p.cfg.vocab_size)
    check_context(p.cfg, state.length, 1)


def _buffers(state: MlxModelState) -> tuple[mx.array, ...]:
    return tuple(a for kv in state.layers for a in (kv.keys, kv.values))


class CompiledDecode:
    """One decoded token of `p` over the KV buffers of `state`, traced once (traced=False: the
    same device-scalar step without mx.compile, for the emulator).

    `step(state, token) -> (logits float32 [1, V] (lazy), the state one position on)`; `state`
    must hold the buffers this step was built on (`bound_to(state)`)."""

    def __init__(self, p: MlxParams, state: MlxModelState, *, traced: bool = True) -> None:
        why = unsupported(p, traced=traced)
        if why is not None:
            raise ValueError(f"compiled decode: not on {why}")
        self.p = p
        self.traced = traced
        self.path = current_path()
        self._bufs = _buffers(state)
        self._last: MlxModelState | None = None  # the state the last step returned (bound: same buffers)
        self.calls = 0  # steps run; the first traces
        pending: list[MlxModelState] = []  # the state of the call being traced (read by the trace only)

        def step(ids: mx.array, pos: mx.array) -> mx.array:
            logits, _ = decode_device(p, pending[0], ids, pos)  # the layers' new MlxLayerKV: discarded
            return logits

        self._pending = pending
        self._fn = mx.compile(step) if traced else step

    def bound_to(self, state: MlxModelState) -> bool:
        """Whether `state` holds the very KV buffers this step's graph writes (by identity)."""
        if state is self._last:
            return True
        bufs = _buffers(state)
        return len(bufs) == len(self._bufs) and all(a is b for a, b in zip(bufs, self._bufs))

    def __call__(self, state: MlxModelState, token: int) -> tuple[mx.array, MlxModelState]:
        check_decode(self.p, state, token)
        if not self.bound_to(state):
            raise ValueError("compiled decode: the state's KV buffers are not the ones this step was built on")
        if current_path() is not self.path:
            raise ValueError(f"compiled decode: built on the {self.path.value} path, called on {current_path().value}")
        ids, pos = index_param(token), index_param(state.length)  # device views: no host write
        self._pending[:] = [state]
        try:
            logits = self._fn(ids, pos)
        finally:
            self._pending.clear()  # the trace is done with it; nothing kept between calls
        self.calls += 1
        new = MlxModelState(tuple(MlxLayerKV(kv.keys, kv.values, kv.length + 1) for kv in state.layers))
        self._last = new
        return logits, new
