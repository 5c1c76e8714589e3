"""The Qwen3-Next converter keeps the multi-token-prediction layer (`mtp.*`) as dense tensors:
the tiny checked-in checkpoint with an MTP layer added (transformers' own decoder layer, noise on
every parameter) converts, the model file's MTP layer is the checkpoint's (norms as 1 + w), the
rest of the model is unchanged, and what strata keeps only one of is refused by name."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests import hf_hybrid  # noqa: E402
from tests.convert_parity import assert_refused_in_one_line, save_as_one_file  # noqa: E402
from tests.hf_mtp import mtp_layer  # noqa: E402
from strata.convert import convert  # noqa: E402
from strata.convert.safetensors_reader import Checkpoint  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.loader import load  # noqa: E402
from strata.reference.mtp import MtpWeights  # noqa: E402
from strata.speculative.mtp import drafter_dense

ARCH = "qwen3_next"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return hf_hybrid.cached_checkpoint(ARCH, tmp_path_factory)[0]


@pytest.fixture(scope="module")
def with_mtp(plain, tmp_path_factory):
    """(checkpoint dir with an MTP layer, its tensors by published name)."""
    src = tmp_path_factory.mktemp("mtp") / "ckpt"
    shutil.copytree(plain, src)
    with Checkpoint(src) as ck:
        tensors = {n: ck.read(n) for n in ck.tensors}
    _, mtp, _ = mtp_layer(hf_hybrid.hf_config(ARCH), seed=3)
    save_as_one_file(src, {**tensors, **mtp})
    return src, mtp


def _convert(src, out):
    return load(convert(src, out, expert_type=QuantType.F16, dense_type=QuantType.F32).model_path)


def test_the_mtp_layer_is_kept_as_published(with_mtp, plain, tmp_path):
    src, mtp = with_mtp
    model = _convert(src, tmp_path / "with")
    assert model.cfg.deltanet.mtp_layers == 1
    assert not [n for n in model.dense if n.startswith("mtp.")]  # left in the file: not resident without drafting
    got = MtpWeights.from_dense(drafter_dense(model), model.cfg.n_experts)
    want = MtpWeights.from_checkpoint(mtp, model.cfg.n_experts)
    for field in MtpWeights.__dataclass_fields__:
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    without = _convert(plain, tmp_path / "without")  # the rest of the model: the same tensors
    assert without.cfg.deltanet.mtp_layers == 0
    assert not [n for n in without.dense if n.startswith("mtp.")]
    for name in without.dense:
        np.testing.assert_array_equal(model.dense[name], without.dense[name], err_msg=name)


@pytest.mark.parametrize("extra, message", [
    ("mtp.layers.1.input_layernorm.weight", "more than one MTP layer"),
    ("mtp.embed_tokens.weight", "dedicated MTP embeddings"),
])
def test_what_strata_does_not_keep_is_refused_in_one_line(with_mtp, tmp_path, extra, message):
    src, mtp = with_mtp
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    with Checkpoint(bad) as ck:
        tensors = {n: ck.read(n) for n in ck.tensors}
    tensors[extra] = np.zeros((4, 4), np.float32)
    save_as_one_file(bad, tensors)
    assert_refused_in_one_line(bad, tmp_path / "out", message)
