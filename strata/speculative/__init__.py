"""Speculative windows: draft tokens, verify them in one `decode_window`, keep what stands.

- `drafter.py`: the `Drafter` protocol (the seam a model's multi-token-prediction layers plug
  into once a converter keeps them) and `Draft`;
- `suffix.py`: `SuffixDrafter`, drafts from a suffix index over the prompt and the generation;
- `mtp.py`: `MtpDrafter`, drafts one token through the model's multi-token-prediction layer;
- `acceptance.py`: greedy match (lossless) and speculative sampling (distribution-preserving);
- `gate.py`: the runtime gate (bytes and ms per token over a sliding window);
- `steps.py`: `SpeculativeSteps`, the token source `strata.generate` draws from when asked;
- `report.py`: `SpeculationReport`.

`drafter_for(config, model)` is the drafter a Config names (None: speculation off).
"""

from strata.speculative.drafter import NO_DRAFT, Draft, Drafter
from strata.speculative.gate import Gate
from strata.speculative.mtp import MtpDrafter
from strata.speculative.report import SpeculationReport
from strata.speculative.steps import SpeculativeSteps
from strata.speculative.suffix import SuffixDrafter

__all__ = ["Draft", "Drafter", "NO_DRAFT", "Gate", "MtpDrafter", "SpeculationReport", "SpeculativeSteps",
           "SuffixDrafter", "drafter_for"]


def drafter_for(config, model=None) -> Drafter | None:
    """The drafter `config` (a strata.config.Config, or None) asks for: `suffix_draft` > 0 is a
    suffix drafter of that depth, `mtp_draft` the MTP drafter over `model` (a strata.loader.Model);
    None where speculation is off."""
    if config is None:
        return None
    if config.mtp_draft:
        return MtpDrafter(model)
    return SuffixDrafter(config.suffix_draft) if config.suffix_draft else None
