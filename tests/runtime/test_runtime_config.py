"""Config (one frozen object; env and CLI read in one place) and the arena budget rule."""

import pytest

from strata.config import Backend, Config, from_env, load_config, parse_assignments
from strata.errors import ArenaTooSmallError, ConfigError
from strata.reference.routing import BonusScale, MoCEPolicy
from strata.runtime.budget import SizeSpec, parse_size, plan_arena


@pytest.mark.parametrize("text, spec", [
    ("2GB", SizeSpec(nbytes=2_000_000_000)), ("512MB", SizeSpec(nbytes=512_000_000)),
    ("1.5GiB", SizeSpec(nbytes=3 * 2**29)), ("4096B", SizeSpec(nbytes=4096)), ("300slots", SizeSpec(slots=300)),
    ("300", SizeSpec(slots=300)), ("25%", SizeSpec(percent=25.0)), ("0", SizeSpec(slots=0)),
    (" 7 gb ", SizeSpec(nbytes=7_000_000_000)),
])
def test_sizes_parse(text, spec):
    assert parse_size(text) == spec


@pytest.mark.parametrize("text", ["", "GB", "2XB", "-1GB", "1.5slots", "150%", "0%"])
def test_bad_sizes_are_clear_errors(text):
    with pytest.raises(ConfigError, match="cannot read"):
        parse_size(text, what="arena")


def test_env_then_cli_override_and_unknown_keys_fail():
    env = {"STRATA_PREFETCH": "16", "STRATA_SPLIT_TURN": "off", "STRATA_MOCE_SCALE": "range", "PATH": "/bin"}
    c = load_config({"prefetch": 12, "backend": "numpy"}, environ=env)
    assert (c.prefetch, c.split_turn, c.moce_scale, c.backend) == (12, False, BonusScale.RANGE, Backend.NUMPY)
    with pytest.raises(ConfigError, match="environment variable STRATA_PREFETCHH: unknown config key"):
        from_env({"STRATA_PREFETCHH": "16"})
    with pytest.raises(ConfigError, match="unknown config keys"):
        load_config({"nope": 1}, environ={})
    with pytest.raises(ConfigError, match="arena"):
        Config(arena="lots")
    with pytest.raises(ConfigError, match="expected on/off"):
        load_config({"pred_q8": "maybe"}, environ={})
    assert parse_assignments(["prefetch=16", "split-turn = off"]) == {"prefetch": "16", "split_turn": "off"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_assignments(["prefetch"])


def test_config_is_frozen_and_stock():
    c = Config()
    with pytest.raises(Exception):
        c.prefetch = 3  # noqa
    assert (c.prefetch, c.prefetch_touch, c.split_turn, c.shexp_overlap, c.pred_q8, c.prefetch2) == \
        (10, False, True, True, True, False)
    assert c.moce_policy() == MoCEPolicy(protect_top_j=3, bonus=0.0) and c.moce_policy().exact  # exact by default
    assert Config(moce_lambda=0).moce_policy().effective_bonus() == 0.0


def test_moce_presets_fill_the_fields_left_at_their_defaults():
    stock = Config(moce="stock")
    assert stock.moce_policy() == MoCEPolicy(protect_top_j=3, bonus=0.85) and not stock.moce_policy().exact
    assert stock.moce == ""  # resolved once: replace() edits the fields, not the preset
    assert stock.replace(moce_lambda=0.5).moce_lambda == 0.5
    assert Config(moce="stock", moce_lambda=0.4).moce_lambda == 0.4  # an explicit field wins
    assert Config(moce="off", moce_lambda=0).moce_policy().exact
    assert "lossy: MoCE J3 λ0.85" == stock.moce_policy().describe()
    assert Config().moce_policy().describe().startswith("exact")
    with pytest.raises(ConfigError, match="unknown preset 'fast'"):
        Config(moce="fast")


def test_budget_rule_and_explicit_arena():
    common = dict(slot_bytes=1000, total_experts=500, min_slots=40, dense_bytes=0)
    fits = plan_arena(config=Config(keep="1000B"), available=600_000, **common)
    assert not fits.streaming and "every expert fits" in fits.reason
    tight = plan_arena(config=Config(keep="500000B", ple_reserve="10000B"), available=600_000, **common)
    assert tight.streaming and tight.slots == 90
    explicit = plan_arena(config=Config(arena="64slots"), available=10**12, **common)
    assert explicit.streaming and explicit.slots == 64 and explicit.nbytes == 64_000
    capped = plan_arena(config=Config(arena="1GB", force_arena=True), available=0, **common)
    assert capped.slots == 500 and "capped" in capped.reason
    with pytest.raises(ArenaTooSmallError, match="needs at least 40 slots"):
        plan_arena(config=Config(arena="39slots"), **common)
    with pytest.raises(ArenaTooSmallError, match="budget"):
        plan_arena(config=Config(keep="599000B"), available=600_000, **common)


def test_keep_auto_is_the_process_reserve_on_this_machine():
    """auto: a 16th of the machine between the measured process growth and the process reserve
    (tests/runtime/test_runtime_memory.py)."""
    from strata.runtime.budget import PROCESS_GROWTH, PROCESS_RESERVE, RESERVE_SHARE, keep_bytes
    from strata.runtime.memory import machine_memory

    share = int(machine_memory().total * RESERVE_SHARE)
    assert keep_bytes("auto") == min(PROCESS_RESERVE, max(PROCESS_GROWTH, share))
    assert keep_bytes("7GB") == 7_000_000_000
    assert Config().keep == "auto"


@pytest.mark.parametrize("field", ["prefetch", "io_switch_ms", "verify_reads", "backend", "logpos", "arena"])
def test_none_is_refused_naming_the_field_and_its_default(field):
    with pytest.raises(ConfigError, match=rf"^{field}: got None; give .* or leave {field} out for its default"):
        Config(**{field: None})


@pytest.mark.parametrize("field", ["io_switch_ms", "moce_lambda", "moce_margin", "moce_drop_tail", "io_timeout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_float_fields_must_be_finite(field, value):
    with pytest.raises(ConfigError, match=rf"^{field} must be (a finite number|in \[0, 1\])"):
        Config(**{field: value})


def test_a_value_of_no_numeric_kind_is_a_config_error_not_a_type_error():
    with pytest.raises(ConfigError, match=r"^prefetch: cannot read \[3\] as int"):
        Config(prefetch=[3])


def test_logpos_is_checked_where_the_config_is_made(tmp_path):
    with pytest.raises(ConfigError, match=r"^logpos .*: no such directory .* \(create it first\)"):
        Config(logpos=str(tmp_path / "missing" / "rows.bin"))
    with pytest.raises(ConfigError, match=r"^logpos .*: is a directory; name a file"):
        Config(logpos=str(tmp_path))
    assert Config(logpos=str(tmp_path / "rows.bin")).logpos.endswith("rows.bin")


def test_a_logpos_write_that_fails_is_refused_naming_the_field(tmp_path):
    """/dev/full opens, and every write fails (ENOSPC): refused naming logpos, not an OSError."""
    import os

    import strata
    from strata.testing.models import make_model

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    made = make_model(tmp_path / "m", "tiny", seed=1)
    with strata.load(made.model_path) as model:
        with pytest.raises(ConfigError, match=r"^logpos /dev/full: cannot write \(No space left on device\)"):
            strata.generate(model, [1, 2, 3], max_tokens=2, config=dict(logpos="/dev/full", arena="100%"))


def test_every_refusal_names_the_field_as_python_spells_it():
    """Any value given to any field is taken or refused in one line starting with the field's
    name (not a MoCE policy's or a TypeError's words)."""
    import math

    from strata.config import field_types

    for name in field_types():
        for value in (None, math.nan, math.inf, -math.inf, [3], {}, -5, 2.5, "zz", True, 10**30):
            try:
                Config(**{name: value})
            except ConfigError as e:
                assert str(e).startswith(name) and "\n" not in str(e), (name, value, str(e))
