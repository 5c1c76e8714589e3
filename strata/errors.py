"""strata's error types. Each names what is wrong (file, tensor, layer/expert, limit) in one line,
so the CLI can print `error: <message>` instead of a traceback."""

from __future__ import annotations


class StrataError(Exception):
    """Base of every error strata raises on purpose."""


class FormatError(StrataError):
    """A model or experts file is malformed: bad magic, truncated, wrong shape, bad checksum."""


class MissingTensorError(FormatError):
    """A tensor the model needs is not in the file."""


class ConfigError(StrataError, ValueError):
    """A configuration value or key is invalid."""


class ContextLimitError(StrataError, ValueError):
    """A prompt (plus requested tokens) does not fit the model's context."""


class ExpertReadError(StrataError, OSError):
    """Reading an expert record failed (I/O error, short read, checksum mismatch)."""


class ArenaTooSmallError(StrataError):
    """The arena cannot hold one window's selections plus the read-ahead depth."""


class NonFiniteError(StrataError, ValueError):
    """A forward pass produced NaN or infinity (damaged weights or inputs); the message names where."""


class ParameterError(ConfigError, TypeError):
    """A public function's argument has the wrong type or value; the message names the parameter."""


class RowReadError(StrataError, OSError):
    """Reading a page of n-gram embedding rows failed (I/O error, short read, checksum mismatch)."""


class SessionBusyError(StrataError):
    """A call cannot have a session without computing over another call's positions: the message
    names the fix (finish the other iterator first, or give the call its own engine)."""
