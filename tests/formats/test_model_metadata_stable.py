"""The GGUF metadata keys a model file carries do not change when `ModelConfig` is regrouped:
every made shape (the shared ones and each family's) is written, and its `strata.*` config keys,
their GGUF types and values are held to those the flat `ModelConfig` wrote before the family
fields moved into their families' dataclasses (tests/fixtures/model_metadata.json, written by
that code). Readers look keys up by name, so files written before and after read the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strata.formats.gguf_file import open_gguf
from strata.formats.model_file import (
    CONFIG_PREFIX, KEY_EXPERTS_IDENTITY, KEY_FILE_CHECKSUM, KEY_FORMAT_VERSION, KEY_NGRAMS_IDENTITY,
    read_model_config, write_model,
)
from strata.testing.models import SHAPES, make_dense
from strata.tokenizer import byte_level_tokenizer_json

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "model_metadata.json").read_text())
NOT_CONFIG = {KEY_FORMAT_VERSION, KEY_FILE_CHECKSUM, KEY_EXPERTS_IDENTITY, KEY_NGRAMS_IDENTITY}


def config_metadata(path: Path) -> dict[str, list]:
    fields = open_gguf(path).fields
    return {k: [f.type_name, f.value] for k, f in fields.items() if k.startswith(CONFIG_PREFIX) and k not in NOT_CONFIG}


def test_every_shape_has_its_golden_metadata():
    assert set(GOLDEN) == set(SHAPES)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_written_model_has_the_same_metadata_as_before(tmp_path, shape):
    cfg = SHAPES[shape]
    path = tmp_path / "m.gguf"
    write_model(path, cfg, make_dense(cfg, 0), tokenizer_json=byte_level_tokenizer_json())
    assert config_metadata(path) == GOLDEN[shape]
    assert read_model_config(path) == cfg
