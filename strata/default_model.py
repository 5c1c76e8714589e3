"""Where `strata generate PROMPT` finds its model when none is named.

The embedded model ships in `strata/data/` once it is trained; until then a demo model (random
weights, structured routing) is built on first use and cached in `$STRATA_CACHE_DIR`
(default `~/.cache/strata`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

EMBEDDED = Path(__file__).parent / "data" / "default.gguf"
DEMO_NAME = "demo-v1"


def cache_dir() -> Path:
    return Path(os.environ.get("STRATA_CACHE_DIR") or Path.home() / ".cache" / "strata")


def default_model_path(*, announce: bool = True) -> Path:
    if EMBEDDED.exists():
        return EMBEDDED
    from strata.testing import make_model, model_paths

    model_path, experts_path = model_paths(cache_dir() / DEMO_NAME)
    if not (model_path.exists() and experts_path.exists()):
        if announce:
            print(f"building the demo model (random weights) in {model_path.parent} ...", file=sys.stderr)
        make_model(model_path, "demo", seed=0)
    return model_path
