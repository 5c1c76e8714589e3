"""strata/mlx_backend/compute.py over hyper-connection streams (Qwen4-Exp): the read-ahead guess
comes to the host with the router logits (one sync per layer), and it is the guess a separate
computation would give."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import strata  # noqa: E402
from engine_kinds import min_slots  # noqa: E402
from strata.config import Backend, Config  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.mlx_backend.compute import MlxCompute  # noqa: E402
from strata.mlx_backend.kernels.launch import gpu_dialect  # noqa: E402
from strata.testing.models import make_model  # noqa: E402

MLX = Config(backend=Backend.MLX, moce_lambda=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("q4g") / "qwen4", "qwen4", seed=3, expert_type=QuantType.Q2_0)
    m = strata.load(made.model_path)
    yield m
    m.close()


class _Spy:
    """Wraps a MlxCompute's guess paths: counts the guess computations `guess_logits` makes
    itself (each one a second sync) and keeps what it returned."""

    def __init__(self, compute: MlxCompute) -> None:
        self.compute, self.in_guess, self.returned = compute, 0, []
        inner_guess, inner_device = compute.guess_logits, compute._guess_device
        self.inside = False

        def device(layer, h):
            self.in_guess += self.inside
            return inner_device(layer, h)

        def guess(layer, h):
            self.inside = True
            try:
                g = inner_guess(layer, h)
            finally:
                self.inside = False
            self.returned.append((layer, h.h, g))
            return g

        compute._guess_device, compute.guess_logits = device, guess


@pytest.mark.parametrize("prompt", [1, 12], ids=["decode", "prompt"])
def test_the_guess_needs_no_second_sync_and_is_the_separate_computations(model, prompt):
    _guesses_come_with_z(model, prompt)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_dialect() is None, reason="no MLX GPU here")
def test_the_guess_comes_with_z_on_the_gpu(model):
    assert mx.default_device() == mx.gpu
    _guesses_come_with_z(model, 4)


def _guesses_come_with_z(model, prompt: int) -> None:
    tokens = np.arange(40, 40 + prompt + 3)
    with strata.open_engine(model, MLX.replace(arena=f"{min_slots(model, MLX)}slots"), stream=True) as engine:
        spy = _Spy(engine.compute)
        engine.prefill(tokens[:prompt])
        for t in tokens[prompt:]:
            engine.decode(int(t))
        assert spy.returned, "the engine asked for no guesses (read-ahead off?)"
        assert spy.in_guess == 0  # every guess came over with its layer's z
        assert any(h.shape[0] == prompt for _, h, _ in spy.returned)  # the prompt's guesses are [T, E]
        for layer, h, got in spy.returned:
            holder = type("H", (), {"h": h})()
            want = np.array(engine.compute._guess_device(layer, holder), dtype=np.float32)
            assert got.shape == (h.shape[0], model.cfg.n_experts)
            np.testing.assert_array_equal(got, want)


def test_prefetch2_guesses_the_layer_after_next_apart(model):
    config = MLX.replace(arena=f"{min_slots(model, MLX.replace(prefetch2=True))}slots", prefetch2=True)
    with strata.open_engine(model, config, stream=True) as engine:
        spy = _Spy(engine.compute)
        engine.prefill(np.arange(40, 44))
        engine.decode(50)
        moe = model.cfg.moe_layers
        # m+1 from the lookup, m+2 computed apart (one per layer that has a layer after next)
        assert spy.in_guess == 2 * max(len(moe) - 2, 0)
