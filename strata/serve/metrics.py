"""The server's counters, rendered as Prometheus text (`GET /metrics`).

Everything here is touched from the event loop only, so there is no lock. Streaming figures
(urgent misses, hit rate, bytes read, I/O wait) come from each request's stream report, which
covers that request's decode windows; a request served all-resident has no report and adds
nothing to them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)  # seconds


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)  # (endpoint, status) -> count
    cancelled: int = 0  # generations stopped because the client went away
    failed: int = 0  # generations the engine failed (a 500, or an error event in a stream)
    prompt_tokens: int = 0
    prompt_reused: int = 0  # prompt tokens served from the session (not prefilled again)
    generation_tokens: int = 0
    generation_seconds: float = 0.0  # first token to last, summed over requests
    queue_seconds: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    last_generation_tps: float = 0.0
    last_prompt_tps: float = 0.0
    stream_tokens: int = 0  # decode tokens covered by stream reports
    urgent_misses: float = 0.0
    readahead_hits: float = 0.0
    reads: float = 0.0
    bytes_read: float = 0.0
    wait_seconds: float = 0.0  # host time blocked on expert reads, decode
    hits_weighted: float = 0.0  # hit rate x tokens, for the token-weighted hit rate

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def record(self, *, prompt_tokens: int, prompt_reused: int, generated: int, ttft_seconds: float,
               generation_seconds: float, queue_seconds: float, prompt_tps: float, generation_tps: float,
               report) -> None:
        """One finished generation; `report` is its StreamReport or None (all-resident)."""
        self.prompt_tokens += prompt_tokens
        self.prompt_reused += prompt_reused
        self.generation_tokens += generated
        self.generation_seconds += generation_seconds
        self.queue_seconds += queue_seconds
        self.ttft.observe(ttft_seconds)
        self.last_prompt_tps, self.last_generation_tps = prompt_tps, generation_tps
        if report is not None and report.tokens:
            n = report.tokens
            self.stream_tokens += n
            self.urgent_misses += report.urgent_misses_per_token * n
            self.readahead_hits += report.readahead_hits_per_token * n
            self.reads += report.reads_per_token * n
            self.bytes_read += report.bytes_per_token * n
            self.wait_seconds += report.waiting_ms_per_window * n / 1e3
            self.hits_weighted += report.hit_rate * n

    def render(self, *, queue_depth: int) -> str:
        rows: list[tuple[str, str, str, list[str]]] = []

        def add(name: str, kind: str, text: str, *samples: str) -> None:
            rows.append((name, kind, text, list(samples) or [f"{name} {_num(0)}"]))

        def one(name: str, kind: str, text: str, value: float) -> None:
            add(name, kind, text, f"{name} {_num(value)}")

        add("strata_requests_total", "counter", "HTTP requests by endpoint and status",
            *(f'strata_requests_total{{endpoint="{e}",status="{s}"}} {c}'
              for (e, s), c in sorted(self.requests.items())))
        one("strata_requests_cancelled_total", "counter", "generations stopped by a client disconnect", self.cancelled)
        one("strata_generation_failures_total", "counter", "generations the engine failed", self.failed)
        one("strata_queue_depth", "gauge", "requests waiting or running", queue_depth)
        one("strata_queue_wait_seconds_total", "counter", "time requests waited behind others", self.queue_seconds)
        one("strata_prompt_tokens_total", "counter", "prompt tokens (cached ones included)", self.prompt_tokens)
        one("strata_prompt_tokens_cached_total", "counter", "prompt tokens reused from the session",
            self.prompt_reused)
        one("strata_generation_tokens_total", "counter", "generated tokens", self.generation_tokens)
        one("strata_generation_seconds_total", "counter", "decode time, first token to last", self.generation_seconds)
        one("strata_generation_tokens_per_second", "gauge", "decode speed of the last request",
            self.last_generation_tps)
        one("strata_prompt_tokens_per_second", "gauge", "prefill speed of the last request", self.last_prompt_tps)
        rows.append(("strata_time_to_first_token_seconds", "histogram", "request arrival to first token",
                     self.ttft.lines("strata_time_to_first_token_seconds")))
        one("strata_stream_tokens_total", "counter", "decode tokens run while streaming experts", self.stream_tokens)
        one("strata_urgent_misses_total", "counter", "expert reads the compute had to wait for", self.urgent_misses)
        one("strata_readahead_hits_total", "counter", "selected experts found as read-aheads", self.readahead_hits)
        one("strata_expert_reads_total", "counter", "expert records read", self.reads)
        one("strata_expert_bytes_read_total", "counter", "bytes of expert records read", self.bytes_read)
        one("strata_io_wait_seconds_total", "counter", "host time blocked on expert reads", self.wait_seconds)
        one("strata_cache_hit_rate", "gauge", "expert-cache hit rate over decode tokens (token-weighted)",
            self.hits_weighted / self.stream_tokens if self.stream_tokens else 0.0)
        out = []
        for name, kind, text, samples in rows:
            out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples]
        return "\n".join(out) + "\n"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
