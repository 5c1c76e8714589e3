"""Never compute with bad bytes: reads verified by default, a `.gguf` tied to its `.experts`,
the converter's pair installed recoverably, invalid values and non-finite results refused in one
line. (The container checks are tests/formats/test_gguf_file.py; tests/fuzz/fuzz_files.py is the fuzz.)"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import struct

import numpy as np
import pytest

import strata
from strata.config import Config
from strata.convert.driver import _install
from strata.errors import ConfigError, ExpertReadError, FormatError, NonFiniteError, StrataError
from strata.formats.checksum import CRC32_IMPL, checksum
from strata.formats.experts_file import HEADER_SIZE, ExpertsFile
from strata.reference.routing import RouterRule, route
from strata.runtime.decode import arena_plan_for
from strata.testing.faults import Faults
from strata.runtime.selector import Selector
from strata.testing.engines import open_numpy_streaming
from strata.testing.models import SHAPES, make_model

PROMPT = list(b"def fib(n):")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pair")
    return make_model(d / "a", "tiny", seed=1, n_experts=32), make_model(d / "b", "tiny", seed=2, n_experts=32)


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg
    return msg


def _greedy(engine, n=4):
    logits = [engine.prefill(PROMPT)]
    for _ in range(n):
        logits.append(engine.decode(int(np.argmax(logits[-1]))))
    return np.stack(logits)


# ---------------------------------------------------------------- verified reads by default


def test_reads_are_verified_by_default():
    assert Config().verify_reads is True
    assert CRC32_IMPL in ("isal", "zlib")  # the same values either way:
    import zlib

    data = np.random.default_rng(0).integers(0, 256, 70_000, dtype=np.uint8)
    assert checksum(data) == zlib.crc32(data) & 0xFFFFFFFF


def _streaming(model, config, hook=None):
    slots = arena_plan_for(model, config.replace(arena="100000slots")).min_slots
    return open_numpy_streaming(model, config.replace(arena=f"{slots}slots"), hook=hook)


def test_a_corrupt_read_is_an_error_with_the_default_config(pair):
    model = strata.load(pair[0].model_path)
    keys = {(l, e) for l in range(model.cfg.n_moe_layers) for e in range(model.cfg.n_experts)}
    with pytest.raises(ExpertReadError) as err, _streaming(model, Config(moce_lambda=0.0), Faults(corrupt=keys)) as eng:
        _greedy(eng)
    assert "checksum mismatch" in _one_line(err)


class _Overwrite:
    """After the first read, overwrite every record of the file on disk (another process's write)."""

    def __init__(self, xf: ExpertsFile) -> None:
        self.xf, self.done = xf, False

    def before(self, req) -> None:
        if not self.done:
            self.done = True
            h = self.xf.header
            with open(self.xf.path, "r+b") as f:
                f.seek(h.data_offset)
                f.write(os.urandom(h.file_bytes - h.data_offset))

    def after(self, req, buf, got):
        return got


def test_overwriting_records_during_a_run_ends_in_one_line(pair, tmp_path):
    shutil.copy(pair[0].model_path, tmp_path / "m.gguf")
    shutil.copy(pair[0].experts_path, tmp_path / "m.experts")
    model = strata.load(tmp_path / "m.gguf")
    with pytest.raises(StrataError) as err, _streaming(model, Config(moce_lambda=0.0), _Overwrite(model.experts_file)) as e:
        _greedy(e)
    assert "checksum mismatch" in _one_line(err)


# ---------------------------------------------------------------- the pair


def test_a_model_records_its_experts_identity(pair):
    model = strata.load(pair[0].model_path)
    from strata.formats.model_file import read_experts_identity

    assert read_experts_identity(pair[0].model_path) == model.experts_file.identity
    assert pair[0].model_path.stat().st_size and model.experts_file.identity != strata.load(pair[1].model_path).experts_file.identity


def test_another_models_experts_are_refused_unless_asked_for(pair):
    with pytest.raises(FormatError) as err:
        strata.load(pair[0].model_path, experts=pair[1].experts_path)
    msg = _one_line(err)
    assert "not the expert set" in msg and "allow_foreign_experts=True" in msg
    model = strata.load(pair[0].model_path, experts=pair[1].experts_path, allow_foreign_experts=True)
    assert model.experts_file.path == str(pair[1].experts_path)


def test_a_resealed_record_edit_changes_the_identity(pair, tmp_path):
    """A record changed with its checksum and the header checksum updated is a valid file, and a
    different expert set: the identity is what tells."""
    shutil.copy(pair[0].model_path, tmp_path / "m.gguf")
    raw = bytearray(pair[0].experts_path.read_bytes())
    with ExpertsFile.open(pair[0].experts_path) as xf:
        h = xf.header
        start = xf.record_offset(1, 3)
    raw[start + 10] ^= 0x10
    struct.pack_into("<I", raw, HEADER_SIZE + 4 * (1 * h.n_experts + 3), checksum(bytes(raw[start: start + h.record_bytes])))
    end = HEADER_SIZE + 4 * h.n_records
    struct.pack_into("<I", raw, end, checksum(bytes(raw[:end])))
    (tmp_path / "m.experts").write_bytes(bytes(raw))
    ExpertsFile.open(tmp_path / "m.experts").verify_all()  # valid on its own
    with pytest.raises(FormatError) as err:
        strata.load(tmp_path / "m.gguf")
    assert "not the expert set" in _one_line(err)


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_the_converters_install_never_leaves_an_old_model_beside_new_experts(tmp_path, monkeypatch, crash_at):
    model, experts = tmp_path / "m.gguf", tmp_path / "m.experts"
    model.write_text("old model")
    experts.write_text("old experts")
    mp, xp = tmp_path / "m.gguf.partial", tmp_path / "m.experts.partial"
    mp.write_text("new model")
    xp.write_text("new experts")
    calls = {"n": 0}
    real_replace, real_unlink = os.replace, os.unlink

    def step():
        calls["n"] += 1
        if calls["n"] == crash_at:
            raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(os, "replace", lambda a, b: (step(), real_replace(a, b)))
    monkeypatch.setattr(type(model), "unlink", lambda self, missing_ok=False: (step(), real_unlink(self)))
    with pytest.raises(KeyboardInterrupt):
        _install(mp, xp, model, experts)
    monkeypatch.undo()
    if model.exists():  # a model under the final name has its own experts beside it
        assert (model.read_text(), experts.read_text()) == ("old model", "old experts")
    else:  # no model: nothing loads, and running the conversion again finishes the job
        assert experts.read_text() == ("old experts" if crash_at < 3 else "new experts")


# ---------------------------------------------------------------- invalid values, non-finite results


@pytest.mark.parametrize("field, value", [("rope_theta", math.nan), ("rope_theta", 0.0), ("rope_theta", -1.0),
                                          ("rope_theta", math.inf), ("rms_norm_eps", -1.0), ("rms_norm_eps", math.nan)])
def test_invalid_config_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"{field} must be a finite number > 0"):
        dataclasses.replace(SHAPES["tiny"], **{field: value})


def test_non_finite_router_logits_name_the_layer():
    cfg = SHAPES["tiny"]
    z = np.zeros(cfg.n_experts, np.float32)
    z[3] = np.nan
    with pytest.raises(NonFiniteError, match="router logits are not finite"):
        route(z, RouterRule.from_model_config(cfg))
    sel = Selector(cfg, Config(moce_lambda=0.0).moce_policy())
    with pytest.raises(NonFiniteError) as err:
        sel.select(1, z[None, :], np.zeros(cfg.n_experts, bool))
    assert _one_line(err).startswith("layer 1: router logits are not finite (1 of 16")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_experts_path_that_is_not_a_file_is_refused_without_blocking(pair, tmp_path, kind):
    import threading

    shutil.copy(pair[0].model_path, tmp_path / "m.gguf")
    target = tmp_path / "m.experts"
    os.mkfifo(target) if kind == "fifo" else target.mkdir()
    result = []

    def load():
        with pytest.raises(FormatError) as err:
            strata.load(tmp_path / "m.gguf")
        result.append(_one_line(err))

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(5)
    assert result and "not a regular file" in result[0]
