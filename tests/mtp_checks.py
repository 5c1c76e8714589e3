"""The lossless check every MTP drafter's tests share: greedy output with and without drafting."""

from __future__ import annotations

import strata
from strata.config import Config

from engine_kinds import open_kind


def assert_mtp_drafting_is_lossless(model, kind: str, prompt: list[int], tokens: int, config: Config) -> None:
    """Greedy `tokens` after `prompt` on engine `kind` under `config` (its speculation gate off, so
    every window drafts): the same tokens with `mtp_draft` on as off, the session as long as plain
    decoding leaves it, one draft per window but the last."""
    with open_kind(model, kind, config) as eng:
        want = strata.generate(eng, prompt, max_tokens=tokens).tokens
    with open_kind(model, kind, config.replace(mtp_draft=True)) as eng:
        got = strata.generate(eng, prompt, max_tokens=tokens)
        assert eng.length == len(prompt) + tokens - 1  # what plain decoding holds at the end
    assert got.tokens == want
    spec = got.speculation
    assert spec.drafter == "mtp" and spec.tokens == tokens - 1
    assert spec.drafted == tokens - 2  # one per window but the last (no room after it)
