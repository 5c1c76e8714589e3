"""A llama.cpp GGUF split into parts (`name-00001-of-0000N.gguf`, written by the `gguf` package's
writer with split_max_tensors, as llama.cpp's gguf-split lays them out) converts from its first
part to the same model as the single file, bit for bit; a missing part, a part given first, a part
of another split and a wrong tensor count are one line each naming the problem."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from strata.cli.main import main
from strata.convert import convert
from strata.errors import FormatError
from strata.loader import load
from strata.reference.model import ModelState, forward
from tests import gguf_models, hf_models


def _logits(model_path) -> np.ndarray:
    model = load(model_path)
    tokens = np.asarray(model.tokenizer.encode(hf_models.PARITY_TEXT))
    out, _ = forward(model.resident_params(), ModelState.empty(model.cfg), tokens)
    return out


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    hf_dir, _ = hf_models.cached_checkpoint("qwen3_moe", tmp_path_factory)
    work = tmp_path_factory.mktemp("split")
    (work / "whole").mkdir()
    (work / "parts").mkdir()
    whole = gguf_models.write_gguf(hf_dir, work / "whole" / "m.gguf")
    first = gguf_models.write_gguf(hf_dir, work / "parts" / "m.gguf", split_max_tensors=10)
    return whole, first


def test_a_split_gguf_converts_from_its_first_part_as_the_whole_file(split, tmp_path):
    whole, first = split
    parts = sorted(first.parent.glob("m-*-of-*.gguf"))
    assert first.name == "m-00001-of-%05d.gguf" % len(parts) and len(parts) > 2
    a, b = convert(whole, tmp_path / "whole"), convert(first, tmp_path / "split")
    assert a.cfg == b.cfg and a.expert_layer_types == b.expert_layer_types
    np.testing.assert_array_equal(_logits(a.model_path), _logits(b.model_path))


def _copy_parts(first, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for p in first.parent.glob("m-*-of-*.gguf"):
        shutil.copy(p, out / p.name)
    return out / first.name, sorted(out.glob("m-*-of-*.gguf"))


def test_a_missing_part_is_refused_naming_it(split, tmp_path, capsys):
    first, parts = _copy_parts(split[1], tmp_path)
    parts[-1].unlink()
    with pytest.raises(FormatError, match=rf"part {len(parts)} of {len(parts)} is missing \({parts[-1].name}"):
        convert(first, tmp_path / "out")
    assert main(["convert", str(first), str(tmp_path / "cli"), "--quiet"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is missing" in err[0]


def test_a_later_part_given_first_is_refused_naming_the_first(split, tmp_path):
    first, parts = _copy_parts(split[1], tmp_path)
    with pytest.raises(FormatError, match=rf"part 2 of a {len(parts)}-part split GGUF; give the first part \({first.name}\)"):
        convert(parts[1], tmp_path / "out")


def test_a_part_of_another_split_is_refused(split, tmp_path):
    """Part 3 swapped for part 2 (renamed): its split.no says 2, not 1."""
    first, parts = _copy_parts(split[1], tmp_path)
    shutil.copy(parts[2], parts[1])
    with pytest.raises(FormatError, match=r"split\.no = 2, split\.count = \d+; expected 1 and"):
        convert(first, tmp_path / "out")


def test_a_wrong_tensor_count_is_refused(split, tmp_path):
    """split.tensors.count (the first part's) one more than the parts hold: a part lost its last
    tensor, or the count is damaged."""
    first, parts = _copy_parts(split[1], tmp_path)
    data = bytearray(first.read_bytes())
    key = b"split.tensors.count"
    at = data.index(key) + len(key) + 4  # the value, after its u32 type
    n = int.from_bytes(data[at:at + 4], "little")
    data[at:at + 4] = (n + 1).to_bytes(4, "little")
    first.write_bytes(bytes(data))
    with pytest.raises(FormatError, match=rf"split\.tensors\.count = {n + 1}, but the {len(parts)} parts hold {n} tensors"):
        convert(first, tmp_path / "out")

