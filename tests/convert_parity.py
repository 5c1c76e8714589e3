"""What the converter parity tests share (tests/convert/test_convert*.py): the parity text's tokens, the
reference forward's logits on them, the KLD between two logit sets, and the edits the refusal
and layout tests make to a copied checkpoint (its config.json, its tensors as one file)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from strata.convert import convert
from strata.errors import ConfigError
from strata.formats.quant_types import QuantType
from strata.loader import load
from strata.reference.model import ModelState, forward
from strata.reference.sampling import log_softmax
from tests import hf_models


def convert_each(checkpoint: Path, out: Path, expert_types) -> dict:
    """`checkpoint` converted once per expert type, each under out/<type> -> {QuantType: (the
    loaded Model, the ConvertResult)}."""
    models = {}
    for qt in expert_types:
        r = convert(checkpoint, out / qt.name.lower(), expert_type=qt)
        models[qt] = (load(r.model_path), r)
    return models


def parity_tokens(model, expected=None) -> np.ndarray:
    """PARITY_TEXT as strata's tokenizer encodes it [T]; with `expected` (hf_fixtures.Expected),
    checked equal to the tokens transformers' logits are for."""
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    if expected is not None:
        np.testing.assert_array_equal(tokens, expected.tokens)
    return tokens


def greedy_run(engine, prompt: list[int], steps: int = 32) -> tuple[list[int], np.ndarray]:
    """`steps` greedy tokens from an engine after `prompt`, and the logits of every step (the
    prompt's last position first): what two runs on the same weights must give alike."""
    logits = engine.prefill(prompt)
    tokens, seen = [], [logits]
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = engine.decode(tokens[-1])
        seen.append(logits)
    return tokens, np.stack(seen)


def reference_logits(model, tokens: np.ndarray, **kw) -> np.ndarray:
    """The reference forward of a loaded Model over tokens [T] from an empty state -> [T, V]
    (kw: forward's, e.g. select)."""
    return forward(model.resident_params(), ModelState.empty(model.cfg), tokens, **kw)[0]


def mean_kld(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over positions of KL(p || q), in nats, of logits [T, V] (float64 softmax)."""
    lp, lq = log_softmax(p_logits.astype(np.float64)), log_softmax(q_logits.astype(np.float64))
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


def logit_error(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(max |got - ref| / scale, scale = max |ref|) of logits [T, V]: the error the logit budgets bound."""
    scale = float(np.abs(ref).max())
    return float(np.abs(got - ref).max()) / scale, scale


def argmax_agreement(ref: np.ndarray, got: np.ndarray) -> float:
    """The fraction of positions whose argmax token is the same in both logits [T, V]."""
    return float(np.mean(ref.argmax(-1) == got.argmax(-1)))


def with_config(checkpoint: Path, dst: Path, change: Callable[[dict], object]) -> Path:
    """A copy of `checkpoint` at `dst` whose config.json `change` edited in place -> dst."""
    shutil.copytree(checkpoint, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def assert_refused_in_one_line(src: Path, out: Path, message: str) -> None:
    """Converting `src` (f16 experts) raises a ConfigError of one line that says `message`."""
    with pytest.raises(ConfigError) as err:
        convert(src, out, expert_type=QuantType.F16)
    assert message in str(err.value) and "\n" not in str(err.value)


def save_as_one_file(directory: Path, tensors: dict[str, np.ndarray]) -> None:
    """Replace the checkpoint's safetensors files (and index) by one model.safetensors of `tensors`."""
    from safetensors.numpy import save_file

    for f in directory.glob("*.safetensors*"):
        f.unlink()
    save_file({n: np.ascontiguousarray(v) for n, v in tensors.items()}, str(directory / "model.safetensors"))
