"""The streaming engine: the split-turn decode loop over a fixed arena (SPEC §1, §4, §5).

One decode window (one token) runs every layer as:

    attention -> router input h -> router logits z (host) -> route (MoCE vs the cache's residency)
    host turn:  at_layer(l, selected): hits, read-ahead claims, urgent reads ... the shared
                expert is computed here, between issuing the reads and waiting for them
                (shexp_overlap) ... wait -> Use(slots)
    after_layer(l, guesses for l+1 from W_router(l+1)·h on the Q8_0 router copy): retire this
                layer's unclaimed read-aheads, release limbo, read ahead (split_turn; off: the
                old order, inside the host turn before compute). A synchronous backend (numpy)
                hands off before routed(l), so its read-aheads for l+1 are issued there and
                land while layer l's experts compute; an asynchronous one (MLX) after it
    routed(l, h, slots) computed (numpy) or handed to the device (MLX)
    x += routed + shared

Every switch of SPEC §6 comes from the one Config and restores the old behaviour when flipped.
`StreamingEngine(model, config, arena, compute, io)` takes its parts explicitly (the seams);
`open_streaming_engine(model, config)` builds the numpy ones.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from strata.config import Config
from strata.errors import ArenaTooSmallError
from strata.formats.expert_record import ExpertWeights
from strata.loader import Model
from strata.cache.types import CacheConfig, CacheStats, Use, stats_delta, stats_sum
from strata.reference.model import ModelParams
from strata.reference.routing import Selection
from strata.runtime.arena import Arena, NumpyArena, mlock_buffer
from strata.runtime.budget import ArenaPlan, fmt_bytes, plan_arena
from strata.runtime.compute import LayerCompute, NumpyCompute
from strata.runtime.io import IOHook, ReaderPool
from strata.runtime.report import StreamReport, build_report
from strata.runtime.selector import Selector, union_in_rank_order
from strata.runtime.streamer import Streamer

__all__ = ["StreamingEngine", "open_streaming_engine", "cache_config_for", "arena_plan_for"]

PHASES = ("attention", "route", "turn", "routed", "shared", "after", "combine", "head")


def cache_config_for(model: Model, config: Config, capacity: int) -> CacheConfig:
    cfg = model.cfg
    return CacheConfig(capacity=capacity, n_layers=cfg.n_layers, n_experts=cfg.n_experts,
                       top_k=cfg.n_experts_per_token, window=1, prefetch_depth=config.prefetch,
                       prefetch_touch=config.prefetch_touch, prefetch2=config.prefetch2,
                       split_turn=config.split_turn)


def arena_plan_for(model: Model, config: Config) -> ArenaPlan:
    """The arena this model and configuration get (`--arena` or the budget rule)."""
    h = model.experts_file.header
    least = cache_config_for(model, config, 1).min_capacity
    dense = sum(a.nbytes for a in model.dense.values())
    return plan_arena(config=config, slot_bytes=h.padded_bytes, total_experts=h.n_records, min_slots=least,
                      dense_bytes=dense, model_files=(model.model_path, model.experts_file.path))


class _NoResidentExperts:
    """Streaming params carry no expert store: experts come from arena slots only."""

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        raise RuntimeError("the streaming engine reads experts from the arena, never from params")


class StreamingEngine:
    """An `Engine` (prefill/decode/length) that pages routed experts through `arena`."""

    def __init__(self, model: Model, config: Config, arena: Arena, compute: LayerCompute, io: ReaderPool,
                 *, keep_trace: bool = False, notes: tuple[str, ...] = ()) -> None:
        self.model, self.config, self.arena, self.compute, self.io = model, config, arena, compute, io
        self.cache_config = cache_config_for(model, config, arena.capacity)
        least = self.cache_config.min_capacity
        if arena.capacity < least:
            raise ArenaTooSmallError(
                f"arena of {arena.capacity} slots ({fmt_bytes(arena.capacity * arena.slot_bytes)}) cannot hold one "
                f"window's selections of every layer plus the read-ahead depth: needs at least {least} slots")
        self.streamer = Streamer(self.cache_config, io, keep_trace=keep_trace, moce_pre=config.moce_pre,
                                 reference=config.reference_cache)
        self.selector = Selector(model.cfg, config.moce_policy())
        self.notes = notes
        self.tokens = 0
        self.decode_s = 0.0
        self.prompt_tokens = 0
        self.prompt_s = 0.0
        self._prompt_counts = CacheStats()  # the cache's counts during prompts (the report leaves them out)
        self._prompt_times = [0.0, 0.0, 0.0]  # host, waiting, after spent in prompts
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self._logpos = open(config.logpos, "ab") if config.logpos else None
        self._closed = False

    # -------------------------------------------------------- Engine

    @property
    def length(self) -> int:
        return self.compute.length

    def prefill(self, tokens: list[int]) -> np.ndarray:
        from strata.runtime.prompt import prefill

        before = self.streamer.totals
        t = self.streamer.times
        times = (t.host, t.waiting, t.after)
        start = time.perf_counter()
        logits = prefill(self, np.asarray(tokens, dtype=np.int64))
        self.prompt_s += time.perf_counter() - start
        self.prompt_tokens += len(tokens)
        self._prompt_counts = stats_sum(self._prompt_counts, stats_delta(self.streamer.totals, before))
        for i, (now, then) in enumerate(zip((t.host, t.waiting, t.after), times)):
            self._prompt_times[i] += now - then
        return logits

    def decode(self, token: int) -> np.ndarray:
        start = time.perf_counter()
        logits = self.window(np.asarray([token], dtype=np.int64))
        self.decode_s += time.perf_counter() - start
        self.tokens += 1
        return logits[-1]

    # -------------------------------------------------------- the loop

    def _clock(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self.phase_s[phase] += now - start
        return now

    def window(self, tokens: np.ndarray) -> np.ndarray:
        """One decode window over `tokens` (T positions, T = 1 in plain decoding).

        Shapes:
            tokens: [T] -> logits float32 [T, V]
        """
        s, c, cfg, conf = self.streamer, self.compute, self.model.cfg, self.config
        s.begin_window()
        x = c.embed(tokens)
        for layer in range(cfg.n_layers):
            t0 = time.perf_counter()
            x = c.attention(layer, x)
            t0 = self._clock("attention", t0)
            h = c.router_input(layer, x)
            selections = self.selector.select(layer, c.router_logits(layer, h), s.resident_mask(layer))
            t0 = self._clock("route", t0)
            uses: list[Use] = []
            shared: list = []
            overlap = (lambda: shared.append(c.shared(layer, h))) if conf.shexp_overlap else None
            s.at_layer(layer, union_in_rank_order(selections), on_use=uses.append, overlap=overlap)
            t0 = self._clock("turn", t0)
            # A synchronous backend (numpy: `routed` returns when the experts are computed) has
            # its hand-off before `routed`, so the split turn's AfterLayer(l) runs there, and
            # layer l+1's read-aheads land during layer l's routed experts instead of only
            # during layer l+1's attention (docs/perf.md: late read-aheads 2,700 -> 0). Same
            # events in the same order, so the same decisions: the slots Use(l) handed over
            # are pinned for the window, never read-ahead victims. An asynchronous backend
            # (MLX: `routed` ends in async_eval) hands off after `routed`, as before.
            early = not conf.split_turn or getattr(c, "synchronous", False)
            if early:  # the old order (timed as host) or a synchronous backend's hand-off
                self._after_layer(layer, h, in_turn=not conf.split_turn)
                t0 = self._clock("after", t0)
            slots, weights = slots_for(selections, uses[0])
            part = c.routed(layer, h, slots, weights)
            t0 = self._clock("routed", t0)
            if not early:  # compute is handed off: the host's bookkeeping runs beside it
                self._after_layer(layer, h)
                t0 = self._clock("after", t0)
            if not shared:
                shared.append(c.shared(layer, h))
                t0 = self._clock("shared", t0)
            x = c.combine(x, [part], shared[0])
            self._clock("combine", t0)
        t0 = time.perf_counter()
        logits = c.head(x)
        self._clock("head", t0)
        self._dump(logits)
        return logits

    def _after_layer(self, layer: int, h, *, in_turn: bool = False) -> None:
        """AfterLayer with the read-ahead guesses for layer+1 (and layer+2 with prefetch2)."""
        k, n_layers = self.config.prefetch, self.model.cfg.n_layers
        g1 = g2 = ()
        if k and layer + 1 < n_layers:
            g1 = self.selector.guesses(self.compute.guess_logits(layer + 1, h), k)
        if k and self.config.prefetch2 and layer + 2 < n_layers:
            g2 = self.selector.guesses(self.compute.guess_logits(layer + 2, h), k)
        self.streamer.after_layer(layer, g1, g2, in_turn=in_turn)

    def _dump(self, logits: np.ndarray) -> None:
        if self._logpos is not None:
            self._logpos.write(np.ascontiguousarray(logits, dtype=np.float32).tobytes())
            self._logpos.flush()

    # -------------------------------------------------------- report / lifetime

    def report(self) -> StreamReport:
        t = self.streamer.times
        decode = asdict(stats_delta(self.streamer.totals, self._prompt_counts))
        host, waiting, after = (now - p for now, p in zip((t.host, t.waiting, t.after), self._prompt_times))
        io = self.io.note + "".join(f"; {n}" for n in self.notes)
        return build_report(
            decode=decode, tokens=self.tokens, seconds=self.decode_s, host_s=host, waiting_s=waiting,
            after_s=after, slot_bytes=self.arena.slot_bytes, arena_slots=self.arena.capacity, io=io,
            prompt_tokens=self.prompt_tokens, prompt_s=self.prompt_s,
            prompt_reads=self._prompt_counts.reads_issued,
            profile=self.phase_s if self.config.profile else None)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.io.close()
            if self._logpos is not None:
                self._logpos.close()

    def __enter__(self) -> "StreamingEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def slots_for(selections: list[Selection], use: Use) -> tuple[np.ndarray, np.ndarray]:
    """Each token's selected experts as arena slots (-1: not in this pass, or none), in rank
    order, with their combine weights.

    Shapes:
        -> slots int64 [T, k], weights float32 [T, k]   (k = the longest selection)
    """
    where = dict(zip(use.experts, use.slots))
    k = max((len(sel.experts) for sel in selections), default=0)
    if len(selections) == 1 and len(selections[0].experts) == k:  # decode: one row, no per-item numpy writes
        sel = selections[0]
        row = [where.get(e, -1) for e in sel.experts.tolist()]
        slots = np.array([row], np.int64).reshape(1, k)
        weights = np.where(slots >= 0, sel.weights.astype(np.float32, copy=False), np.float32(0))
        return slots, weights
    slots = np.full((len(selections), k), -1, np.int64)
    weights = np.zeros((len(selections), k), np.float32)
    for t, sel in enumerate(selections):
        for r, (e, w) in enumerate(zip(sel.experts.tolist(), sel.weights)):
            if e in where:
                slots[t, r] = where[e]
                weights[t, r] = w
    return slots, weights


def open_streaming_engine(model: Model, config: Config, *, plan: ArenaPlan | None = None,
                          hook: IOHook | None = None, keep_trace: bool = False) -> StreamingEngine:
    """A numpy StreamingEngine: arena from `plan` (default: `arena_plan_for`), reader pool,
    NumpyCompute over the model's dense weights."""
    plan = plan or arena_plan_for(model, config)
    slot_bytes = model.experts_file.header.padded_bytes
    notes = []
    arena = NumpyArena(plan.slots, slot_bytes, wire=config.wire_arena)
    if config.wire_arena:
        notes.append("arena wired" if arena.wired else "arena NOT wired (mlock refused)")
    if config.mlock_dense:
        ok = all(mlock_buffer(a) for a in model.dense.values())
        notes.append("dense wired" if ok else "dense NOT wired (mlock refused)")
    pool = ReaderPool(model.experts_file, arena, threads=config.io_threads, direct=config.direct_io,
                      verify=config.verify_reads, timeout=config.io_timeout, hook=hook,
                      switch_interval=config.io_switch_ms / 1e3)
    try:
        params = ModelParams(model.cfg, model.dense, _NoResidentExperts())
        compute = NumpyCompute(params, arena, model.experts_file.layout, pred_q8=config.pred_q8)
        return StreamingEngine(model, config, arena, compute, pool, keep_trace=keep_trace, notes=tuple(notes))
    except BaseException:
        pool.close()
        raise
