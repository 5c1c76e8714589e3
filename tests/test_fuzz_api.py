"""tests/fuzz/fuzz_api.py, a few cases of each group: every run refused or the same as alone
(0 wrong, 0 tracebacks, 0 hangs), and its JSON line counts them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[0] / "fuzz"))

import fuzz_api  # noqa: E402


def test_a_few_cases_of_each_group_are_refused_or_the_same(capsys, tmp_path):
    out = tmp_path / "fuzz.json"
    code = fuzz_api.main(["--sharing", "2", "--config", "16", "--convert", "6", "--serve", "6", "--seed", "3",
                          "--timeout", "60", "--json", str(out)])
    text = capsys.readouterr().out
    line = json.loads(text.strip().splitlines()[-1])
    assert line["bench"] == "fuzz_api" and line["WRONG"] == line["TRACEBACK"] == line["HANG"] == 0, text
    assert code == 0 and line["runs"] == line["refused"] + line["same"]
    groups = {key.split("/")[0] for key in json.loads(out.read_text())["counts"]}
    assert groups == {"sharing", "config", "convert", "serve"}
