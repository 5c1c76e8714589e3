"""The Python API refuses bad arguments with one ParameterError naming the parameter, before
any work; a mapping is a config; load() names the embedded model; the install check."""

import math
import warnings

import numpy as np
import pytest

import strata
from strata.errors import ConfigError, ParameterError, StrataError
from strata.install_check import PackageConflictWarning, check_install, foreign_distributions
from strata.testing.models import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = strata.load(make_model(tmp_path_factory.mktemp("api") / "tiny", "tiny", seed=0).model_path)
    yield m
    m.close()


@pytest.mark.parametrize("prompt, kwargs, starts", [
    (b"hello", {}, "prompt: got bytes"), ([1.5], {}, "prompt: token ids must be ints"),
    ([True], {}, "prompt: token ids must be ints"), (np.array([1.0]), {}, "prompt: token ids"),
    ([10**6], {}, "prompt: token id 1000000 is outside"), ({"a": 1}, {}, "prompt: expected text"),
    ("\udcff", {}, "prompt: not valid UTF-8"),
    ("hi", dict(max_tokens=True), "max_tokens: expected an int"), ("hi", dict(max_tokens=-1), "max_tokens: must be >= 0"),
    ("hi", dict(max_tokens=2.0), "max_tokens: expected an int"),
    ("hi", dict(temperature=math.inf), "temperature: must be finite"), ("hi", dict(temperature=math.nan), "temperature"),
    ("hi", dict(temperature="hot"), "temperature: expected a number"), ("hi", dict(temperature=-0.5), "temperature"),
    ("hi", dict(top_p=0), "top_p"), ("hi", dict(top_p=True), "top_p: expected a number"),
    ("hi", dict(seed=-1), "seed: must be >= 0"), ("hi", dict(seed=1.5), "seed: expected an int"),
    ("hi", dict(top_k=-1), "top_k"), ("hi", dict(min_p=1.0), "min_p"), ("hi", dict(repeat_penalty=0), "repeat_penalty"),
    ("hi", dict(config=[("prefetch", 4)]), "config: expected a strata.Config or a mapping"),
    ("hi", dict(config={"prefetchh": 4}), "config: unknown config keys"),
    ("hi", dict(config={"prefetch": "many"}), "config: prefetch"),
])
def test_bad_arguments_name_the_parameter(model, prompt, kwargs, starts):
    with pytest.raises(ParameterError) as e:
        strata.generate(model, prompt, **kwargs)
    assert str(e.value).startswith(starts), str(e.value)
    assert isinstance(e.value, (TypeError, ValueError)) and isinstance(e.value, StrataError)


def test_refusals_come_before_loading(tmp_path):
    with pytest.raises(ParameterError, match="temperature"):  # not "no such model file"
        strata.generate(tmp_path / "missing.gguf", "hi", temperature=math.inf)


def test_good_variants_of_each_argument_are_accepted(model):
    base = strata.generate(model, "hi", max_tokens=4)
    ids = model.tokenizer.encode("hi", add_special_tokens=True)
    assert strata.generate(model, ids, max_tokens=4).tokens == base.tokens
    assert strata.generate(model, np.array(ids, np.int32), max_tokens=4).tokens == base.tokens
    assert strata.generate(model, tuple(np.int64(t) for t in ids), max_tokens=np.int64(4)).tokens == base.tokens
    assert strata.generate(model, "hi", max_tokens=4, temperature=0, top_p=1).tokens == base.tokens


def test_a_mapping_is_a_config(model):
    r = strata.generate(model, "hi", max_tokens=3, config={"arena": "40slots", "prefetch": "4"})
    assert r.report is not None and r.tokens == strata.generate(model, "hi", max_tokens=3).tokens  # exact streaming
    with strata.open_engine(model, {"backend": "numpy", "window": 2}) as engine:
        assert engine.config.window == 2
    with pytest.raises(ParameterError, match="config: expected"):
        strata.open_engine(model, "numpy")


def test_load_names_the_embedded_model():
    from strata.default_model import EMBEDDED

    for m in (strata.load(), strata.load("default")):
        with m:
            assert m.model_path == EMBEDDED
    with pytest.raises(StrataError, match="model: expected a path"):
        strata.load(42)


def test_sampler_refusals_are_config_errors():
    from strata.reference.sampling import SamplerConfig

    for kw in (dict(temperature=math.inf), dict(seed=-1), dict(top_k=-1), dict(min_p=-0.1), dict(repeat_penalty=math.nan)):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            SamplerConfig(**kw)


def _dist_info(site, name, summary):
    info = site / f"{name}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: x\nSummary: {summary}\n")


def test_install_check_finds_the_other_strata_packages(tmp_path):
    site = tmp_path / "site-packages"
    (site / "strata").mkdir(parents=True)
    _dist_info(site, "strata_moe-0.1.0", "Run Mixture-of-Experts language models larger than memory: ...")
    _dist_info(site, "strata-0.1.0", "Run Mixture-of-Experts language models larger than memory: ...")  # our old name
    assert foreign_distributions(site / "strata") == []
    _dist_info(site, "strata-26.0.0", "Multi-dimensional, topologically-driven ... configuration framework")
    _dist_info(site, "amperor_strata-0.1.0", "Run Mixture-of-Experts models larger than your RAM on Apple Silicon")
    assert foreign_distributions(site / "strata") == ["amperor-strata", "strata"]
    with pytest.warns(PackageConflictWarning, match="pip uninstall -y amperor-strata strata strata-moe"):
        check_install(site / "strata")


def test_importing_strata_is_light_and_keeps_generate_a_function():
    import subprocess
    import sys

    code = ("import sys, strata; light = 'numpy' not in sys.modules; import strata.generate; "
            "from strata.generate import stream_generate; print(light, callable(strata.generate), strata.__distribution__)")
    import os
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env).stdout.split()
    assert out == ["True", "True", "strata-moe"]
