"""strata: run Mixture-of-Experts language models larger than memory.

Public API:
    load(path)                                  -> Model (no path, or "default": the embedded model;
                                                   a checkpoint directory: a tier-2 model)
    open_engine(model, config)                  -> Engine (a long-lived session: prefill, decode,
                                                   decode_window, trim, reset, stats, close)
    generate(model_or_engine, prompt, *, ...)   -> GenerationResult
    stream_generate(model_or_engine, prompt, *, ...) -> iterator of GenerationResponse
    Config                                      the runtime configuration

The distribution is `strata-moe` (`pip install strata-moe`); the import package and the command
are `strata`. The names above load on first use, so `strata --version` and the CLI can set
numpy's thread count before numpy is imported (strata/threads.py).
"""

import sys as _sys
import types as _types
from pathlib import Path as _Path

from strata.install_check import DISTRIBUTION as __distribution__
from strata.install_check import check_install as _check_install

__version__ = "0.1.0"
__all__ = ["Config", "Engine", "EngineStats", "GenerationResponse", "GenerationResult", "Model", "generate", "load",
           "open_engine", "stream_generate"]

_WHERE = {"Config": "strata.config", "Engine": "strata.engines", "EngineStats": "strata.engines",
          "open_engine": "strata.engines", "GenerationResponse": "strata.generate",
          "GenerationResult": "strata.generate", "generate": "strata.generate",
          "stream_generate": "strata.generate", "Model": "strata.loader", "load": "strata.loader"}

_check_install(_Path(__file__).parent)


class _Package(_types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule strata.generate binds it as an attribute of the package, which
        # would hide the function strata.generate(); the eager `from ... import` this package
        # used to do rebound it. Dropping that one binding keeps the function (loaded below).
        if name in _WHERE and isinstance(value, _types.ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'strata' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
