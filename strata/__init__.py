"""strata: run Mixture-of-Experts language models larger than memory.

Public API:
    load(path)                                  -> Model
    open_engine(model, config)                  -> Engine (a long-lived session: prefill, decode,
                                                   decode_window, trim, reset, stats, close)
    generate(model_or_engine, prompt, *, ...)   -> GenerationResult
    stream_generate(model_or_engine, prompt, *, ...) -> iterator of GenerationResponse
    Config                                      the runtime configuration
"""

from strata.config import Config
from strata.engines import Engine, EngineStats, open_engine
from strata.generate import GenerationResponse, GenerationResult, generate, stream_generate
from strata.loader import Model, load

__all__ = ["Config", "Engine", "EngineStats", "GenerationResponse", "GenerationResult", "Model", "generate", "load",
           "open_engine", "stream_generate"]
__version__ = "0.1.0"
