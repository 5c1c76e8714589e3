"""What every engine shares: a session's token history and the checks on it.

An engine is long-lived: it holds the positions it has processed (`tokens`), continues them
(`prefill`, `decode`, `decode_window`), and goes back (`trim(n)`: keep the first n positions;
`reset()`: keep none). `SessionEngine` does the bookkeeping once; an engine supplies four
steps over its own state:

    _prefill(tokens [T]) -> logits [V]     the prompt path (chunked where the engine streams)
    _decode(token) -> logits [V]           one position (the decode fast path)
    _window(tokens [T]) -> logits [T, V]   T positions at once, every position's logits
    _truncate(n)                           drop every position from n on

Which positions can be restored: an attention layer keeps every position, so `trim(n)` works
for every n in [0, length]. A recurrent layer (linear attention) keeps only its latest state;
such a layer must keep a snapshot at each position `kept_position` may return (the end of
every call, and every position inside a `decode_window`, so a rejected draft can be rolled
back). Engines of attention-only models keep every position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.cache.types import CacheStats
from strata.errors import StrataError
from strata.sharing import SharedSession

__all__ = ["EngineStats", "SessionEngine", "StateEngine"]


@dataclass(frozen=True)
class EngineStats:
    """An engine's counts over its life (a session spans many `generate` calls).

    engine: which engine ("reference", "numpy streaming", "mlx resident", "mlx streaming")
    length: positions held now
    prompt_tokens / decode_tokens: positions prefilled / decoded (windows count every position)
    expert_reads: expert records read from disk (all-resident engines read each once, at open)
    cache: the expert cache's cumulative counts (streaming engines), else None
    """

    engine: str
    length: int
    prompt_tokens: int
    decode_tokens: int
    expert_reads: int
    cache: CacheStats | None = field(default=None, repr=False)


class SessionEngine:
    """The Engine protocol's bookkeeping (strata.engines.Engine), over four engine steps."""

    kind = "engine"
    takes_snapshots = False  # `snapshot()` is a value `restore` brings back exactly (strata.sharing)

    def __init__(self, model=None, config=None) -> None:
        self.model, self.config = model, config
        self._tokens: list[int] = []
        self._prompt_tokens = self._decode_tokens = 0
        self._closed = False
        self.version = 0  # counts changes to the positions held: how a suspended call sees another's
        self.sharing = SharedSession(self)  # the generate calls on this session (strata/sharing.py)

    # -------------------------------------------------------- the session

    @property
    def tokens(self) -> tuple[int, ...]:
        """The token ids of the positions held, in order."""
        return tuple(self._tokens)

    @property
    def length(self) -> int:
        return len(self._tokens)

    def prefill(self, tokens) -> np.ndarray:
        """Process `tokens` after the held positions; the last position's logits [V]."""
        ids = self._ids(tokens, "prefill")
        self.version += 1
        logits = self._prefill(ids)
        self._tokens.extend(ids.tolist())
        self._prompt_tokens += len(ids)
        return logits

    def decode(self, token: int) -> np.ndarray:
        """Process one token after the held positions; its logits [V]."""
        ids = self._ids([token], "decode")
        self.version += 1
        logits = self._decode(int(ids[0]))
        self._tokens.append(int(ids[0]))
        self._decode_tokens += 1
        return logits

    def decode_window(self, tokens) -> np.ndarray:
        """Process T tokens at once (verifying drafted tokens); every position's logits [T, V].
        T = 1 is `decode`."""
        ids = self._ids(tokens, "decode_window")
        self.version += 1
        logits = self._decode(int(ids[0]))[None] if len(ids) == 1 else self._window(ids)
        self._tokens.extend(ids.tolist())
        self._decode_tokens += len(ids)
        return logits

    def kept_position(self, n: int) -> int:
        """The largest m <= n that `trim(m)` can restore (every m for attention-only models)."""
        return max(0, min(int(n), self.length))

    def trim(self, n: int) -> None:
        """Keep the first n positions (0 <= n <= length); later calls continue from there."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self.length:
            raise StrataError(f"trim: n must be an int in [0, {self.length}], got {n!r}")
        if n < self.length:
            self.version += 1
            self._truncate(int(n))
            del self._tokens[n:]

    def reset(self) -> None:
        """Hold no positions (what the engine has resident, such as experts, stays)."""
        self.trim(0)

    def snapshot(self):
        """The positions held, as a value `restore` brings back exactly (engines whose
        `takes_snapshots` is True; strata.sharing keeps a suspended call's state with it)."""
        raise NotImplementedError(f"{self.kind}: no snapshots (its state is written in place)")

    def restore(self, snapshot) -> None:
        """Hold exactly the positions `snapshot()` returned."""
        raise NotImplementedError(f"{self.kind}: no snapshots (its state is written in place)")

    def stats(self) -> EngineStats:
        return EngineStats(engine=self.kind, length=self.length, prompt_tokens=self._prompt_tokens,
                           decode_tokens=self._decode_tokens, expert_reads=self._expert_reads(),
                           cache=self._cache_totals())

    def greedy_pipeline(self):
        """Greedy decoding whose next token the engine chooses on its device (a GreedyPipeline,
        strata.device_greedy), or None: then `decode` returns each position's logits to the host."""
        return None

    def ledger(self):
        """Running totals a streaming engine's report is the difference of; None elsewhere."""
        return None

    def report(self, since=None):
        """The stream report of the decode windows since `since` (streaming engines), else None."""
        return None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------- what an engine supplies

    def _prefill(self, tokens: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _decode(self, token: int) -> np.ndarray:
        raise NotImplementedError

    def _window(self, tokens: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _truncate(self, n: int) -> None:
        raise NotImplementedError

    def _expert_reads(self) -> int:
        return 0

    def _cache_totals(self) -> CacheStats | None:
        return None

    # -------------------------------------------------------- checks

    def _ids(self, tokens, what: str) -> np.ndarray:
        if self._closed:
            raise StrataError(f"{what}: the engine is closed")
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise StrataError(f"{what}: wants a non-empty list of int token ids, got {tokens!r:.80}")
        return ids.astype(np.int64)


class StateEngine(SessionEngine):
    """A SessionEngine whose positions are held by one model state, `self.state` (`trim(n)` -> a
    new state, `kept_position(n)`): the all-resident engines, whose forward returns the next state."""

    def _truncate(self, n: int) -> None:
        self.state = self.state.trim(n)

    def kept_position(self, n: int) -> int:
        return self.state.kept_position(super().kept_position(n))
