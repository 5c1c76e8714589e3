"""The analysis kit on hybrid models: `strata trace`, `replay`, `recall` and `quality` on the made
`hybrid` shape (three gated DeltaNet layers, then gated attention; every layer MoE) and on a
hybrid whose first DeltaNet layer has a dense FFN, so MoE indices and model layers differ.

What must hold: the trace holds MoE layers only (their routers, in MoE order); its read-ahead
guess after MoE layer m is MoE layer m+1's router on m's router input, however many DeltaNet
(or dense) layers lie between, which is the runtime's guess: replaying the trace makes the
streaming runtime's cache decisions exactly (λ = 0), and the decode-order closed loop under MoCE
makes its decisions and logits bit for bit; `quality` at λ = 0 is exact.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

import strata
from strata.cli.main import main
from strata.config import Config
from strata.model_config import Ffn, LayerType, Mixer, TensorNames
from strata.testing.engines import open_numpy_streaming
from strata.testing.models import SHAPES, make_model
from strata.tools.closed_loop import LoopConfig
from strata.tools.options import tool_ops
from strata.tools.quality import fast_params, run_decode
from strata.tools.replay import replay
from strata.tools.trace import load_trace, record_trace
from tests.budgets import FLOAT32_REORDER_OF_SCALE

TEXT = "def fib(n): return n if n < 2 else fib(n-1)"
DENSE_FIRST = dict(layer_types=(LayerType(Mixer.DELTANET, Ffn.DENSE),) + SHAPES["hybrid"].layer_types[1:],
                   dense_ffn_size=96)
VARIANTS = {"hybrid": {}, "hybrid_dense_first": DENSE_FIRST}


@pytest.fixture(scope="module", params=list(VARIANTS))
def made(request, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hyb") / request.param, "hybrid", seed=5, n_experts=24,
                      **VARIANTS[request.param])


@pytest.fixture(scope="module")
def model(made):
    m = strata.load(made.model_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tokens(model):
    return model.tokenizer.encode(TEXT)[:24]


@pytest.fixture(scope="module")
def trace_path(made, tmp_path_factory):
    path = tmp_path_factory.mktemp("tr") / "t.npz"
    assert main(["trace", str(made.model_path), TEXT, "-o", str(path), "--max-tokens", "24"]) == 0
    return path


def test_the_trace_holds_moe_layers_only(model, trace_path):
    cfg = model.cfg
    tr = load_trace(trace_path)
    assert any(t.mixer is Mixer.DELTANET for t in cfg.kinds)
    assert tr.n_layers == cfg.n_moe_layers and tr.router_inputs.shape[1] == cfg.n_moe_layers
    for m, layer in enumerate(cfg.moe_layers):
        np.testing.assert_array_equal(tr.routers[m], model.dense[TensorNames.block(layer, TensorNames.router)])
    assert tr.selected.shape == (24, cfg.n_moe_layers, cfg.n_experts_per_token)


def test_the_guess_reaches_across_deltanet_layers(model, trace_path):
    """Row m of guess_logits(1) is MoE layer m+1's router on MoE layer m's router input (model
    layers moe_layers[m] and moe_layers[m+1], DeltaNet mixers between or in them)."""
    cfg, tr = model.cfg, load_trace(trace_path)
    g = tr.guess_logits(1)
    assert g.shape == (24, cfg.n_moe_layers - 1, cfg.n_experts)
    nxt = np.asarray(model.dense[TensorNames.block(cfg.moe_layers[1], TensorNames.router)], np.float32)
    h = tr.router_inputs[:, 0].astype(np.float32)
    # guess_logits goes a row at a time as decoding does; the [T, D] matmul here sums in another
    # order, so each token's row is held to float32 reordering of its scale
    want = h @ nxt.T
    err = np.abs(g[:, 0] - want).max(axis=1) / np.abs(want).max(axis=1)
    assert err.max() <= FLOAT32_REORDER_OF_SCALE, err
    assert cfg.kinds[cfg.moe_layers[1]].mixer is Mixer.DELTANET


def _decisions(stats) -> dict:
    d = asdict(stats)
    d.pop("late_readaheads")  # the one count that depends on I/O timing
    return d


def _runtime(model, tokens, config):
    with open_numpy_streaming(model, config) as engine:
        logits = np.stack([engine.decode(t) for t in tokens])
        return engine.streamer.totals, logits


def _capacity(model, config, extra: int) -> int:
    cfg = model.cfg
    return LoopConfig.from_config(config, 1).cache_config(cfg.n_moe_layers, cfg.n_experts,
                                                          cfg.n_experts_per_token).min_capacity + extra


@pytest.mark.parametrize("extra", [0, 7])
def test_replay_makes_the_runtimes_decisions(model, tokens, extra):
    params = fast_params(model.resident_params())
    trace = record_trace(params, tokens, ops=tool_ops(model, Config()))  # the runtime's products
    config = Config(moce_lambda=0.0)
    cap = _capacity(model, config, extra)
    config = config.replace(arena=f"{cap}slots")
    got, _ = _runtime(model, tokens, config)
    sim = replay(trace, LoopConfig.from_config(config, cap))
    assert got.urgent_misses > 0 and got.reads_ahead > 0  # the read-ahead ran, across DeltaNet layers
    assert _decisions(sim.stats) == _decisions(got)


def test_moce_closed_loop_makes_the_runtimes_decisions_and_logits(model, tokens):
    params = fast_params(model.resident_params())
    config = Config(moce="stock")
    cap = _capacity(model, config, 5)
    config = config.replace(arena=f"{cap}slots")
    got, logits = _runtime(model, tokens, config)
    sim = run_decode(params, tokens, config=LoopConfig.from_config(config, cap), ops=tool_ops(model, config))
    assert sim.changed > 0  # MoCE changed routing: not a λ = 0 comparison in disguise
    assert _decisions(sim.stats) == _decisions(got)
    np.testing.assert_array_equal(sim.logits, logits)


def test_replay_recall_quality_from_the_command_line(made, trace_path, tmp_path, capsys):
    assert main(["replay", str(trace_path), "--caps", "min,50%", "--K", "0,4", "-o", str(tmp_path / "r")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["runs"]) == 4 and all(r["totals"]["urgent_misses"] > 0 for r in doc["runs"])
    assert main(["recall", str(trace_path), "--K", "4,8", "-o", str(tmp_path / "rc.json")]) == 0
    rc = json.loads((tmp_path / "rc.json").read_text())
    assert set(rc["results"][0]["recall"]) == {"4", "8"}
    assert all(0.0 <= v <= 1.0 for r in rc["results"] for v in r["recall"].values())
    assert main(["quality", str(made.model_path), TEXT, "--lambda", "0", "--cap", "min", "--max-tokens", "16",
                 "-o", str(tmp_path / "q.json")]) == 0
    q = json.loads((tmp_path / "q.json").read_text())
    assert q["kld_mean"] == q["kld_max"] == 0.0 and q["relmse"] == 0.0
    capsys.readouterr()
