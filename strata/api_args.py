"""The public API's argument checks (generate, stream_generate, open_engine): each refusal is
one ParameterError (a TypeError and a ValueError) whose message starts with the parameter's name,
raised before any model is loaded or any work starts."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np

from strata.errors import ConfigError, ParameterError

__all__ = ["check_prompt", "check_token_ids", "check_count", "check_real", "sampler_from", "as_config"]


def _kind(value) -> str:
    return type(value).__name__


def check_prompt(prompt, name: str = "prompt") -> str | list[int]:
    """Text (str, valid UTF-8) or token ids (a sequence of ints; not bools, floats or bytes)."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates: undecodable bytes from a command line or file
            raise ParameterError(f"{name}: not valid UTF-8 text (character {e.start} is {prompt[e.start]!r})") from None
        return prompt
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ParameterError(f"{name}: got {_kind(prompt)}; pass text (decode it: prompt.decode('utf-8')) "
                             "or a list of token ids")
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise ParameterError(f"{name}: token ids must be a 1-D integer array, got {prompt.dtype} {prompt.shape}")
        return [int(t) for t in prompt]
    if isinstance(prompt, (list, tuple)):
        for i, t in enumerate(prompt):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                raise ParameterError(f"{name}: token ids must be ints, got {t!r} ({_kind(t)}) at index {i}")
        return [int(t) for t in prompt]
    raise ParameterError(f"{name}: expected text (str) or token ids (a list of int), got {_kind(prompt)}")


def check_token_ids(tokens: list[int], vocab_size: int, name: str = "prompt") -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ParameterError(f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def check_count(name: str, value, minimum: int = 0) -> int:
    """An int >= minimum (bools refused: max_tokens=True is a mistake, not 1)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ParameterError(f"{name}: expected an int, got {value!r} ({_kind(value)})")
    if value < minimum:
        raise ParameterError(f"{name}: must be >= {minimum}, got {value}")
    return int(value)


def check_real(name: str, value) -> float:
    """A finite real number (ints allowed; bools, NaN and infinities refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ParameterError(f"{name}: expected a number, got {value!r} ({_kind(value)})")
    value = float(value)
    if not math.isfinite(value):
        raise ParameterError(f"{name}: must be finite, got {value}")
    return value


def sampler_from(*, temperature, top_p, seed, top_k=0, min_p=0.0, repeat_penalty=1.0, frequency_penalty=0.0,
                 presence_penalty=0.0):
    """The SamplerConfig of a call's sampling arguments (its range checks name the parameter)."""
    from strata.reference.sampling import SamplerConfig

    values = dict(temperature=check_real("temperature", temperature), top_p=check_real("top_p", top_p),
                  seed=check_count("seed", seed), top_k=check_count("top_k", top_k), min_p=check_real("min_p", min_p),
                  repeat_penalty=check_real("repeat_penalty", repeat_penalty),
                  frequency_penalty=check_real("frequency_penalty", frequency_penalty),
                  presence_penalty=check_real("presence_penalty", presence_penalty))
    try:
        return SamplerConfig(**values)
    except ConfigError as e:  # a range check: its message starts with the parameter's name
        raise ParameterError(str(e)) from None


def as_config(config, name: str = "config"):
    """None, a Config, or a mapping of Config field names to values (read as `Config(**mapping)`:
    over the defaults, not the environment; unknown keys refused)."""
    from strata.config import Config, from_mapping

    if config is None or isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        bad = [k for k in config if not isinstance(k, str)]
        if bad:
            raise ParameterError(f"{name}: mapping keys must be Config field names (str), got {bad[0]!r}")
        try:
            return from_mapping(dict(config))
        except ParameterError:
            raise
        except ConfigError as e:
            raise ParameterError(f"{name}: {e}") from None
    raise ParameterError(f"{name}: expected a strata.Config or a mapping of its fields, got {_kind(config)}")
