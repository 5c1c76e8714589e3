"""How many pages the PLE row cache gets: the `ple_reserve` term of the budget rule.

    arena = available − keep − ple_reserve − dense_unwired        (strata.runtime.budget)

For a model with an n-gram row store the reserve is the row cache itself: `--ple-reserve SIZE`
(`Config.ple_reserve`) when given, else DEFAULT_CACHE_POSITIONS positions' worth of pages. One
position needs at most `rows_per_position` pages (every PLE layer's heads, each in its own page),
plus the one slot a prefetch always leaves free: a reserve below that is refused in one line.
The chosen bytes go to `plan_arena(..., ple_bytes=plan.nbytes)`, so the arena never takes them;
`open_row_cache` opens the cache a config gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.formats.ngram_rows_file import NgramRowsFile
from strata.sizes import fmt_bytes, parse_size
from strata.option_names import option

__all__ = ["DEFAULT_CACHE_POSITIONS", "RowCachePlan", "plan_row_cache", "open_row_cache"]

# The default cache: 64 positions of pages. Hashed n-gram ids repeat only where the text does
# (a name, a phrase, code), so a cache far larger than the read-ahead needs buys few hits; 64
# positions hold a decode window (<= 16) four times over. Unmeasured on real text: the report's
# ple rows hit per token is the number to tune it by.
DEFAULT_CACHE_POSITIONS = 64


@dataclass(frozen=True)
class RowCachePlan:
    pages: int
    page_bytes: int
    reason: str  # one line: where the size came from

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes


def plan_row_cache(config, store: NgramRowsFile, *, rows_per_position: int) -> RowCachePlan:
    """The row cache for `store` under `config.ple_reserve`. rows_per_position: the rows one
    token reads over every PLE layer (n-gram heads x PLE layers)."""
    least = rows_per_position + 1
    page = store.page_bytes
    text = config.ple_reserve or "0"
    reserve = parse_size(text, what="ple_reserve", allow_slots=False).nbytes
    if reserve == 0:
        pages = min(DEFAULT_CACHE_POSITIONS * rows_per_position, store.n_pages) + 1
        pages = max(pages, least)
        return RowCachePlan(pages, page, f"ple_reserve unset: {DEFAULT_CACHE_POSITIONS} positions of "
                                         f"{rows_per_position} rows = {pages} pages ({fmt_bytes(pages * page)})")
    pages = reserve // page
    if pages < least:
        raise ConfigError(f"ple_reserve {text} holds {pages} pages of {page} bytes; one position of this model's "
                          f"PLE layers needs {least} ({fmt_bytes(least * page)}): give "
                          f"{_reserve(math.ceil(least * page / 2**20))} or more")
    return RowCachePlan(pages, page, f"ple_reserve {text}: {pages} pages of {page} bytes")


def open_row_cache(store: NgramRowsFile, config, *, rows_per_position: int, row_ids: "RowIds | None" = None,
                   context_tokens: int | None = None, hook=None, reader: str = "auto", latency=None
                   ) -> tuple["StreamedNgramRows", RowCachePlan]:
    """The row cache a run gets under `config`: `ple_reserve`'s pages (`plan_row_cache`), the
    reader settings of the expert pool (`io_threads`, `direct_io`, `verify_reads`, `io_timeout`).
    Returns the cache and its plan (`plan.nbytes` goes to `arena_plan_for(..., ple_bytes=)`).
    hook, latency: test faults (an IOHook; the advised reader's simulated latency)."""
    from strata.runtime.ngram_rows import StreamedNgramRows

    plan = plan_row_cache(config, store, rows_per_position=rows_per_position)
    rows = StreamedNgramRows(store, capacity=plan.pages, threads=config.io_threads, verify=config.verify_reads,
                             direct=config.direct_io, timeout=config.io_timeout, hook=hook, row_ids=row_ids,
                             context_tokens=context_tokens, reader=reader, latency=latency)
    return rows, plan


def _reserve(mib: int) -> str:
    """ple_reserve has no flag of its own: `--set ple_reserve=...` on the command line."""
    spelled = option("set", f"ple_reserve={mib}MiB")
    return spelled if spelled.startswith("--") else option("ple_reserve", f"{mib}MiB")
