"""GET /metrics: Prometheus text whose counts move with the requests served."""

import re

from serve_support import NAME, model_fixture
from starlette.testclient import TestClient

import strata
from strata.serve import build_app

model = model_fixture()

SAMPLE = re.compile(r'^([a-z_]+)(\{[^}]*\})? (-?[0-9.e+-]+)$')


def parse(text: str) -> dict[str, float]:
    """Every sample line as name{labels} -> value; every line is a comment or a valid sample."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-z_]+ ", line), line
            continue
        m = SAMPLE.match(line)
        assert m, line
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def test_metrics_count_requests_tokens_and_streaming(model):
    config = strata.Config(backend="numpy", arena="20slots", prefetch=4)  # stream experts: a report per request
    with TestClient(build_app(model, config)) as c:
        before = parse(c.get("/metrics").text)
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 7, "temperature": 0})
        report = r.json()["strata"]["report"]
        assert report is not None and report["tokens"] > 0
        c.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": -1})
        after = parse(c.get("/metrics").text)
    ok = 'strata_requests_total{endpoint="/v1/completions",status="200"}'
    bad = 'strata_requests_total{endpoint="/v1/completions",status="400"}'
    assert after[ok] - before.get(ok, 0) == 1 and after[bad] - before.get(bad, 0) == 1
    assert after["strata_generation_tokens_total"] - before["strata_generation_tokens_total"] == 7
    assert after["strata_prompt_tokens_total"] - before["strata_prompt_tokens_total"] == 5
    assert after["strata_time_to_first_token_seconds_count"] == before["strata_time_to_first_token_seconds_count"] + 1
    assert after["strata_generation_tokens_per_second"] > 0
    assert after["strata_stream_tokens_total"] == report["tokens"]
    assert after["strata_expert_bytes_read_total"] > 0
    assert abs(after["strata_urgent_misses_total"] - report["urgent_misses_per_token"] * report["tokens"]) < 1e-3
    assert 0 < after["strata_cache_hit_rate"] <= 1
    assert after["strata_queue_depth"] == 0
