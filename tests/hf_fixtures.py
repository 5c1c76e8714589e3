"""The checked-in tiny Hugging Face checkpoints and what transformers computes on them (no torch).

tests/fixtures/hf/<arch>/ holds a checkpoint exactly as transformers' `save_pretrained` wrote
it (tests/hf_models.py, tests/hf_hybrid.py, tests/hf_gpt_oss.py, tests/hf_qwen4.py, tests/hf_qwen4_random.py and tests/hf_qwen4_released.py build and train them; gpt-oss's
MXFP4 form has its experts rewritten as the released blocks), its tokenizer files, and
expected.npz: transformers' float32 outputs on it. tests/fixtures/gguf/<case>.npz holds
transformers' logits on the dequantized weights of each llama.cpp GGUF that tests/gguf_models.py
writes. `python scripts/make_hf_fixtures.py [ARCH ...]` (needs torch) regenerates them;
docs/testing.md says when.

expected.npz (T = the parity text's tokens, V = the model's vocabulary):
    tokens  [T] int32    PARITY_TEXT as the checkpoint's tokenizer encodes it
    logits  [T, V] f32   teacher-forced logits of transformers' float32 forward on `tokens`
    prompt  [PROMPT_TOKENS] int32, greedy [GREEDY_STEPS] int32: transformers'
                         generate(prompt, do_sample=False, eos_token_id=eos_ids)
    eos_ids [n] int32    the ids that stop generation (strata's tokenizer's, sorted)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests import hf_deepseek_yarn, hf_gpt_oss, hf_hybrid, hf_models, hf_qwen4, hf_qwen4_random, hf_qwen4_released

ROOT = Path(__file__).resolve().parent / "fixtures"
HF_ROOT = ROOT / "hf"
GGUF_ROOT = ROOT / "gguf"
EXPECTED = "expected.npz"
GREEDY_STEPS = 32
PROMPT_TOKENS = 8

# the modules that build checkpoints: each has ARCHS and build_checkpoint(arch, directory) -> the
# model as transformers loads it back. A family in one of them gets its fixture by being in its
# ARCHS; a family with a builder module of its own adds that module here (one line).
FAMILIES = (hf_models, hf_hybrid, hf_gpt_oss, hf_qwen4, hf_deepseek_yarn, hf_qwen4_random, hf_qwen4_released)


def fixture_archs() -> tuple[str, ...]:
    return tuple(a for family in FAMILIES for a in family.ARCHS)


def family_of(arch: str):
    """The builder module whose ARCHS has `arch`."""
    return next(f for f in FAMILIES if arch in f.ARCHS)


class MissingFixture(LookupError):
    pass


def _regen_hint(what: str) -> str:
    return f"{what} is missing or stale: run `python scripts/make_hf_fixtures.py` (needs torch; docs/testing.md)"


def checkpoint_dir(arch: str) -> Path:
    """The checked-in checkpoint of `arch` (read only: copy it before changing anything)."""
    d = HF_ROOT / arch
    if not (d / EXPECTED).is_file():
        raise MissingFixture(_regen_hint(f"tests/fixtures/hf/{arch}"))
    return d


@dataclass(frozen=True)
class Expected:
    """What transformers computed on a fixture checkpoint (the module doc gives the shapes)."""

    tokens: np.ndarray
    logits: np.ndarray
    prompt: list[int]
    greedy: list[int]
    eos_ids: list[int]


def expected(arch: str) -> Expected:
    with np.load(checkpoint_dir(arch) / EXPECTED) as z:
        return Expected(tokens=z["tokens"], logits=z["logits"], prompt=z["prompt"].tolist(),
                        greedy=z["greedy"].tolist(), eos_ids=z["eos_ids"].tolist())


def copy_checkpoint(arch: str, out: Path) -> Path:
    """The checkpoint's files (not expected.npz) copied to `out`: what transformers saved."""
    shutil.copytree(checkpoint_dir(arch), out, ignore=shutil.ignore_patterns(EXPECTED))
    return out


@dataclass(frozen=True)
class GGUFExpected:
    """transformers' float32 logits [T, V] on a GGUF's dequantized weights, and the digest of
    those weights (gguf_models.weights_digest) they were computed from."""

    logits: np.ndarray
    weights_digest: str


def gguf_expected(case: str) -> GGUFExpected:
    path = GGUF_ROOT / f"{case}.npz"
    if not path.is_file():
        raise MissingFixture(_regen_hint(f"tests/fixtures/gguf/{case}.npz"))
    with np.load(path) as z:
        return GGUFExpected(logits=z["logits"], weights_digest=str(z["weights_digest"]))


_COPIES: dict[str, Path] = {}


def cached_checkpoint(arch: str, tmp_path_factory) -> tuple[Path, Expected]:
    """(a copy of the checked-in checkpoint of `arch`, made once per test session so that no test
    can change the repository's files; what transformers computed on it)."""
    if arch not in _COPIES:
        _COPIES[arch] = copy_checkpoint(arch, tmp_path_factory.mktemp(f"hf_{arch}") / arch)
    return _COPIES[arch], expected(arch)
