"""The families' registry against the tree: every registered family provides each piece of
`FamilyParts`, every file docs/adding-a-family.md names exists, and `ModelConfig` keeps only the
fields every family shares (each family's own are its dataclass)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from strata.convert.architectures import BY_MODEL_TYPE
from strata.convert.common import Family
from strata.errors import ConfigError
from strata.families.counts import PartCounts
from strata.families.family import FamilyParts
from strata.families.registry import FAMILIES, FamilyFields, published_counter
from strata.model_config import ModelConfig
from strata.testing.models import SHAPES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "adding-a-family.md"
# a family module's name: its FamilyParts is `FAMILY` in strata/families/<module>.py
MODULES = {f.check.__module__.rpartition(".")[2]: f for f in FAMILIES}


def test_every_family_module_is_registered():
    on_disk = {p.stem for p in (ROOT / "strata" / "families").glob("*.py")} - {"__init__", "family", "registry",
                                                                               "counts"}
    assert on_disk == set(MODULES)
    for name, family in MODULES.items():
        assert importlib.import_module(f"strata.families.{name}").FAMILY is family


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_family_provides_each_piece(family: FamilyParts):
    assert family.name and family.model_types and family.made_shapes
    # its converter: the module it names holds the convert Family of each of its model types
    converter = importlib.import_module(family.converter)
    families = [v for v in vars(converter).values() if isinstance(v, Family)]
    assert {t for f in families for t in f.model_types} == set(family.model_types)
    assert all(BY_MODEL_TYPE[t] in families for t in family.model_types)
    # its made shapes are test models, and its check holds them (and the shared `tiny`)
    for name, fields in family.made_shapes.items():
        cfg = SHAPES[name]
        assert cfg == ModelConfig(architecture="strata_test", vocab_size=cfg.vocab_size, **fields)
        family.check(cfg)
    family.check(SHAPES["tiny"])
    # strata doctor's count of a config it refuses: found by each model type it names
    if family.count_published is not None:
        assert family.published_types
        for t in family.published_types:
            assert published_counter(t) is family.count_published
    assert family.count_published is None or PartCounts  # the counts' type is families/counts.py's


def test_no_two_families_share_a_model_type_or_a_shape():
    types = [t for f in FAMILIES for t in f.model_types]
    shapes = [s for f in FAMILIES for s in f.made_shapes]
    assert len(types) == len(set(types)) and len(shapes) == len(set(shapes))


def _named_paths() -> set[str]:
    return set(re.findall(r"`((?:strata|tests|docs)/[\w./<>-]+\.(?:py|md))`", DOC.read_text()))


def test_the_doc_names_files_that_exist():
    named = _named_paths()
    assert len(named) >= 15  # the walk found the doc's paths
    for path in sorted(named):
        if "<family>" in path:  # one per registered family
            for module, family in MODULES.items():
                concrete = path.replace("<family>", module)
                if path.startswith("strata/convert/"):  # the converter module the family names
                    concrete = family.converter.replace(".", "/") + ".py"
                if path.startswith("tests/"):
                    continue  # test files are named by what they test, not by module (checked below)
                assert (ROOT / concrete).exists(), concrete
        elif "<" not in path:
            assert (ROOT / path).exists(), path


def test_the_family_engine_table_has_every_made_shape():
    from test_family_engines import ROWS

    assert {row.shape for row in ROWS} >= {s for f in FAMILIES for s in f.made_shapes}


# the fields every family shares: ModelConfig keeps these and no family's own (a new family's
# fields are its dataclass in strata/families/<family>.py, an attribute of FamilyFields)
SHARED_FIELDS = {
    "architecture", "vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts",
    "n_experts_per_token", "expert_ffn_size", "shared_ffn_size", "shared_expert_gated", "routing_order",
    "norm_topk_prob", "qk_norm", "attention_bias", "rope_theta", "rms_norm_eps", "max_context", "tie_embeddings",
    "layer_types", "dense_ffn_size", "rotary_dim", "attention_output_gate",
}


def test_model_config_keeps_only_the_shared_fields():
    parts = {f.name: f.default_factory for f in dataclasses.fields(FamilyFields)}
    own = {f.name for f in dataclasses.fields(ModelConfig)} - set(parts)
    assert own == SHARED_FIELDS
    family_modules = {f"strata.families.{m}" for m in MODULES}
    stored = [f.name for f in ModelConfig.stored_fields()]
    assert len(stored) == len(set(stored)) == len(own) + sum(len(dataclasses.fields(p)) for p in parts.values())
    for name, part in parts.items():
        # a frozen dataclass of one registered family's module, at defaults every family's check passes
        assert part.__module__ in family_modules and part.__dataclass_params__.frozen, name
        assert getattr(ModelConfig(architecture="x", vocab_size=8, hidden_size=8, n_layers=1, n_heads=1,
                                   n_kv_heads=1, head_dim=8, n_experts=2, n_experts_per_token=1,
                                   expert_ffn_size=8), name) == part()
        assert not {f.name for f in dataclasses.fields(part)} & own
        with pytest.raises(TypeError):
            part(not_a_field=1)


def test_stored_fields_round_trip_and_unknown_keys_are_refused():
    for cfg in SHAPES.values():
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg == cfg.with_fields()
    gpt_oss = SHAPES["gpt-oss"]
    window = gpt_oss.with_fields(sliding_window=4, n_layers=2, layer_types=gpt_oss.layer_types[:2])
    assert window.gpt_oss.sliding_window == 4 and window.n_layers == 2 and window.yarn == gpt_oss.yarn
    with pytest.raises(ConfigError, match="unknown keys"):
        ModelConfig.from_dict({**SHAPES["tiny"].to_dict(), "sliding_windows": 4})
    with pytest.raises(ConfigError, match="unknown keys"):
        SHAPES["tiny"].with_fields(gpt_oss_window=4)


def test_the_doc_sends_no_family_to_model_config():
    part_a = DOC.read_text().split("## A.")[1].split("## B.")[0]
    assert "strata/model_config.py" not in part_a
    assert "strata/families/registry.py" in part_a and "`FamilyFields`" in part_a
