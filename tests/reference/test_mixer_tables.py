"""Every mixer kind has an entry in every backend's mixer table (and in the tensor table), or is
refused there in one line;
and no engine loop branches on the mixer kind (the tables are the one place a kind is looked up).

The numpy engines compute through the reference's pieces (`reference.model.mixer_block`), so the
reference's table is theirs too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from strata.errors import ConfigError
from strata.families.qwen4_exp import QWEN4_MIXERS
from strata.model_config import MIXER_TENSORS, Mixer, dense_tensor_shapes
from strata.reference.mixers import MIXERS as REFERENCE_MIXERS
from strata.reference.mixers import mixer_for
from strata.testing.models import SHAPES

ROOT = Path(__file__).resolve().parents[2]
# a made shape with a layer of each mixer kind
SHAPE_OF = {Mixer.ATTENTION: "tiny", Mixer.SLIDING_ATTENTION: "gpt-oss", Mixer.DELTANET: "hybrid",
            Mixer.MLA: "mla", Mixer.INDEXED_ATTENTION: "qwen4"}
# the modules that run a layer loop or build a layer: none may branch on `Mixer.<kind>`
LOOPS = ("strata/reference/model.py", "strata/reference/layers.py", "strata/reference/model_state.py",
         "strata/reference/residual.py", "strata/numpy_backend", "strata/mlx_backend/model.py",
         "strata/mlx_backend/residual.py", "strata/mlx_backend/compute.py",
         "strata/mlx_backend/prompt.py", "strata/runtime")


def test_every_kind_has_a_made_shape():
    assert set(SHAPE_OF) == set(Mixer)
    for kind, shape in SHAPE_OF.items():
        assert kind in {t.mixer for t in SHAPES[shape].kinds}, (kind, shape)


@pytest.mark.parametrize("kind", list(Mixer), ids=lambda m: m.value)
def test_reference_table(kind):
    assert kind in REFERENCE_MIXERS
    cfg = SHAPES[SHAPE_OF[kind]]
    state = mixer_for(kind).empty_state(cfg)
    assert state.length == 0


@pytest.mark.parametrize("kind", list(Mixer), ids=lambda m: m.value)
def test_tensor_table(kind):
    """Every kind's tensors are listed, and they are the made model's for a layer of that kind."""
    cfg = SHAPES[SHAPE_OF[kind]]
    layer = next(l for l, t in enumerate(cfg.kinds) if t.mixer is kind)
    names = MIXER_TENSORS[kind](cfg, layer)
    assert names and all(name.startswith(f"blk.{layer}.") for name in names)
    assert names.items() <= dense_tensor_shapes(cfg).items()


@pytest.mark.parametrize("kind", list(Mixer), ids=lambda m: m.value)
def test_mlx_tables(kind):
    pytest.importorskip("mlx.core")
    from strata.mlx_backend import mixers as mlx_mixers

    assert (kind in mlx_mixers.MIXERS) != (kind in mlx_mixers.REFUSED), kind
    cfg = SHAPES[SHAPE_OF[kind]]
    if kind in mlx_mixers.MIXERS:
        assert mlx_mixers.mixer_for(kind).empty_state(cfg).length == 0
    else:
        with pytest.raises(ConfigError) as e:
            mlx_mixers.mixer_for(kind, 3)
        assert "\n" not in str(e.value) and kind.value in str(e.value) and "layer 3" in str(e.value)
    # a hyper-connection model's mixers come from the same table (mlx_backend/residual.py)
    if kind in QWEN4_MIXERS:
        assert kind in mlx_mixers.MIXERS


def _mixer_branches(path: Path) -> list[str]:
    """`Mixer.<kind>` used anywhere but as a table key (lines), in one module."""
    tree = ast.parse(path.read_text())
    keys = {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys if k is not None}
    return [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Mixer"
            and node.attr in Mixer.__members__ and id(node) not in keys]


def test_no_loop_branches_on_the_mixer_kind():
    files = []
    for name in LOOPS:
        path = ROOT / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    assert len(files) > 10
    found = [hit for f in files for hit in _mixer_branches(f)]
    assert not found, "a mixer-kind branch outside the mixer tables: " + ", ".join(found)
