"""The speculation report: what one generation's windows drafted, kept and cost."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from strata.sizes import fmt_bytes

__all__ = ["SpeculationReport"]


@dataclass(frozen=True)
class SpeculationReport:
    """One generation call's speculative windows.

    drafter: its name ("suffix-2"); gate: "on", "off" (switched off, see events) or "measuring"
    (--no-spec-gate); windows: verify windows run (speculative + plain); spec_windows: of them
    with a draft; drafted / accepted: drafted tokens and those that stood; acceptance: their
    ratio; tokens: tokens the windows decided; positions: positions the windows ran (drafts
    included); ms_per_token / bytes_per_token: over every window, per decided token (bytes:
    expert records read x slot bytes, 0 where all are resident); spec_* / plain_*: the same over
    speculative and plain windows only (NaN where there were none); events: the gate's switches.
    """

    drafter: str
    gate: str
    windows: int
    spec_windows: int
    drafted: int
    accepted: int
    tokens: int
    positions: int
    ms_per_token: float
    bytes_per_token: float
    spec_ms_per_token: float
    spec_bytes_per_token: float
    plain_ms_per_token: float
    plain_bytes_per_token: float
    events: tuple[str, ...] = ()

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_window(self) -> float:
        return self.tokens / self.windows if self.windows else 0.0

    def text(self) -> str:
        line = (f"speculation ({self.drafter}, gate {self.gate}): {self.spec_windows}/{self.windows} windows drafted, "
                f"{self.accepted}/{self.drafted} accepted ({100 * self.acceptance:.1f}%), "
                f"{self.tokens_per_window:.2f} tokens/window; {self.ms_per_token:.2f} ms and "
                f"{fmt_bytes(self.bytes_per_token)} per token (speculative {self.spec_ms_per_token:.2f} ms "
                f"{fmt_bytes(_finite(self.spec_bytes_per_token))}, plain {self.plain_ms_per_token:.2f} ms "
                f"{fmt_bytes(_finite(self.plain_bytes_per_token))})")
        return line + "".join(f"; gate {e}" for e in self.events)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["events"] = list(self.events)
        d["acceptance"] = self.acceptance
        d["tokens_per_window"] = self.tokens_per_window
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _finite(x: float) -> float:
    return x if x == x else 0.0
