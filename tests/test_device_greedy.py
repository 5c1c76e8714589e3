"""Greedy decoding with the next token chosen on the device (strata/device_greedy.py,
strata/mlx_backend/device_pipeline.py) against the host loop, through `stream_generate` on MlxEngine:
the same tokens, log-probabilities within DEVICE_LOGPROB_ATOL, finish reasons, the same session
afterwards (the step queued past the end never committed), prompt reuse as before, and
NonFiniteError at the same position with the same message.

On MLX's CPU build the pipeline's step is `decode_device` uncompiled (the ops path); on a GPU
(the `gpu` tests) the compiled step, traced by the pipeline's first push."""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import strata
from budgets import DEVICE_LOGPROB_ATOL
from strata.device_greedy import PipelinedGreedySteps
from strata.errors import NonFiniteError
from strata.generate import _PlainSteps, _steps
from strata.mlx_backend import device_pipeline
from strata.mlx_backend.engine import MlxEngine
from strata.mlx_backend.device_pipeline import DevicePipeline
from strata.mlx_backend.kernel_plan import KernelPlan, using_plan
from strata.mlx_backend.kernels.launch import KernelPath, gpu_dialect, using_path
from strata.model_config import LayerType, Mixer
from strata.reference.deltanet import DeltaNetState
from strata.reference.sampling import SamplerConfig
from strata.speculative import SpeculativeSteps, SuffixDrafter
from strata.testing.mlx_params import SEED_SHAPE, random_params
from strata.testing.stand_in_model import stand_in_model

# ids 0..255 are bytes, 256 end-of-text (stand_in_model's tokenizer); 257.. decode to nothing
SMALL = replace(SEED_SHAPE, n_layers=2, hidden_size=256, n_experts=16, n_experts_per_token=4, expert_ffn_size=64,
                shared_ffn_size=64, n_heads=4, n_kv_heads=2, head_dim=64, vocab_size=512, max_context=64)
# a hybrid of the same size: DeltaNet, DeltaNet, gated attention with partial rotary (the
# pipeline carries the recurrent states from step to step; each decoded position keeps a snapshot)
SMALL_HYBRID = replace(SMALL, n_layers=3,
                       layer_types=(LayerType(Mixer.DELTANET), LayerType(Mixer.DELTANET), LayerType()),
                       rotary_dim=16, attention_output_gate=True, linear_k_heads=2, linear_v_heads=4,
                       linear_k_head_dim=32, linear_v_head_dim=32, linear_conv_kernel=4)
PROMPT = [7, 3, 11]
TOKENS = 12

PATHS = [pytest.param(KernelPath.OPS, id="ops"),
         pytest.param(KernelPath.GPU, id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
             gpu_dialect() is None, reason="no MLX GPU here")])]


@pytest.fixture(scope="module")
def params():
    return random_params(SMALL, seed=3, pred_q8=False)


def _pipelined(flag: bool, monkeypatch):
    """The kernel plan with greedy decoding pipelined on the device or not (the host loop)."""
    return using_plan(KernelPlan(pipelined=flag))


def _generate(p, path, flag, monkeypatch, *, prompt=PROMPT, eos=frozenset({256}), then=None, **kw):
    """Responses of one stream_generate (and of `then`, a second prompt on the same engine) with
    the pipeline on or off, and the engine after."""
    with using_path(path), _pipelined(flag, monkeypatch), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback from the compiled step
        eng = MlxEngine(p, model=stand_in_model(p.cfg, eos=eos))
        out = [list(strata.stream_generate(eng, prompt, max_tokens=kw.get("max_tokens", TOKENS)))]
        if then is not None:
            out.append(list(strata.stream_generate(eng, then(out[0]), max_tokens=4)))
    return out, eng


def _assert_same_run(host, dev):
    assert [r.token for r in dev] == [r.token for r in host]
    assert [r.finish_reason for r in dev] == [r.finish_reason for r in host]
    assert [r.prompt_reused for r in dev] == [r.prompt_reused for r in host]
    assert [r.text for r in dev] == [r.text for r in host]
    gap = max(abs(a.logprob - b.logprob) for a, b in zip(host, dev))
    assert gap <= DEVICE_LOGPROB_ATOL, f"log-probabilities {gap} apart"


def _assert_same_session(host_eng, dev_eng):
    assert dev_eng.tokens == host_eng.tokens
    assert dev_eng.stats() == host_eng.stats()
    n = host_eng.length
    for a, b in zip(host_eng.state.layers, dev_eng.state.layers):
        assert a.length == b.length == n
        if isinstance(a, DeltaNetState):  # the same snapshots kept: prefix reuse trims alike
            assert a.kept_positions == b.kept_positions
            assert np.array(a.recurrent).tobytes() == np.array(b.recurrent).tobytes()
        else:
            assert np.array(a.keys)[:, :n].tobytes() == np.array(b.keys)[:, :n].tobytes()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", ["attention", "hybrid"])
def test_pipelined_greedy_is_the_host_loop(params, path, shape, monkeypatch):
    p = params if shape == "attention" else random_params(SMALL_HYBRID, seed=9, pred_q8=False)
    (host,), host_eng = _generate(p, path, False, monkeypatch)
    (dev,), dev_eng = _generate(p, path, True, monkeypatch)
    assert len(dev) == TOKENS and dev[-1].finish_reason == "length"
    _assert_same_run(host, dev)
    _assert_same_session(host_eng, dev_eng)
    assert dev_eng.length == len(PROMPT) + TOKENS - 1  # the last token is not decoded


def test_the_next_step_is_queued_before_a_token_is_read(params, monkeypatch):
    """What removes the host wait: when the host reads token n (step n - 1's selection), step n
    is already enqueued on the device token, for every n but the last (no step past max_tokens)."""
    pushed, at_read = [0], []
    select, read = device_pipeline.greedy_select, device_pipeline.read_selection

    def counting_select(logits):
        pushed[0] += 1
        return select(logits)

    def recording_read(packed):
        at_read.append(pushed[0])
        return read(packed)

    monkeypatch.setattr(device_pipeline, "greedy_select", counting_select)
    monkeypatch.setattr(device_pipeline, "read_selection", recording_read)
    (dev,), _ = _generate(params, KernelPath.OPS, True, monkeypatch, max_tokens=8)
    assert len(dev) == 8
    assert at_read == [n + 1 for n in range(1, 7)] + [7]  # token n read with steps 0..n pushed; 7: the last


@pytest.mark.parametrize("path", PATHS)
def test_end_of_text_drops_the_step_queued_past_it(params, path, monkeypatch):
    """The token at index 4 made end-of-text: the pipeline had queued its decode, which must
    leave no trace; a following prompt extending the session reuses it as the host's does."""
    (free,), _ = _generate(params, path, False, monkeypatch)
    stop = free[4].token
    assert stop not in [r.token for r in free[:4]] and stop not in PROMPT
    follow = lambda first: PROMPT + [r.token for r in first] + [5, 9]  # noqa: E731
    host, host_eng = _generate(params, path, False, monkeypatch, eos={stop}, then=follow)
    dev, dev_eng = _generate(params, path, True, monkeypatch, eos={stop}, then=follow)
    assert host[0][-1].finish_reason == "stop" and len(host[0]) == 5
    for h, d in zip(host, dev):
        _assert_same_run(h, d)
    assert dev[1][0].prompt_reused == len(PROMPT) + 4  # every position the first call held
    _assert_same_session(host_eng, dev_eng)


@pytest.mark.parametrize("path", PATHS)
def test_a_caller_that_stops_early_leaves_the_hosts_session(params, path, monkeypatch):
    """A caller that stops reading after token 4 (a stop string, a closed connection): the
    session holds what the host loop's would, token 4's decode included, the step queued after
    it not; the next call reuses it alike."""
    sessions, follow = [], []
    for flag in (False, True):
        with using_path(path), _pipelined(flag, monkeypatch):
            eng = MlxEngine(params, model=stand_in_model(params.cfg))
            stream = strata.stream_generate(eng, PROMPT, max_tokens=TOKENS)
            first = [next(stream) for _ in range(5)]
            stream.close()
            sessions.append((eng.tokens, eng.stats()))
            follow.append(list(strata.stream_generate(eng, PROMPT + [r.token for r in first] + [5], max_tokens=4)))
    assert sessions[0] == sessions[1] and sessions[0][1].length == len(PROMPT) + 5
    _assert_same_run(*follow)
    assert follow[1][0].prompt_reused == len(PROMPT) + 5


@pytest.mark.parametrize("path", PATHS)
def test_the_context_limit_ends_both_alike(params, path, monkeypatch):
    """No step is queued past the context: both end with "context" at the same token."""
    prompt = [int(t) % 256 for t in range(SMALL.max_context - 4)]
    (host,), host_eng = _generate(params, path, False, monkeypatch, prompt=prompt, max_tokens=40)
    (dev,), dev_eng = _generate(params, path, True, monkeypatch, prompt=prompt, max_tokens=40)
    assert host[-1].finish_reason == "context"
    _assert_same_run(host, dev)
    _assert_same_session(host_eng, dev_eng)


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_logits_raise_at_the_same_position(params, path, monkeypatch):
    """The logits of the decode at position P (token index 2's) made NaN, in the host loop's
    `decode` and in the pipeline's step (on the device, before its selection): both raise
    NonFiniteError after the same tokens, with the same message and the same session. (Made NaN
    after the layers: NaN router logits would send the GPU's expert kernels to undefined slots.)"""
    at = len(PROMPT) + 2
    (free,), _ = _generate(params, path, False, monkeypatch)
    errors, engines, seen = [], [], []
    for flag in (False, True):
        with using_path(path), _pipelined(flag, monkeypatch), monkeypatch.context() as m:
            eng = MlxEngine(params, model=stand_in_model(params.cfg))
            host_decode, device_step = eng._decode, DevicePipeline._decode_step

            def nan_on_host(token, eng=eng, host_decode=host_decode):  # eng.length: the token's position
                return host_decode(token) * (np.nan if eng.length == at else 1.0)

            def nan_on_device(self, state, token, device_step=device_step):
                logits, new, compiled = device_step(self, state, token)
                return logits * (np.nan if state.length == at else 1.0), new, compiled

            m.setattr(eng, "_decode", nan_on_host)
            m.setattr(DevicePipeline, "_decode_step", nan_on_device)
            got = []
            with pytest.raises(NonFiniteError) as caught:
                for r in strata.stream_generate(eng, PROMPT, max_tokens=TOKENS):
                    got.append(r.token)
        errors.append(str(caught.value))
        engines.append(eng)
        seen.append(got)
    assert seen[0] == seen[1] == [r.token for r in free[:3]]
    assert errors[0] == errors[1] and f"after {at + 1} positions" in errors[0]
    assert engines[0].tokens == engines[1].tokens and engines[0].stats() == engines[1].stats()


def test_only_plain_greedy_takes_the_pipeline(params, monkeypatch):
    """Sampling, a repetition penalty and a drafter keep their host sources; so does an engine
    that offers no pipeline (the plan's pipelined off)."""
    with using_path(KernelPath.OPS):
        # SpeculativeSteps reads the slot size of the model's experts file
        model = SimpleNamespace(**vars(stand_in_model(params.cfg)),
                                experts_file=SimpleNamespace(header=SimpleNamespace(padded_bytes=1)))
        eng = MlxEngine(params, model=model)
        logits = eng.prefill(PROMPT)

        def pick(sampler, drafter=None):
            return _steps(eng, logits, sampler, drafter, SMALL.max_context, list(PROMPT))

        assert isinstance(pick(SamplerConfig()), PipelinedGreedySteps)
        assert isinstance(pick(SamplerConfig(temperature=0.7)), _PlainSteps)
        assert isinstance(pick(SamplerConfig(repeat_penalty=1.2)), _PlainSteps)
        assert isinstance(pick(SamplerConfig(), SuffixDrafter(2)), SpeculativeSteps)
        with _pipelined(False, monkeypatch):
            assert isinstance(pick(SamplerConfig()), _PlainSteps)
