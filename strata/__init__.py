"""strata: run Mixture-of-Experts language models larger than memory.

Public API:
    load(path)                                  -> Model
    generate(model, prompt, *, max_tokens, ...) -> GenerationResult
    stream_generate(model, prompt, *, ...)      -> iterator of GenerationResponse
    Config                                      the runtime configuration (SPEC §6)
"""

from strata.config import Config
from strata.generate import GenerationResponse, GenerationResult, generate, stream_generate
from strata.loader import Model, load

__all__ = ["Config", "GenerationResponse", "GenerationResult", "Model", "generate", "load", "stream_generate"]
__version__ = "0.1.0"
