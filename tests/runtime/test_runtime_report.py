"""The stream report's text line explains itself: no device words where none ran, and its
late / by-rank figures say what they count."""

from dataclasses import asdict, replace

from strata.cache.types import CacheStats
from strata.runtime.report import build_report


def _report(after_s: float):
    stats = replace(CacheStats(), urgent_misses=6, late_readaheads=2, urgent_misses_by_rank=(1, 2, 3))
    return build_report(decode=asdict(stats), tokens=2, seconds=0.1, host_s=0.01, waiting_s=0.002, after_s=after_s,
                        slot_bytes=4096, arena_slots=10, io="O_DIRECT reads")


def test_the_report_line_explains_late_and_misses_by_rank_and_names_no_device():
    text = _report(after_s=0.0).text()
    assert "GPU" not in text and "after the layer's compute" not in text  # no split turn ran
    assert "late read-aheads 2 (needed before their read finished)" in text
    assert "urgent misses/token by routing rank (the 1st, 2nd, ... expert chosen) 0.50 1.00 1.50" in text
    assert "(+ 1.50 ms after the layer's compute was issued)" in _report(after_s=0.003).text()
