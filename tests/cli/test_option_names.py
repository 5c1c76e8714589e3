"""Errors name settings in the words of the interface the user called: flags on the command line,
Python names from the Python API (the arena that cannot hold one window, both ways)."""

import pytest

import strata
from strata.cli.main import main
from strata.errors import StrataError
from strata.option_names import command_line, option
from strata.testing.models import make_model


def test_option_spellings():
    assert option("arena", "48slots") == "arena='48slots'" and option("force_arena", True) == "force_arena=True"
    assert option("experts", "f16", python="expert_type") == "expert_type='f16'"
    with command_line():
        assert option("arena", "48slots") == "--arena 48slots" and option("force_arena", True) == "--force-arena"
        assert option("moce_scale") == "--moce-scale"
    assert option("arena") == "arena"  # the context ends with the block


def test_a_too_small_arena_is_refused_in_each_interfaces_words(tmp_path, capsys):
    made = make_model(tmp_path / "tiny", "tiny", seed=0)
    with strata.load(made.model_path) as model:
        with pytest.raises(StrataError, match=r"give arena='\d+slots' or more, or lower prefetch; the least this "
                                              r"backend runs: \d+ slots \(.*\) with prefetch=0 and layer_pins=True$"):
            strata.generate(model, "hi", max_tokens=2, config={"arena": "2slots", "backend": "numpy"})
    assert main(["generate", str(made.model_path), "hi", "-n", "2", "--arena", "2slots", "--backend", "numpy"]) == 2
    err = capsys.readouterr().err
    assert "give --arena" in err and "slots or more, or lower --prefetch" in err and "arena='" not in err
    assert "with --prefetch 0 and --set layer_pins=on" in err and "layer_pins=True" not in err
