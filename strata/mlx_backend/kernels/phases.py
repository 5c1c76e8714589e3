"""Two dependent launches as one: a producer's blocks, then a consumer's that read its outputs.

Why: on the H200 (MLX 0.32.4) a decoded token is host-bound: each custom-kernel launch costs the
host ~15 us (MLX's compiled replay and its evaluation: benchmarks/host_cost.py), 242 a token at
the seed shape, against ~10 us of GPU time for most of them. A chain of two launches whose second
reads the first's whole output (the QKV GEMV, then attention with its output projection) needs a
grid-wide dependency, which one launch can hold without a grid barrier:

- each block takes a ticket (an atomic add on a counter) when it starts; tickets below NA run the
  producer's body as its block `ticket`, the rest the consumer's as block `ticket - NA`. Tickets
  are handed out in the order blocks actually start, so a consumer block waits only for blocks
  that have started before it and wait for nothing: no deadlock whatever order or residency the
  hardware gives the grid (the ordering argument of single-pass scans' decoupled look-back);
- a producer block ends with a device fence (every thread) and a count; a consumer block waits (thread 0 spins
  on a volatile read, then a fence and a block barrier) where its body first needs the producer's
  outputs, so what it does before that (loading its own weights) overlaps the producer;
- the last block to finish resets the three counters, so the next launch (the next layer's) finds
  them zero; each chain site has its own counters (`counters`), so no two launches share them.

Bodies run unchanged inside a scope each, with their block index, inputs, outputs and template
values as local aliases (the fused kernel's arguments are prefixed a_ / b_, its template values
A_ / B_). A body may not `return` (the block would skip its count). CUDA and the emulator only:
Metal declares threadgroup memory at kernel scope, not in a body's scope, and does not promise
the forward progress the wait needs (`available`).

On the emulator blocks run one after another in ticket order, so every wait is already met (an
unmet one is an error there, not a hang).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from strata.mlx_backend.kernels.launch import KernelPath, current_path, gpu_dialect, launch
from strata.mlx_backend.kernels.preludes import Dialect
from strata.mlx_backend.kernels.source import MIN_INPUT_SIZE, KernelSource

__all__ = ["Pending", "LaunchSpec", "available", "chain", "chain_source", "counters", "run"]


@dataclass(frozen=True)
class Pending:
    """A producer's output before it exists, where a consumer's wrapper reads its shape and dtype."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


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


def run(spec: LaunchSpec) -> list[mx.array]:
    return launch(spec.src, list(spec.inputs), list(spec.output_shapes), list(spec.output_dtypes),
                  blocks=spec.blocks, threads=spec.threads, template=spec.template)


def available() -> bool:
    """Whether one-launch chains run on the current path: the emulator, or MLX's CUDA build."""
    path = current_path()
    return path is KernelPath.EMULATED or (path is KernelPath.GPU and gpu_dialect() is Dialect.CUDA)


_TICKET = r"""
  SHARED uint32_t chain_ticket;
  uint32_t* const chain_ctr = (uint32_t*)counters;
  if (tid == 0) chain_ticket = atomic_add_u32(chain_ctr, 1u);
  BARRIER();
  const uint32_t chain_vb = chain_ticket;
"""
# every thread fences its own writes before the barrier (not only the counting thread: the
# conservative form of "publish, then count"), so the count is seen only after all of them
_DONE = r"""
  fence_device();
  BARRIER();
  if (tid == 0) atomic_add_u32(chain_ctr + 1, 1u);
"""
_WAIT = r"""
  if (tid == 0) wait_count(chain_ctr + 1, (uint32_t)CHAIN_NA);
  BARRIER();
"""
_RESET = r"""
  if (tid == 0 && atomic_add_u32(chain_ctr + 2, 1u) == (uint32_t)(CHAIN_NTOT - 1)) {
    chain_ctr[0] = 0u;
    chain_ctr[1] = 0u;
    chain_ctr[2] = 0u;
    fence_device();
  }
"""

_sources: dict[tuple, KernelSource] = {}


def _aliases(names: Sequence[str], prefix: str) -> str:
    return "".join(f"    const auto {n} = {prefix}{n};\n" for n in names)


def _consts(template: Sequence[tuple[str, int]], prefix: str) -> str:
    return "".join(f"    constexpr int {k} = {prefix}{k};\n" for k, _ in template)


def chain_source(producer: KernelSource, consumer: KernelSource, links: tuple[tuple[str, str], ...],
                 producer_template: Sequence[tuple[str, int]], consumer_template: Sequence[tuple[str, int]],
                 wait_at: int = 0) -> KernelSource:
    """The one-launch body of producer then consumer. links: (consumer input, producer output)
    pairs, the consumer reading the producer's output for that input; wait_at: the offset in the
    consumer's body where it first needs them (0: at its start)."""
    key = (producer, consumer, links, tuple(k for k, _ in producer_template), tuple(k for k, _ in consumer_template),
           wait_at)
    hit = _sources.get(key)
    if hit is not None:
        return hit
    for src in (producer, consumer):
        if re.search(r"\breturn\b", src.body):
            raise ValueError(f"chain: {src.name}'s body returns (a block would skip its count)")
    linked = dict(links)
    if set(linked) - set(consumer.inputs) or set(linked.values()) - set(producer.outputs):
        raise ValueError(f"chain: links {links} name no input of {consumer.name} / output of {producer.name}")
    free = [n for n in consumer.inputs if n not in linked]
    body = consumer.body
    consumer_body = body[:wait_at] + _WAIT + body[wait_at:]
    text = (_TICKET
            + "  if (chain_vb < (uint32_t)CHAIN_NA) {\n    const uint32_t bx = chain_vb;\n"
            + _aliases(producer.inputs + producer.outputs, "a_") + _consts(producer_template, "A_")
            + "    {\n" + producer.body + "\n    }\n" + _DONE
            + "  } else {\n    const uint32_t bx = chain_vb - (uint32_t)CHAIN_NA;\n"
            + _aliases(free + list(consumer.outputs), "b_")
            + "".join(f"    const auto {c} = a_{p};\n" for c, p in links)
            + _consts(consumer_template, "B_")
            + "    {\n" + consumer_body + "\n    }\n  }\n" + _RESET)
    helpers = producer.helpers if producer.helpers == consumer.helpers else producer.helpers + consumer.helpers
    src = KernelSource(f"strata_chain_{producer.name.removeprefix('strata_')}_{consumer.name.removeprefix('strata_')}",
                       ("counters",) + tuple("a_" + n for n in producer.inputs) + tuple("b_" + n for n in free),
                       tuple("a_" + n for n in producer.outputs) + tuple("b_" + n for n in consumer.outputs),
                       text, helpers, metal=False)
    _sources[key] = src
    return src


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


def chain(producer: LaunchSpec, consumer: LaunchSpec, links: dict[str, int], *, key: mx.array,
          wait_at: int = 0) -> list[mx.array]:
    """Run producer then consumer as one launch; links: consumer input name -> the index of the
    producer output it reads (the consumer's spec holds a `Pending` there). Returns the producer's
    outputs, then the consumer's."""
    if not available():
        raise RuntimeError("chain: one-launch chains run on the emulator or MLX's CUDA build only")
    if producer.threads != consumer.threads:
        raise ValueError(f"chain: {producer.src.name} has {producer.threads} threads a block, "
                         f"{consumer.src.name} {consumer.threads}")
    if producer.blocks[1:] != (1, 1) or consumer.blocks[1:] != (1, 1):
        raise ValueError(f"chain: one row of blocks each (grids {producer.blocks}, {consumer.blocks})")
    if set(links) - set(consumer.src.inputs) or not all(0 <= i < len(producer.src.outputs) for i in links.values()):
        raise ValueError(f"chain: links {links} name no input of {consumer.src.name} / output of {producer.src.name}")
    names = {n: i for i, n in enumerate(consumer.src.inputs)}
    link_names = tuple((c, producer.src.outputs[i]) for c, i in links.items())
    for c, i in links.items():
        got = consumer.inputs[names[c]]
        want = (tuple(producer.output_shapes[i]), producer.output_dtypes[i])
        if not isinstance(got, Pending) or (tuple(got.shape), got.dtype) != want:
            raise ValueError(f"chain: {consumer.src.name}'s {c} must be a Pending {want}, got {got!r}")
    src = chain_source(producer.src, consumer.src, link_names, producer.template, consumer.template, wait_at)
    na, nb = producer.blocks[0], consumer.blocks[0]
    free = [a for n, a in zip(consumer.src.inputs, consumer.inputs) if n not in links]
    template = (tuple(("A_" + k, v) for k, v in producer.template) + tuple(("B_" + k, v) for k, v in consumer.template)
                + (("CHAIN_NA", na), ("CHAIN_NTOT", na + nb)))
    return launch(src, [counters(key)] + list(producer.inputs) + free,
                  list(producer.output_shapes) + list(consumer.output_shapes),
                  list(producer.output_dtypes) + list(consumer.output_dtypes),
                  blocks=(na + nb, 1, 1), threads=producer.threads, template=template)
