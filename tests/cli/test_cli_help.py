"""Every subcommand's --help says what the command does today."""

import pytest

from strata.cli.main import main


def test_convert_help_names_every_family_it_converts(capsys):
    from strata.convert.architectures import FAMILIES

    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for family in FAMILIES:
        assert family.name in text, family.name
        for model_type in family.model_types:
            assert model_type in text, model_type
