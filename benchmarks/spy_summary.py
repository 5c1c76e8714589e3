"""Summarise a py-spy raw profile (`py-spy record --native --format raw`): where the host's
samples go, overall and inside the frames that matter for a decoded token (MLX's evaluation,
the compiled call).

    py-spy record --native --format raw -r 997 -o hc.raw -- python3 benchmarks/host_cost.py --layers 48 --no-env
    python3 benchmarks/spy_summary.py hc.raw [--within async_eval] [--top 40] [--excluding nvrtc]

Each raw line is `frame;frame;...;frame COUNT` (outermost first). Prints, for every sample and
for the samples whose stack holds a frame matching --within (each given one), the functions by
inclusive and by self samples. Samples with a frame matching --excluding are dropped first: by
default MLX's JIT compiles (`get_jit_module`, NVRTC), which in a process that decodes a few
hundred tokens are most of the samples (every kernel's first call) and say nothing about a
token's steady cost.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def _name(frame: str) -> str:
    """A frame's function, without py-spy's (file:line) suffix and C++ argument lists."""
    frame = re.sub(r"\s*\([^()]*:\d+\)$", "", frame.strip())
    return re.sub(r"\(.*\)$", "", frame)[:110]


EXCLUDED = ("get_jit_module", "nvrtc")  # MLX's JIT compile of a kernel's first call


def summarise(lines, within: str | None, top: int, excluding: tuple[str, ...] = EXCLUDED) -> list[str]:
    incl, self_, total = collections.Counter(), collections.Counter(), 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_name(f) for f in stack.split(";")]
        if any(x in f for f in frames for x in excluding):
            continue
        if within is not None:
            at = next((i for i, f in enumerate(frames) if within in f), None)
            if at is None:
                continue
            frames = frames[at:]
        n = int(count)
        total += n
        for f in set(frames):
            incl[f] += n
        self_[frames[-1]] += n
    out = [f"## {'all samples' if within is None else 'within ' + within}: {total}"]
    if not total:
        return out
    out.append("inclusive:")
    out += [f"  {n / total:6.1%}  {f}" for f, n in incl.most_common(top)]
    out.append("self:")
    out += [f"  {n / total:6.1%}  {f}" for f, n in self_.most_common(top)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--within", action="append", help="frames to look inside (default: async_eval, the compiled call)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--excluding", action="append",
                    help="drop samples with a frame containing this (default: " + ", ".join(EXCLUDED) + ")")
    args = ap.parse_args()
    lines = open(args.raw).read().splitlines()
    excluding = tuple(args.excluding) if args.excluding else EXCLUDED
    for within in [None] + (args.within or ["async_eval", "Compiled", "compile"]):
        print("\n".join(summarise(lines, within, args.top, excluding)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
