"""PLE rows through the real engines (`strata.open_engine`) on the made Qwen4-Exp model: the
tables in the row store `<name>.ngrams` (make_model(ple_rows=)) against the same model with its
tables among the dense weights.

- the numpy streaming engine's logits with streamed rows equal those with resident rows, bit for
  bit (prompt, decode, a decode window, after a trim; prompts holding the EOS token); the all-
  resident engine too, with the tables read whole where they fit and streamed where they do not;
- the stream report counts the PLE rows read / hit per token, their bytes and the wait;
- the PLE wait is counted at each PLE layer under an injected read latency: zero where the
  latency is shorter than the layers before the PLE layer;
- peak RSS with a row store many times the row cache stays within the cache and some slack.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import strata
from strata.config import Backend, Config
from strata.engines import open_engine
from strata.formats.quant_types import QuantType
from strata.runtime import ngram_source
from strata.runtime.advised_reader import advice_available
from strata.runtime.ngram_source import rows_per_position
from strata.testing.faults import FixedDelay
from strata.testing.models import SHAPES, make_model
from tests.budgets import PLE_RSS_SLACK, PLE_WAIT_SLACK_S

EOS = SHAPES["qwen4"].qwen4.ngram_eos_token
BIG = dict(ngram_vocab_base=5003)  # tables of ~20k rows (160 pages a layer): a token reads pages
PROMPT = [5, 6, 7, EOS, 8, 9, 10, 11, EOS, 12, 13, 14]
DECODE = [3, EOS, 4, 5, 6]
CONFIG = Config(moce_lambda=0.0, backend=Backend.NUMPY, arena="40slots", ple_reserve="40KiB", prefill_chunk=8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen4_ple")
    dense = make_model(d / "dense", "qwen4", seed=2, **BIG)
    stored = make_model(d / "stored", "qwen4", seed=2, ple_rows=QuantType.F32, **BIG)
    with strata.load(dense.model_path) as a, strata.load(stored.model_path) as b:
        yield a, b


def _run(engine) -> np.ndarray:
    out = [engine.prefill(PROMPT)] + [engine.decode(t) for t in DECODE]
    out += list(engine.decode_window([7, EOS, 8]))
    engine.trim(engine.kept_position(len(PROMPT) + 2))
    out += [engine.decode(t) for t in (9, 10)]
    return np.stack(out)


def test_streamed_rows_are_bit_identical_to_resident_rows(pair):
    dense, stored = pair
    with open_engine(dense, CONFIG, stream=True) as a:
        want = _run(a)
        assert a.ngram_rows is None  # the tables are in the model file: resident
    with open_engine(stored, CONFIG, stream=True) as b:
        got = _run(b)
        rep = b.report()
        assert b.ngram_rows is not None and b.ngram_rows.capacity == 10  # 40 KiB of 4 KiB pages
    np.testing.assert_array_equal(got, want)
    assert rep.ple_rows_read_per_token + rep.ple_rows_hit_per_token == rows_per_position(stored.cfg)
    assert rep.ple_rows_read_per_token > 0 and rep.ple_bytes_per_token > 0
    assert "ple rows read" in rep.text()


def test_the_resident_engine_reads_tables_whole_only_where_they_fit(pair, monkeypatch):
    dense, stored = pair
    plain = Config(moce_lambda=0.0, backend=Backend.NUMPY)
    with open_engine(dense, plain) as a:
        want = _run(a)
    # the budget rule reads this machine's free memory: pin both outcomes, so the test does not
    # depend on what else runs here
    monkeypatch.setattr(ngram_source, "resident_room", lambda model, config: 1 << 40)  # they fit
    with open_engine(stored, plain) as b:  # read whole, no row cache
        assert b.kind == "reference" and b._row_cache is None
        np.testing.assert_array_equal(_run(b), want)
    monkeypatch.setattr(ngram_source, "resident_room", lambda model, config: 0)  # they do not fit
    with open_engine(stored, plain) as c:
        assert c._row_cache is not None and c.params.rows is c._row_cache
        np.testing.assert_array_equal(_run(c), want)
        stats = c._row_cache.stats()
        assert stats.total.rows_read > 0
        assert stats.positions == len(PROMPT) + len(DECODE) + 3 + 2  # every call read its tokens' rows ahead


LAYER_S = 0.1  # each layer's compute, made long beside the scheduler's jitter (as test_runtime_ngram_rows)


@pytest.mark.skipif(not advice_available(), reason="the simulated latency is the advised reader's")
@pytest.mark.parametrize("delay_s", [0.6 * LAYER_S, 4 * LAYER_S])
def test_ple_wait_at_each_ple_layer_under_read_delays(tmp_path, delay_s):
    """PLE on layers 1 and 2; every row read takes `delay_s` from its request (before layer 0).
    Layer 0 computes LAYER_S before PLE layer 1 needs its rows: a shorter delay is hidden at both
    PLE layers; a longer one is waited at PLE layer 1 less that layer, and not at PLE layer 2."""
    made = make_model(tmp_path / "m", "qwen4", seed=3, ple_rows=QuantType.F32, ple_layer_ids="1,2",
                      ngram_vocab_base=50021)
    delay = FixedDelay(1e3 * delay_s)
    with strata.load(made.model_path) as model, \
            open_engine(model, CONFIG.replace(ple_reserve="4MiB"), stream=True, ple_latency=delay.latency_s) as e:
        mixer = e.compute.mixer

        def slow_mixer(layer, x, **kw):
            out = mixer(layer, x, **kw)
            time.sleep(LAYER_S)  # after the layer's own rows: compute the next PLE layer's reads hide behind
            return out

        e.compute.mixer = slow_mixer
        e.prefill([1, 2])
        waits = []
        for t in (40, 80, 120):  # new n-grams: every PLE layer reads
            e.decode(t)
            window = e.ngram_rows.last_window()
            assert all(c.rows_read > 0 for c in window.values()), window
            waits.append({i: c.wait_s for i, c in window.items()})
    unhidden = max(0.0, delay_s - LAYER_S)
    for w in waits:
        assert unhidden - PLE_WAIT_SLACK_S <= w[0] <= unhidden + PLE_WAIT_SLACK_S, (w, unhidden)
        assert w[1] <= PLE_WAIT_SLACK_S, w


RSS_SCRIPT = """
import sys
import numpy as np
import strata
from strata.config import Backend, Config
from strata.engines import open_engine

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

model = strata.load(sys.argv[1])
config = Config(moce_lambda=0.0, backend=Backend.NUMPY, arena="40slots", ple_reserve=sys.argv[2])
with open_engine(model, config, stream=True) as e:  # warm: imports, the arena, numpy's buffers
    e.prefill([1, 2, 3])
with open(f"/proc/self/clear_refs", "w") as f:
    f.write("5")
start = status("VmRSS")
with open_engine(model, config, stream=True) as e:
    e.prefill(list(range(10, 60)))
    for t in range(60, 160):
        e.decode(t)
    read = e.ngram_rows.stats().total.bytes_read
print(start, status("VmHWM"), read)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's VmHWM reset")
def test_peak_rss_stays_within_the_row_cache_with_a_store_many_times_larger(tmp_path):
    made = make_model(tmp_path / "m", "qwen4", seed=4, ple_rows=QuantType.F32, ple_embed_dim=128,
                      ngram_vocab_base=200003)  # 2 tables of ~800k rows x 32 float32: ~200 MB
    store_bytes = os.path.getsize(made.model_path.with_suffix(".ngrams"))
    reserve = 2 << 20
    assert store_bytes > 50 * reserve
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(made.model_path), "2MiB"], env=env, check=True,
                         capture_output=True, text=True, timeout=600).stdout.split()
    start, peak, read = map(int, out)
    assert read > 2 * reserve  # the cache refilled: rows went through it twice over (150 tokens x 8 pages)
    assert peak - start <= reserve + PLE_RSS_SLACK, (peak - start) / 2**20
