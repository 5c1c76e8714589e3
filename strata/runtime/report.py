"""The stream report (design §8): one dataclass, one text line, one JSON object.

Counts come from the cache state machine's totals over the decode windows only (the prompt
has its own line); times from the streamer's turn timers. Per-token figures divide by decoded
tokens (= decode windows of one position). `paging` is what the system paged while the engine
ran (major faults, swap in/out; `strata.runtime.memory`), None where the engine did not measure.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from strata.sizes import fmt_bytes
from strata.runtime.memory import PagingDelta

__all__ = ["StreamReport", "build_report"]


@dataclass(frozen=True)
class StreamReport:
    tokens: int  # decoded tokens (decode windows)
    ms_per_token: float
    urgent_misses_per_token: float
    readahead_hits_per_token: float
    reads_per_token: float
    bytes_per_token: float
    hit_rate: float  # (hits + read-ahead hits) / lookups, decode
    host_ms_per_window: float  # the host's turns (lookups, misses, waits), per window
    waiting_ms_per_window: float  # of it, blocked on reads
    late: int  # read-aheads claimed before their read completed (decode)
    after_ms: float  # per window: the split turn's after_layer work, done after compute went on
    misses_by_rank: tuple[float, ...]  # urgent misses per token by selected rank 0..k-1
    arena_slots: int
    arena_bytes: int
    # beyond the the design's list
    policy: str = ""  # the routing policy that ran: "exact (λ = 0 ...)" or "lossy: MoCE J3 λ0.85"
    io: str = ""  # "O_DIRECT reads" or why buffered
    prompt_tokens: int = 0
    prompt_ms: float = 0.0
    prompt_reads: int = 0
    readahead_cancelled_per_token: float = 0.0
    profile: dict[str, float] = field(default_factory=dict)  # ms per token by phase (--profile)
    paging: PagingDelta | None = None  # paged during the run (major faults, swap), when measured
    # PLE n-gram rows (models with a row store; zero for every other model): per decoded token
    ple_rows_read_per_token: float = 0.0  # rows whose page was read for the token
    ple_rows_hit_per_token: float = 0.0  # rows found in the row cache
    ple_bytes_per_token: float = 0.0
    ple_wait_ms_per_token: float = 0.0  # blocked at PLE layers for their pages

    def text(self) -> str:
        ranks = " ".join(f"{m:.2f}" for m in self.misses_by_rank)
        # the split turn's after-layer work: only where a turn was split (0 on a run without one)
        after = f" (+ {self.after_ms:.2f} ms after the layer's compute was issued)" if self.after_ms > 0 else ""
        line = (f"stream: {self.tokens} tokens, {self.ms_per_token:.2f} ms/token; urgent misses "
                f"{self.urgent_misses_per_token:.2f}/token, read-ahead hits {self.readahead_hits_per_token:.2f}/token, "
                f"reads {self.reads_per_token:.2f}/token ({fmt_bytes(self.bytes_per_token)}/token), "
                f"hit rate {100 * self.hit_rate:.2f}%; host {self.host_ms_per_window:.2f} ms per window, of it "
                f"waiting {self.waiting_ms_per_window:.2f}{after}; late read-aheads {self.late} (needed before "
                f"their read finished); urgent misses/token by routing rank (the 1st, 2nd, ... expert chosen) {ranks}; "
                f"arena {self.arena_slots} slots ({fmt_bytes(self.arena_bytes)}); routing {self.policy}; {self.io}")
        if self.prompt_tokens:
            line += f"; prompt {self.prompt_tokens} tokens in {self.prompt_ms:.0f} ms, {self.prompt_reads} reads"
        if self.paging is not None:
            p = self.paging
            line += (f"; paging {p.major_faults} major faults, {p.page_ins} page-ins, swap in "
                     f"{fmt_bytes(p.swap_in_bytes)} / out {fmt_bytes(p.swap_out_bytes)}")
        if self.ple_rows_read_per_token or self.ple_rows_hit_per_token or self.ple_bytes_per_token:
            line += (f"; ple rows read {self.ple_rows_read_per_token:.1f}/token, hit {self.ple_rows_hit_per_token:.1f}/token "
                     f"({fmt_bytes(self.ple_bytes_per_token)}/token), waiting {self.ple_wait_ms_per_token:.2f} ms/token")
        if self.profile:
            line += "; profile ms/token: " + ", ".join(f"{k} {v:.2f}" for k, v in self.profile.items())
        return line

    def to_dict(self) -> dict:
        d = asdict(self)
        d["misses_by_rank"] = list(self.misses_by_rank)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def build_report(*, decode: dict, tokens: int, seconds: float, host_s: float, waiting_s: float,
                 after_s: float, slot_bytes: int, arena_slots: int, io: str, policy: str = "", prompt_tokens: int = 0,
                 prompt_s: float = 0.0, prompt_reads: int = 0, profile: dict[str, float] | None = None,
                 paging: PagingDelta | None = None, ple_rows_read: int = 0, ple_rows_hit: int = 0,
                 ple_bytes: int = 0, ple_wait_s: float = 0.0, read_bytes: float | None = None) -> StreamReport:
    """The report of `tokens` decode windows whose cache counts are `decode` (asdict of a
    `stats_delta`); ple_*: the row cache's totals over the same windows (RowStats.total).
    read_bytes: the bytes one expert read asks for (its store's `read_bytes_per_record`: a GGUF
    read in place reads pages around each slice); None: `slot_bytes`."""
    d, n = decode, tokens
    read_bytes = slot_bytes if read_bytes is None else read_bytes
    per = 1.0 / n if n else 0.0
    lookups = d["lookups"]
    return StreamReport(
        tokens=n, ms_per_token=1e3 * seconds * per,
        urgent_misses_per_token=d["urgent_misses"] * per, readahead_hits_per_token=d["readahead_hits"] * per,
        reads_per_token=d["reads_issued"] * per, bytes_per_token=d["reads_issued"] * read_bytes * per,
        hit_rate=(d["hits"] + d["readahead_hits"]) / lookups if lookups else 0.0,
        host_ms_per_window=1e3 * host_s * per, waiting_ms_per_window=1e3 * waiting_s * per,
        late=d["late_readaheads"], after_ms=1e3 * after_s * per,
        misses_by_rank=tuple(m * per for m in d["urgent_misses_by_rank"]),
        arena_slots=arena_slots, arena_bytes=arena_slots * slot_bytes, io=io, policy=policy,
        prompt_tokens=prompt_tokens, prompt_ms=1e3 * prompt_s, prompt_reads=prompt_reads,
        readahead_cancelled_per_token=d["reads_cancelled"] * per,
        profile={k: 1e3 * v * per for k, v in (profile or {}).items()},
        paging=paging,
        ple_rows_read_per_token=ple_rows_read * per, ple_rows_hit_per_token=ple_rows_hit * per,
        ple_bytes_per_token=ple_bytes * per, ple_wait_ms_per_token=1e3 * ple_wait_s * per,
    )
