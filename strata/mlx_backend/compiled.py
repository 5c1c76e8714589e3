"""The all-resident decode step under `mx.compile`: traced once, replayed from C++.

Why: on the H200 (MLX 0.32.4, CUDA) a decoded token of the reference engine model is 290 custom-kernel
launches; uncompiled it took ~9.4 ms, of which ~5.2 ms was Python and MLX building the lazy graph
(launch() and the kernel wrappers, per launch) against ~2.9 ms of GPU work. `mx.compile` traces
the step once and replays its graph on later calls with inputs of the same shapes, so the
wrappers' Python runs once per `CompiledDecode`, not once per token.

What the trace may and may not hold:
- the per-call scalars (the token id, the position) are INPUTS: int32 views into the device
  index table (`launch.index_param`), made here per call, outside the traced function (a Python
  int inside it would be baked into the graph: every token would embed the first token at the
  first position). Inside, the wrappers take them as device arrays (`model.decode_device`).
- a DeltaNet layer's state (conv and recurrent arrays) is an input too, and its new state an
  output: the step kernel writes new arrays (the layer's snapshots keep the old ones), so unlike
  a KV cache it cannot be bound into the graph.
- everything else is a constant of the graph: the weights, the arena, the device constants
  (eps, absent inputs, slot bases), and each attention layer's KV buffers (a latent-attention
  layer's one latent buffer: its query kernel writes the new row in place, likewise). The attend kernel writes the
  cache in place through its (const) kc / vc inputs, so the graph must hold the very buffers the
  engine's state holds: a `CompiledDecode` is bound to one state's buffers (`bound_to`), and
  `MlxLayerKV` keeps its buffers across steps on the kernel path.
- no evaluation inside (mx.async_eval raises under mx.compile): `eval_every` is 0 in the trace,
  so the whole token is one graph (MLX splits its command buffers by itself).
- the Python bookkeeping stays outside: the id's range, the context limit, the new
  MlxModelState (lengths + 1, the same KV buffers; each DeltaNet layer's new arrays and the
  snapshot it keeps). The traced function returns the logits and the DeltaNet states.

Only T = 1 (decode) is compiled, routing on the device (no `select`: a host round trip inside
a traced graph is impossible), on the GPU kernel path (the emulator evaluates its inputs to
numpy, which a trace cannot). `MlxEngine` uses it when its kernel plan's compiled_decode (or its `compiled` flag)
says so, and falls back to the uncompiled `forward` if the first (tracing) call raises.

Shapes: V vocab.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from strata.mlx_backend.attention import AttentionWeights, MlxLayerKV, check_context, kernel_applies
from strata.mlx_backend.kernels.attention import split_applies
from strata.mlx_backend.kernels.launch import KernelPath, constant_views, current_path, index_param, using_constant_views
from strata.mlx_backend.kernels.source import MIN_INPUT_SIZE
from strata.mlx_backend.mla import MlaWeights, MlxLatentKV
from strata.mlx_backend.mla import kernel_applies as mla_applies
from strata.mlx_backend.model import MlxModelState, MlxParams, decode_device, dense_arrays
from strata.mlx_backend.residual import RESIDUALS
from strata.reference.deltanet import DeltaNetState, Snapshot
from strata.reference.model import check_token_ids

__all__ = ["CompiledDecode", "unsupported", "check_decode", "check_device_token", "device_ids"]


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
    if (why := RESIDUALS[p.cfg.residual].ops_only) is not None:
        return why
    # latent attention decodes in its kernels (a device position); its ops forms slice by a Python int
    latent = [l for l, lw in enumerate(p.layers) if isinstance(lw.attn, MlaWeights) and not mla_applies(p.cfg, lw.attn)]
    if latent:
        return f"latent-attention layers {latent[:4]} do not fit the MLA kernels (their ops slice by a Python int)"
    # DeltaNet layers read no position (their state is the step's input and output); attention
    # layers need the attend kernel, whose position is a device input
    bad = [l for l, lw in enumerate(p.layers) if isinstance(lw.attn, AttentionWeights)
           and not kernel_applies(p.cfg, lw.attn)]
    if bad:
        return f"layers {bad[:4]} do not fit the attend kernel (their ops attention slices by a Python int)"
    return None


def check_decode(p: MlxParams, state: MlxModelState, token: int) -> None:
    """The host-side checks `forward` makes for one decoded token (same messages)."""
    check_token_ids(np.array([token]), p.cfg.vocab_size)
    check_context(p.cfg, state.length, 1)


def check_device_token(ids: mx.array) -> None:
    """A token already on the device: int32 [1], or [MIN_INPUT_SIZE] (the shape of `index_param`'s
    views and of greedy.greedy_select's output: one trace serves host and device tokens)."""
    if ids.dtype != mx.int32 or ids.shape not in ((1,), (MIN_INPUT_SIZE,)):
        raise ValueError(f"compiled decode: a device token is int32 [1] or [{MIN_INPUT_SIZE}], "
                         f"got {ids.dtype} {tuple(ids.shape)}")


def device_ids(token: int | mx.array) -> mx.array:
    """The step's token input, int32 [MIN_INPUT_SIZE] with the id in element 0: a view into the
    device index table for a host int (no host write), a device token as it is (an [1] one
    padded: one small op, and the trace's input shape stays one)."""
    if not isinstance(token, mx.array):
        return index_param(token)
    if token.shape == (MIN_INPUT_SIZE,):
        return token
    return mx.concatenate([token, mx.zeros((MIN_INPUT_SIZE - 1,), mx.int32)])


def _buffers(state: MlxModelState) -> tuple[mx.array, ...]:
    return tuple(a for kv in state.layers for a in ((kv.keys, kv.values) if isinstance(kv, MlxLayerKV)
                                                    else (kv.buffer,) if isinstance(kv, MlxLatentKV) else ()))


def _recurrent(state: MlxModelState) -> list[mx.array]:
    """The DeltaNet layers' state arrays, in layer order: conv, recurrent, conv, ..."""
    return [a for s in state.layers if isinstance(s, DeltaNetState) for a in (s.conv, s.recurrent)]


def _with_recurrent(state: MlxModelState, arrays, length: int, keep: bool) -> MlxModelState:
    """`state` with its DeltaNet layers' arrays replaced by `arrays` (as `_recurrent` lists them)
    at `length`; keep: with the snapshot a decoded position keeps (deltanet_partials' rule)."""
    it = iter(arrays)
    layers = []
    for s in state.layers:
        if isinstance(s, DeltaNetState):
            conv, rec = next(it), next(it)
            s = (DeltaNetState(conv, rec, length, s.kept).keep([Snapshot(length, conv, rec)]) if keep
                 else DeltaNetState(conv, rec, length, s.kept))
        layers.append(s)
    return MlxModelState(tuple(layers))


def _constant_arrays(p: MlxParams, state: MlxModelState) -> list[mx.array]:
    """The step's graph constants a kernel may take whole: the dense weights, the arena, the KV buffers."""
    return dense_arrays(p) + ([p.arena.array] if p.arena is not None else []) + list(_buffers(state))


class CompiledDecode:
    """One decoded token of `p` over the KV buffers of `state`, traced once (traced=False: the
    same device-scalar step without mx.compile, for the emulator).

    `step(state, token) -> (logits float32 [1, V] (lazy), the state one position on)`; `state`
    must hold the KV buffers this step was built on (`bound_to(state)`); its DeltaNet states are
    the step's inputs."""

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

        def make_step():  # a new function object per trace: mx.compile keys its cache by the function
            def step(ids: mx.array, pos: mx.array, *recurrent: mx.array) -> list[mx.array]:
                state = _with_recurrent(pending[0], recurrent, pending[0].length, keep=False)
                logits, new = decode_device(p, state, ids, pos)  # the layers' new MlxLayerKV: discarded
                return [logits, *_recurrent(new)]
            return mx.compile(step) if traced else step

        self._pending = pending
        # one trace per attention form: the graph of a long context holds the split attend and its
        # merge (kernels/attend_merge.py), that of a short one a block per head; the form is chosen
        # by the context length at trace time (attention_partials), so the step is chosen by it too
        self._make = make_step
        self._fns: dict[bool, object] = {}
        # the large inputs' views made (and evaluated) before the trace: no reshape and slice node
        # a large input that the compiled step would replay every call
        self._views = constant_views(_constant_arrays(p, state)) if traced else None

    def bound_to(self, state: MlxModelState) -> bool:
        """Whether `state` holds the very KV buffers this step's graph writes (by identity)."""
        if state is self._last:
            return True
        bufs = _buffers(state)
        return len(bufs) == len(self._bufs) and all(a is b for a, b in zip(bufs, self._bufs))

    def __call__(self, state: MlxModelState, token: int | mx.array) -> tuple[mx.array, MlxModelState]:
        """token: a host int, or already on the device (int32 [1] or [MIN_INPUT_SIZE], element 0
        the id: greedy.greedy_select's output, so step n + 1 is enqueued before the host has token
        n; its range is not checked, an argmax over the vocabulary is in it)."""
        if isinstance(token, mx.array):
            check_device_token(token)
            check_context(self.p.cfg, state.length, 1)
        else:
            check_decode(self.p, state, token)
        if not self.bound_to(state):
            raise ValueError("compiled decode: the state's KV buffers are not the ones this step was built on")
        if current_path() is not self.path:
            raise ValueError(f"compiled decode: built on the {self.path.value} path, called on {current_path().value}")
        ids, pos = device_ids(token), index_param(state.length)
        self._pending[:] = [state]
        try:
            split = split_applies(state.length + 1, 1)
            fn = self._fns.get(split) or self._fns.setdefault(split, self._make())
            with using_constant_views(self._views):
                logits, *recurrent = fn(ids, pos, *_recurrent(state))
        finally:
            self._pending.clear()  # the trace is done with it; nothing kept between calls
        self.calls += 1
        n = state.length + 1
        new = MlxModelState(tuple(MlxLayerKV(s.keys, s.values, n) if isinstance(s, MlxLayerKV)
                                  else MlxLatentKV(s.buffer, n) if isinstance(s, MlxLatentKV) else s
                                  for s in state.layers))
        new = _with_recurrent(new, recurrent, n, keep=True)
        self._last = new
        return logits, new
