"""Dependent launches as one: a producer's blocks, then a consumer's that read its outputs (and
so on: a chain of phases, each reading earlier phases' outputs).

Why: on the H200 (MLX 0.32.4) a decoded token is host-bound: each custom-kernel launch costs the
host ~15 us (MLX's compiled replay and its evaluation), 242 a token at
the seed shape, against ~10 us of GPU time for most of them. A chain of two launches whose second
reads the first's whole output (the QKV GEMV, then attention with its output projection) needs a
grid-wide dependency, which one launch can hold without a grid barrier:

- each block takes a ticket (an atomic add on a counter) when it starts; tickets below the
  second phase's start (CHAIN_S1) run the first phase's body as its block `ticket`, the next ones
  the second's as block `ticket - CHAIN_S1`, and so on. Tickets are handed out in the order blocks
  actually start, so a waiting block waits only for blocks that have started before it and do not
  wait for it: no deadlock whatever order or residency the hardware gives the grid (the ordering
  argument of single-pass scans' decoupled look-back);
- a block of any phase but the last ends with a device fence (every thread) and a count; a block
  of the next phase waits for that phase's count (thread 0 spins on a volatile read, then a fence
  and a block barrier) where its body first needs earlier outputs, so what it does before that
  (loading its own weights) overlaps the phases before it. Waiting for the phase just before is
  enough: its blocks counted only after their own wait;
- the last block to finish resets the counters, so the next launch (the next layer's) finds them
  zero; each chain site has its own counters (`counters`), so no two launches share them.
- a phase may count finer than per phase: `extra` counters after the chain's own
  (`chain_extra[0 ..]` in every body, zeroed with the rest), and a phase's wait may be its own
  snippet (`custom_waits`) that waits on one of them: kernels/qkv_groups.py counts a KV group's
  QKV rows so an attention block waits for its group alone, not for the whole GEMV.

Bodies run unchanged inside a scope each, with their block index, inputs, outputs and template
values as local aliases (the fused kernel's arguments are prefixed a_, b_, c_ ..., its template
values A_, B_, ...). A body may not `return` (the block would skip its count). CUDA and the
emulator only: Metal declares threadgroup memory at kernel scope, not in a body's scope, and does
not promise the forward progress the wait needs (`available`).

On the emulator blocks run one after another in ticket order, so every wait is already met (an
unmet one is an error there, not a hang).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from strata.mlx_backend import kernel_plan
from strata.mlx_backend.kernels.folded_outputs import Shaped, folded_launch
from strata.mlx_backend.kernels.launch import launch
from strata.mlx_backend.kernels.source import MIN_INPUT_SIZE, KernelSource

__all__ = ["ChainStamps", "Pending", "LaunchSpec", "available", "chain", "chain_all", "chain_source", "chain_sources",
           "counters", "run"]


@dataclass(frozen=True)
class Pending(Shaped):
    """A producer's output before it exists, where a consumer's wrapper reads its shape and dtype."""


@dataclass(frozen=True)
class LaunchSpec:
    """One launch's arguments, as `launch` takes them (a wrapper's `spec=True`)."""

    src: KernelSource
    inputs: tuple
    output_shapes: tuple
    output_dtypes: tuple
    blocks: tuple[int, int, int]
    threads: int
    template: tuple[tuple[str, int], ...]
    fold: tuple[int, ...] = ()  # outputs the caller will not read (folded_outputs.folded_launch)
    regions: bool = False  # the folded outputs come back as folded_outputs.Region (another launch reads them)


def run(spec: LaunchSpec) -> list:
    """Launch one spec."""
    return folded_launch(launch, spec.src, list(spec.inputs), list(spec.output_shapes), list(spec.output_dtypes),
                         blocks=spec.blocks, threads=spec.threads, template=spec.template, fold=spec.fold,
                         regions=spec.regions)


def available() -> bool:
    """Whether one-launch chains run here: the kernel plan's `chained_launches` (the emulator and
    MLX's CUDA build can; Metal cannot)."""
    return kernel_plan.current().chained_launches


_TICKET = r"""
  SHARED uint32_t chain_ticket;
  uint32_t* const chain_ctr = (uint32_t*)counters;
  if (tid == 0) chain_ticket = atomic_add_u32(chain_ctr, 1u);
  BARRIER();
  const uint32_t chain_vb = chain_ticket;
"""
# every thread fences its own writes before the barrier (not only the counting thread: the
# conservative form of "publish, then count"), so the count is seen only after all of them;
# phase i counts into chain_ctr[1 + i], and phase i + 1 waits there for phase i's blocks
def _done(i: int) -> str:
    return f"""
  fence_device();
  BARRIER();
  if (tid == 0) atomic_add_u32(chain_ctr + {1 + i}, 1u);
"""


def _wait(i: int) -> str:
    blocks = "CHAIN_S1" if i == 1 else f"(CHAIN_S{i} - CHAIN_S{i - 1})"  # phase i - 1's blocks
    return f"""
  if (tid == 0) wait_count(chain_ctr + {i}, (uint32_t){blocks});
  BARRIER();
"""


def _reset(n: int, extra: int) -> str:  # the last of the launch's blocks to leave zeroes every counter
    return f"""
  if (tid == 0 && atomic_add_u32(chain_ctr + {n}, 1u) == (uint32_t)(CHAIN_NTOT - 1)) {{
    for (int c = 0; c <= {n + extra}; ++c) chain_ctr[c] = 0u;
    fence_device();
  }}
"""
MAX_PHASES = MIN_INPUT_SIZE - 1  # the counters: a ticket, a count per phase but the last, the exits

_sources: dict[tuple, KernelSource] = {}


def _prefix(i: int) -> str:
    return "abcdefg"[i] + "_"


def _aliases(names: Sequence[str], prefix: str) -> str:
    return "".join(f"    const auto {n} = {prefix}{n};\n" for n in names)


def _consts(template: Sequence[tuple[str, int]], prefix: str) -> str:
    return "".join(f"    constexpr int {k} = {prefix}{k};\n" for k, _ in template)


def _start(i: int) -> str:
    return "0u" if i == 0 else f"(uint32_t)CHAIN_S{i}"


def chain_sources(srcs: Sequence[KernelSource], links: Sequence[tuple[tuple[str, int, str], ...]],
                  templates: Sequence[Sequence[tuple[str, int]]], waits: Sequence[int],
                  custom_waits: Sequence[str | None] = (), extra: int = 0) -> KernelSource:
    """The one-launch body of phases srcs[0], srcs[1], ... in that order. links[i]: (input of
    phase i, earlier phase j, output of phase j) triples, phase i reading that output for that
    input; waits[i]: the offset in phase i's body where it first needs them (0: at its start;
    phase 0 waits for nothing). Phase i waits for phase i - 1's count only: that phase's blocks
    counted after their own wait, so every earlier phase is done too. custom_waits[i], where
    given and not None, is phase i's wait instead (it must hold the same promise: every output
    it reads written); extra: counters the bodies count into themselves (`chain_extra`)."""
    n = len(srcs)
    custom_waits = tuple(custom_waits) + (None,) * (n - len(custom_waits))
    key = (tuple(srcs), tuple(links), tuple(tuple(k for k, _ in t) for t in templates), tuple(waits), custom_waits,
           extra)
    hit = _sources.get(key)
    if hit is not None:
        return hit
    if not 2 <= n <= MAX_PHASES:
        raise ValueError(f"chain: 2 to {MAX_PHASES} phases, got {n}")
    for src in srcs:
        if re.search(r"\breturn\b", src.body):
            raise ValueError(f"chain: {src.name}'s body returns (a block would skip its count)")
    inputs, outputs, text = ["counters"], [], _TICKET
    if extra:
        text += f"  uint32_t* const chain_extra = chain_ctr + {n + 1};\n"
    for i, src in enumerate(srcs):
        pre = _prefix(i)
        linked = {c: (j, o) for c, j, o in links[i]}
        if (set(linked) - set(src.inputs) or any(not 0 <= j < i or o not in srcs[j].outputs for j, o in linked.values())
                or (i == 0 and linked)):
            raise ValueError(f"chain: links {links[i]} name no input of {src.name} / output of an earlier phase")
        free = [c for c in src.inputs if c not in linked]
        inputs += [pre + c for c in free]
        outputs += [pre + o for o in src.outputs]
        body = src.body
        if i > 0:
            body = body[:waits[i]] + (custom_waits[i] or _wait(i)) + body[waits[i]:]
        last = i == n - 1
        text += (("  if" if i == 0 else "  } else if") + f" (chain_vb < (uint32_t)CHAIN_S{i + 1}) {{\n" if not last
                 else "  } else {\n")
        text += (f"    const uint32_t bx = chain_vb - {_start(i)};\n" + _aliases(free + list(src.outputs), pre)
                 + "".join(f"    const auto {c} = {_prefix(j)}{o};\n" for c, (j, o) in linked.items())
                 + _consts(templates[i], pre.upper()) + "    {\n" + body + "\n    }\n")
        if not last:
            text += _done(i)
    text += "  }\n" + _reset(n, extra)
    helpers = ""
    for src in srcs:
        if src.helpers not in helpers:
            helpers += src.helpers
    name = "strata_chain_" + "_".join(src.name.removeprefix("strata_") for src in srcs)
    src = KernelSource(name, tuple(inputs), tuple(outputs), text, helpers, metal=False)
    _sources[key] = src
    return src


def chain_source(producer: KernelSource, consumer: KernelSource, links: tuple[tuple[str, str], ...],
                 producer_template: Sequence[tuple[str, int]], consumer_template: Sequence[tuple[str, int]],
                 wait_at: int = 0) -> KernelSource:
    """The one-launch body of producer then consumer. links: (consumer input, producer output)
    pairs, the consumer reading the producer's output for that input; wait_at: the offset in the
    consumer's body where it first needs them (0: at its start)."""
    return chain_sources((producer, consumer), ((), tuple((c, 0, o) for c, o in links)),
                         (producer_template, consumer_template), (0, wait_at))


# counters per chain site, by the id of an array unique to it (a layer's W_o). The array itself is
# not held (that would keep a dropped model's weights alive): an id another array takes later finds
# the same counters, harmless because they are zero between launches and two launches of one
# site never run at once
_counters: dict[tuple[int, str], mx.array] = {}
_COUNTERS_MAX = 4096


def counters(key: mx.array, use: str = "chain", n: int = MIN_INPUT_SIZE) -> mx.array:
    """The n zeroed uint32 counters of the site `key` (an array unique to the site) for `use` (a
    chain's tickets, or a kernel's own counts), made once: a leaf made from host memory, so a
    compiled step's trace holds it as a constant. Every launch leaves its counters zero."""
    at = (id(key), use)
    hit = _counters.get(at)
    if hit is None or hit.size < n:
        if len(_counters) >= _COUNTERS_MAX:
            _counters.pop(next(iter(_counters)))
        hit = _counters[at] = mx.array(np.zeros(max(n, MIN_INPUT_SIZE), np.uint32))
    return hit


_single: dict[tuple, KernelSource] = {}


def chain_all(specs: Sequence[LaunchSpec], links: Sequence[dict[str, tuple[int, int]]], *, key: mx.array,
              waits: Sequence[int] | None = None, use: str = "chain", custom_waits: Sequence[str | None] = (),
              extra: int = 0, keep: Sequence[int] | None = None, regions: bool = False) -> list:
    """Run specs[0], specs[1], ... as one launch, each phase after the one before it; links[i]:
    phase i's input name -> (an earlier phase j, the index of j's output it reads; phase i's spec
    holds a `Pending` there); waits[i]: where phase i's body first reads them (`chain_sources`);
    key, use: the site's counters (`counters`: use tells apart sites that share their key array);
    custom_waits, extra: finer waits and the counters they use (`chain_sources`).
    Returns every phase's outputs, in phase order; with keep (indices into that list) only those,
    the others None: the phases' intermediates then share one buffer (launch's fold); with
    regions, a `Region` of that buffer each in place of None (for a later launch to read)."""
    if not available():
        raise RuntimeError("chain: one-launch chains run on the emulator or MLX's CUDA build only")
    if any(s.fold or s.regions for s in specs):
        raise ValueError("chain: a phase's outputs fold through keep, not its spec")
    waits = tuple(waits) if waits is not None else (0,) * len(specs)
    first = specs[0]
    for s in specs[1:]:
        if s.threads != first.threads:
            raise ValueError(f"chain: {first.src.name} has {first.threads} threads a block, {s.src.name} {s.threads}")
    for s in specs:
        if s.blocks[1:] != (1, 1):
            raise ValueError(f"chain: one row of blocks each (grids {[t.blocks for t in specs]})")
    named = []
    for i, (s, ln) in enumerate(zip(specs, links)):
        names = {n: k for k, n in enumerate(s.src.inputs)}
        for c, (j, o) in ln.items():
            if c not in names or not 0 <= j < i or not 0 <= o < len(specs[j].src.outputs):
                raise ValueError(f"chain: links {ln} name no input of {s.src.name} / output of an earlier phase")
            got = s.inputs[names[c]]
            want = (tuple(specs[j].output_shapes[o]), specs[j].output_dtypes[o])
            if not isinstance(got, Pending) or (tuple(got.shape), got.dtype) != want:
                raise ValueError(f"chain: {s.src.name}'s {c} must be a Pending {want}, got {got!r}")
        named.append(tuple((c, j, specs[j].src.outputs[o]) for c, (j, o) in ln.items()))
    src = chain_sources([s.src for s in specs], named, [s.template for s in specs], waits, custom_waits, extra)
    template, inputs, starts = [], [counters(key, use, len(specs) + 1 + extra)], [0]
    for i, (s, ln) in enumerate(zip(specs, links)):
        template += [(_prefix(i).upper() + k, v) for k, v in s.template]
        inputs += [a for n, a in zip(s.src.inputs, s.inputs) if n not in ln]
        starts.append(starts[-1] + s.blocks[0])
    template += [(f"CHAIN_S{i}", starts[i]) for i in range(1, len(specs))] + [("CHAIN_NTOT", starts[-1])]
    shapes = [sh for s in specs for sh in s.output_shapes]
    kept = set(range(len(shapes)) if keep is None else keep)
    fold = tuple(i for i in range(len(shapes)) if i not in kept)
    return folded_launch(launch, src, inputs, shapes, [d for s in specs for d in s.output_dtypes],
                         blocks=(starts[-1], 1, 1), threads=first.threads, template=template, fold=fold,
                         regions=regions)


def chain(producer: LaunchSpec, consumer: LaunchSpec, links: dict[str, int], *, key: mx.array,
          wait_at: int = 0) -> list[mx.array]:
    """Run producer then consumer as one launch; links: consumer input name -> the index of the
    producer output it reads (the consumer's spec holds a `Pending` there). Returns the producer's
    outputs, then the consumer's."""
    return chain_all((producer, consumer), ({}, {c: (0, i) for c, i in links.items()}), key=key, waits=(0, wait_at))
