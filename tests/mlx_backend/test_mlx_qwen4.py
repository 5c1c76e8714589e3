"""The MLX forward of Qwen4-Exp (mlx_backend/model.py under the hyper-connection residual,
residual.py) against the reference forward on the made shape `qwen4`, within FORWARD: a prompt
holding the PLE's EOS token, decoded positions past the QSA budget, a decode window and a trim at
a kept position; all-resident (MlxEngine) and streaming at the smallest legal arena (MlxCompute). Runs
on MLX's default device (the CPU build here; marked `gpu` where a GPU must run it)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import strata  # noqa: E402
from mlx_agree import assert_backends_agree  # noqa: E402
from strata.config import Backend, Config  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend.engine import MlxEngine  # noqa: E402
from strata.mlx_backend.kernels.launch import gpu_dialect  # noqa: E402
from strata.reference.model import ModelState, forward  # noqa: E402
from strata.testing.models import make_model  # noqa: E402
from engine_kinds import min_slots  # noqa: E402

MLX = Config(backend=Backend.MLX, moce_lambda=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Q2_0 experts: a type MLX's expert kernels read (on the GPU they compute them)
    made = make_model(tmp_path_factory.mktemp("q4m") / "qwen4", "qwen4", seed=7, expert_type=QuantType.Q2_0)
    m = strata.load(made.model_path)
    yield m
    m.close()


def _tokens(model) -> np.ndarray:
    eos = model.cfg.qwen4.ngram_eos_token
    return np.asarray(list(b"def fib(n):") + [eos] + list(b" return fib(n - 1) + fib(n - 2)"))


def _agrees(model, stream: bool = False):
    tokens = _tokens(model)
    whole, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    config = MLX.replace(arena=f"{min_slots(model, MLX)}slots") if stream else MLX
    with strata.open_engine(model, config, stream=stream) as engine:
        assert isinstance(engine, MlxEngine) != stream
        got = [engine.prefill(tokens[:10])] + [engine.decode(int(t)) for t in tokens[10:30]]
        window = engine.decode_window(tokens[30:])
        assert_backends_agree(whole[9:30], np.stack(got), "FORWARD", what="prefill + decode")
        assert_backends_agree(whole[30:], window, "FORWARD", what="window")
        keep = 33
        assert engine.kept_position(keep) == keep
        engine.trim(keep)
        assert_backends_agree(whole[keep], engine.decode(int(tokens[keep])), "FORWARD", what="after trim")


def test_mlx_twin_agrees_with_the_reference(model):
    _agrees(model)


def test_mlx_streaming_at_the_smallest_arena_agrees_with_the_reference(model):
    _agrees(model, stream=True)


def test_mlx_twin_agrees_with_the_sigmoid_output_gate(tmp_path):
    """The released checkpoint's DeltaNet gate (sigmoid(z), `deltanet_sigmoid_gate`), with the hash
    constants stored as a llama.cpp GGUF holds them (the derived ones, the seeds cleared)."""
    from strata.families.qwen4_exp import StoredHashConstants, hash_constant_fields, stored_hash_constants
    from strata.reference.ngram_hash import NgramHash
    from strata.testing.models import SHAPES

    hashes = [NgramHash.of(SHAPES["qwen4"], i) for i in range(2)]
    stored = hash_constant_fields([StoredHashConstants(h.multipliers, h.head_sizes, h.head_offsets) for h in hashes])
    made = make_model(tmp_path / "qwen4", "qwen4", seed=7, expert_type=QuantType.Q2_0, deltanet_sigmoid_gate=True,
                      ngram_seed=0, ngram_vocab_base=0, **stored)
    with strata.load(made.model_path) as m:
        assert m.cfg.qwen4.deltanet_sigmoid_gate and stored_hash_constants(m.cfg, 1) is not None
        _agrees(m)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streaming"])
def test_mlx_twin_agrees_on_the_gpu(model, stream):
    assert mx.default_device() == mx.gpu
    _agrees(model, stream)


# ---------------------------------------------------------------- the pieces, each against its reference


@pytest.fixture(scope="module")
def pieces(model):
    from strata.mlx_backend.model import to_mlx_params

    params = model.resident_params()
    return params, to_mlx_params(model.cfg, params.dense, experts=params.experts)


def _streams(cfg, t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((t, cfg.qwen4.hc_count * cfg.hidden_size)).astype(np.float32)


def test_hyper_connection_read_and_write_agree(model, pieces):
    from strata.mlx_backend import residual as mhm
    from strata.reference import hyper_connections as rhc

    ref_p, mlx_p = pieces
    cfg, streams = model.cfg, _streams(model.cfg, 7, 1)
    want_in, want_inj = rhc.hc_read(cfg, ref_p.dense, "blk.1.hc_ffn", streams)
    got_in, got_inj = mhm.hc_read(cfg, mlx_p.layers[1].hyper.hc_ffn, mx.array(streams))
    assert_backends_agree(want_in, got_in, "FAST", what="hc_read input")
    assert_backends_agree(want_inj, got_inj, "FAST", what="hc_read inject")
    out = np.random.default_rng(2).standard_normal((7, cfg.hidden_size)).astype(np.float32)
    assert_backends_agree(rhc.hc_write(streams, want_inj, out),
                          mhm.hc_write(mx.array(streams), mx.array(want_inj), mx.array(out)), "FAST", what="hc_write")


def test_ple_agrees_over_calls(model, pieces):
    """Two calls (the second reads the first's context and conv state), EOS in the first."""
    from strata.mlx_backend import ple as mple
    from strata.reference import ple as rple
    from strata.reference.ple import resident_rows

    ref_p, mlx_p = pieces
    cfg, layer = model.cfg, 2
    rows = resident_rows(cfg, ref_p.dense)
    tokens = _tokens(model)[:12]
    want_state, got_state = rple.PleState.empty(cfg, 1), mple.empty_ple_state(cfg, layer)
    for part, seed in ((slice(0, 9), 3), (slice(9, 12), 4)):
        s = _streams(cfg, part.stop - part.start, seed)
        want, want_state = rple.ple(cfg, ref_p.dense, layer, rows, want_state, s, tokens[part])
        got, got_state = mple.ple(cfg, mlx_p.layers[layer].hyper.ple, layer, rows, got_state, mx.array(s), tokens[part])
        assert_backends_agree(want, got, "FAST", what=f"ple {part}")
    np.testing.assert_array_equal(got_state.context, want_state.context)
    assert_backends_agree(want_state.conv, got_state.conv, "FAST", what="ple conv state")


def test_indexed_attention_agrees_past_the_budget(model, pieces):
    from strata.mlx_backend import indexed_attention as mia
    from strata.reference import indexed_attention as ria

    ref_p, mlx_p = pieces
    cfg, layer = model.cfg, 3
    x = np.random.default_rng(5).standard_normal((40, cfg.hidden_size)).astype(np.float32)
    want, want_state = ria.indexed_attention(cfg, ref_p.dense, layer, ria.IndexedKV.empty(cfg), x[:30])
    got, got_state = mia.indexed_attention(cfg, mlx_p.layers[layer].attn, mia.empty_indexed_state(cfg),
                                           mx.array(x[:30]))
    assert_backends_agree(want, got, "FAST", what="prompt")
    for t in range(30, 40):  # decoded positions: 8 blocks and more, the budget takes 2
        want, want_state = ria.indexed_attention(cfg, ref_p.dense, layer, want_state, x[t:t + 1])
        got, got_state = mia.indexed_attention(cfg, mlx_p.layers[layer].attn, got_state, mx.array(x[t:t + 1]))
        assert_backends_agree(want, got, "FAST", what=f"decode {t}")


def test_device_and_host_routing_agree(model, pieces):
    from strata.mlx_backend.model import MlxModelState, forward as mlx_forward
    from strata.reference.ple import resident_rows
    from strata.reference.routing import route

    ref_p, mlx_p = pieces
    rows, tokens = resident_rows(model.cfg, ref_p.dense), _tokens(model)
    rules = [mlx_p.layers[l].rule for l in model.cfg.moe_layers]
    on_device, _ = mlx_forward(mlx_p, MlxModelState.empty(model.cfg), tokens, rows=rows)
    on_host, _ = mlx_forward(mlx_p, MlxModelState.empty(model.cfg), tokens, rows=rows,
                             select=lambda m, z: route(z, rules[m]))  # the reference's rule on the host
    assert_backends_agree(on_host, on_device, "FAST", what="device vs host routing")
