"""A llama.cpp GGUF whose experts mix K / IQ types and ggml's MXFP4 per layer and projection, kept as
stored, run by the MLX engines through the fused ggml expert kernel (kernels/moe_ggml.py) on the
emulated path (and the GPU where MLX has one): `--backend auto` picks MLX where a GPU is present,
and the logits of 8 greedy steps (all resident, and streamed at the smallest legal arena: a slot
of the largest layer's record) agree with the numpy reference within FORWARD. (A file with a type
no kernel reads, BF16 experts, stays on numpy with the note: tests/convert/test_gguf_mixed_types.py.)"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")

import strata  # noqa: E402
import strata.engines as engines  # noqa: E402
from engine_kinds import EXACT0, min_slots, open_kind  # noqa: E402
from mlx_agree import assert_backends_agree  # noqa: E402
from strata.config import Backend  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.engines import open_engine, resolve_backend  # noqa: E402
from strata.mlx_backend.kernels.launch import LAUNCHES, using_path  # noqa: E402
from tests import gguf_models  # noqa: E402
from tests.kernel_paths import KERNEL_PATHS  # noqa: E402

# unsloth-like: Q4_K with a Q5_1 down, an IQ4_NL layer, ggml's MXFP4, Q6_K with Q8_0 (the layers'
# records differ in size: the arena's slot is the largest). The types the test writers quantize to
# (gguf's and tests/ggml_kquants.py's); the others are held to the reference by random blocks
# (test_mlx_ggml_kernels.py).
KERNEL_MIX = (("Q4_K", "Q4_K", "Q5_1"), ("IQ4_NL", "IQ4_NL", "IQ4_NL"), ("MXFP4", "MXFP4", "MXFP4"),
              ("Q6_K", "Q8_0", "Q8_0"))
STEPS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    work = tmp_path_factory.mktemp("ggml_mix")
    hf_dir = gguf_models.build_wide_checkpoint(work / "hf", layers=len(KERNEL_MIX))
    path = gguf_models.write_gguf(hf_dir, work / "mix.gguf", experts=KERNEL_MIX, dense="F16")
    m = strata.load(convert(path, work / "kept").model_path)
    yield m
    m.close()


def _greedy(engine, prompt: list[int]) -> np.ndarray:
    logits = engine.prefill(prompt)
    steps = [logits]
    for _ in range(STEPS):
        logits = engine.decode(int(np.argmax(logits)))
        steps.append(logits)
    return np.stack(steps)


def test_auto_picks_mlx_on_a_gpu_for_experts_every_kernel_reads(model, monkeypatch):
    monkeypatch.setattr(engines, "mlx_gpu_available", lambda: True)
    assert engines.gpu_kernel_refusal(model.experts_file.header) is None
    assert resolve_backend(model, EXACT0) is Backend.MLX
    monkeypatch.setattr(engines, "mlx_gpu_available", lambda: False)
    assert resolve_backend(model, EXACT0) is Backend.NUMPY  # no ops path for these types off a GPU


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("stream", [False, True], ids=["resident", "smallest-arena"])
def test_mlx_engine_on_the_ggml_kernel_agrees_with_the_reference(model, monkeypatch, stream, path):
    prompt = list(model.tokenizer.encode("The quick brown fox"))
    with open_kind(model, "reference") as eng:
        want = _greedy(eng, prompt)
    monkeypatch.setattr(engines, "mlx_gpu_available", lambda: True)
    config = EXACT0.replace(backend=Backend.MLX)
    if stream:
        config = config.replace(arena=f"{min_slots(model, config)}slots")
    before = sum(n for name, n in LAUNCHES.items() if "moe_ggml" in name)
    with using_path(path), open_engine(model, config, stream=stream) as eng:
        got = _greedy(eng, prompt)
    assert sum(n for name, n in LAUNCHES.items() if "moe_ggml" in name) > before  # the kernel ran
    for step, (g, w) in enumerate(zip(got, want)):
        assert_backends_agree(w, g, "FORWARD", what=f"step {step}")
