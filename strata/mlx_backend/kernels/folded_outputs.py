"""Outputs no caller reads, folded into one buffer: a launch's intermediates as one allocation.

Why: MLX's host work for a custom kernel grows with its outputs. Each output is an allocation,
a kernel argument, an array the compiled step's replay makes and one the encoder registers. At
the seed shape a decoded token's 146 launches wrote 722 outputs:
15 a layer, of which 7 are read by nobody after the launch. They are a chain's phase
intermediates (the QKV rows, the heads' partials, their sum), the next layer's guess when nothing
streams, and gate/up's `hid` where the down step reads `hpre`. Without a shared expert its
partials and gate are unread too. In py-spy's profile of generate's loop on the H200, allocating
outputs was 8.9% of the host's push of a token.

`fold_source(src, names, dtypes)` is `src` with those outputs declared at the top of its body as
pointers into one uint8 output, `folded`, at offsets given as template values (FOLD_<name>,
16-byte aligned). The body is unchanged, so the kernel computes and writes exactly what it did;
the caller gets None in those places. Every dialect: the pointer qualifier is the prelude's
DEVICE. The folded source keeps its name (launches are counted by it); its template values tell
its build apart. `phases.run` and `phases.chain_all` fold what a LaunchSpec's `fold` or a
chain's `keep` leaves unread (`folded_launch`), before `launch`, so whatever records launches
sees (and compile-checks) the folded source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.source import KernelSource, dtype_name

FOLDED = "folded"  # the one output that holds them
ALIGN = 16  # bytes: every region starts where a 16-byte load may read it
# the template values that place each region: FOLD_<output> in the producer, PACK_<input> in a consumer
FOLD_AT, PACK_AT = "FOLD", "PACK"

# numpy dtype name -> the type a folded pointer is declared with (the same spelling in every
# dialect's prelude: MLX's signatures use these too)
_TYPES = {"float32": "float", "int32": "int32_t", "uint32": "uint32_t"}

_sources: dict[tuple, KernelSource] = {}


@dataclass(frozen=True)
class Shaped:
    """An argument that is not an array yet reads as one where a launch wrapper asks: its shape
    and dtype (phases.Pending, Region)."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class Region(Shaped):
    """A folded output handed on to another launch (folded_launch(regions=True)): its bytes in
    the producer's `folded` buffer. A launch given regions of one buffer for several inputs takes
    that buffer once (`packed`). Only kernel launches read a Region; it is not an array."""

    buffer: mx.array  # uint8: the producer's folded output
    offset: int  # bytes


PACKED = "packed"  # the one input a consumer reads Regions of one buffer through


def fold_source(src: KernelSource, names: Sequence[str], dtypes: Sequence[str]) -> KernelSource:
    """src with outputs `names` (numpy dtype names `dtypes`) moved into the `folded` buffer."""
    return _pointers_into(src, names, dtypes, FOLDED, FOLD_AT, inputs=False)


def pack_inputs(src: KernelSource, names: Sequence[str], dtypes: Sequence[str]) -> KernelSource:
    """src with inputs `names` read from one uint8 input, `packed` (appended last), at offsets
    given as template values (PACK_<name>): the consumer's side of a folded buffer."""
    return _pointers_into(src, names, dtypes, PACKED, PACK_AT, inputs=True)


def _pointers_into(src: KernelSource, names: Sequence[str], dtypes: Sequence[str], buffer: str, prefix: str, *,
                   inputs: bool) -> KernelSource:
    """src with its inputs (or outputs) `names` replaced by one uint8 argument `buffer`, appended
    last, and declared at the top of the body as pointers into it at <prefix>_<name> bytes."""
    key = (src, tuple(names), tuple(dtypes), buffer)
    hit = _sources.get(key)
    if hit is not None:
        return hit
    side = "inputs" if inputs else "outputs"
    if buffer in src.outputs or buffer in src.inputs:
        raise ValueError(f"kernel {src.name}: an argument is already named {buffer!r}")
    own = src.inputs if inputs else src.outputs
    if any(n not in own for n in names) or len(set(names)) != len(names):
        raise ValueError(f"kernel {src.name}: cannot put {list(names)} in one buffer (its {side}: {list(own)})")
    bad = [d for d in dtypes if d not in _TYPES]
    if bad:
        raise ValueError(f"kernel {src.name}: cannot put {side} of dtypes {bad} in one buffer (only {sorted(_TYPES)})")
    const = "const " if inputs else ""
    decls = "".join(f"  {const}DEVICE {_TYPES[d]}* const {n} = ({const}DEVICE {_TYPES[d]}*)({buffer} + {prefix}_{n});\n"
                    for n, d in zip(names, dtypes))
    rest = tuple(o for o in own if o not in names) + (buffer,)
    out = KernelSource(src.name, rest if inputs else src.inputs, src.outputs if inputs else rest,
                       decls + src.body, src.helpers, src.metal)
    _sources[key] = out
    return out


def offsets(names: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str]) -> tuple[list, int]:
    """([(FOLD_<name>, byte offset)], total bytes) of the regions, in order, each ALIGN-aligned."""
    at, template = 0, []
    for n, shape, d in zip(names, shapes, dtypes):
        template.append((f"{FOLD_AT}_{n}", at))
        size = int(np.prod(shape)) * np.dtype(d).itemsize
        at += -(-size // ALIGN) * ALIGN
    return template, max(at, ALIGN)


def folded_launch(launch: Callable, src: KernelSource, inputs: Sequence, output_shapes: Sequence,
                  output_dtypes: Sequence, *, blocks: tuple[int, int, int], threads: int,
                  template: Sequence[tuple[str, int]], fold: Sequence[int] = (),
                  regions: bool = False) -> list:
    """launch(...) with the outputs at indices `fold` folded: None in their places, or with
    regions a `Region` each (for another launch to read; with a single output to fold, the
    array itself, which that launch reads as well). Inputs given as Regions
    of one buffer are read from it (`pack_inputs`). launch: the launcher to call (phases' own
    name for it, which tests replace)."""
    template = tuple(template)
    held = [i for i, a in enumerate(inputs) if isinstance(a, Region)]
    if held:
        buffers = {id(inputs[i].buffer) for i in held}
        if len(buffers) != 1:
            raise ValueError(f"kernel {src.name}: regions of {len(buffers)} buffers; one is read at a time")
        names = [src.inputs[i] for i in held]
        src = pack_inputs(src, names, [dtype_name(inputs[i].dtype) for i in held])
        template += tuple((f"{PACK_AT}_{n}", inputs[i].offset) for n, i in zip(names, held))
        inputs = [a for a in inputs if not isinstance(a, Region)] + [inputs[held[0]].buffer]
    # one output folded would still be one output; unfolded, what a consumer reads is the arrays
    if len(set(fold)) < (1 if regions else 2):
        return launch(src, inputs, output_shapes, output_dtypes, blocks=blocks, threads=threads, template=template)
    fold = sorted(set(fold))
    names = [src.outputs[i] for i in fold]
    dtypes = [dtype_name(output_dtypes[i]) for i in fold]
    at, size = offsets(names, [tuple(output_shapes[i]) for i in fold], dtypes)
    folded_at = set(fold)
    kept = [i for i in range(len(output_shapes)) if i not in folded_at]
    folded = fold_source(src, names, dtypes)
    outs = launch(folded, inputs,
                  [output_shapes[i] for i in kept] + [(size,)], [output_dtypes[i] for i in kept] + [mx.uint8],
                  blocks=blocks, threads=threads, template=template + tuple(at))
    if len(outs) != len(kept) + 1:
        raise AssertionError(f"kernel {folded.name}: {len(outs)} outputs, {len(kept) + 1} expected")
    result: list = [None] * len(output_shapes)
    for i, a in zip(kept, outs):
        result[i] = a
    if regions:
        for i, (_, off) in zip(fold, at):
            result[i] = Region(tuple(output_shapes[i]), output_dtypes[i], buffer=outs[-1], offset=off)
    return result
