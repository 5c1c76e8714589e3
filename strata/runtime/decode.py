"""The streaming engine: the split-turn decode loop over a fixed arena (design §1, §4, §5).

One decode window (T positions; T = 1 in plain decoding) runs every layer as its kind says.
A dense FFN layer is computed whole (`dense_ffn`: no router, no cache turn). An MoE layer:

    mixer -> router input h -> router logits z (host) -> route (MoCE vs the cache's residency)
    host turn:  at_layer(m, selected): hits, read-ahead claims, urgent reads ... the shared
                expert is computed here, between issuing the reads and waiting for them
                (shexp_overlap) ... wait -> Use(slots)
    after_layer(m, guesses for the next MoE layer from its router · h on the Q8_0 router copy):
                retire this layer's unclaimed read-aheads, release limbo, read ahead (split_turn;
                off: the old order, inside the host turn before compute). A synchronous backend
                (numpy) hands off before routed(l), so its read-aheads are issued there and land
                while layer l's experts compute; an asynchronous one (MLX) after it
    routed(l, h, slots) computed (numpy) or handed to the device (MLX)
    x += routed + shared

The cache sees MoE layers only, by MoE index m (`ModelConfig.moe_index`), so the read-ahead
guess for the next MoE layer reaches across any dense (or, later, recurrent) layers between.
Every switch of design §6 comes from the one Config and restores the old behaviour when flipped.
`StreamingEngine(model, config, arena, compute, io)` takes its parts explicitly (the seams);
strata.engines.open_engine assembles them for each backend.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from dataclasses import asdict, dataclass

import numpy as np

from strata.cache.types import CacheConfig, CacheStats, Use, stats_delta, stats_sum
from strata.config import Config
from strata.errors import ArenaTooSmallError, ConfigError, NonFiniteError
from strata.formats.dense_weights import stored_bytes
from strata.model_config import Ffn, LayerRange
from strata.runtime.arena import Arena
from strata.runtime.budget import ArenaPlan, engine_arena_plan
from strata.runtime.compute import LayerCompute
from strata.runtime.io import ReaderPool
from strata.runtime.memory import PagingDelta, paging_snapshot
from strata.runtime.ngram_rows import RowStats, StreamedNgramRows
from strata.runtime.prompt import prefill_chunks
from strata.reference.model import router_rules
from strata.runtime.report import StreamReport, build_report
from strata.runtime.selector import Selector, slots_for, union_in_rank_order
from strata.runtime.streamer import Streamer
from strata.session import SessionEngine
from strata.sizes import fmt_bytes

__all__ = ["StreamingEngine", "Ledger", "cache_config_for", "arena_plan_for"]

PHASES = ("attention", "dense", "route", "turn", "routed", "shared", "after", "combine", "head")


def cache_config_for(model, config: Config, capacity: int, stage: LayerRange | None = None) -> CacheConfig:
    """The cache machine's configuration: MoE layers only (a pipeline stage's own), windows of up
    to `config.window`."""
    cfg = model.cfg
    n_moe = cfg.n_moe_layers if stage is None else len(stage.moe_layers(cfg))
    return CacheConfig(capacity=capacity, n_layers=n_moe, n_experts=cfg.n_experts,
                       top_k=cfg.n_experts_per_token, window=config.window, prefetch_depth=config.prefetch,
                       prefetch_touch=config.prefetch_touch, prefetch2=config.prefetch2,
                       split_turn=config.split_turn, layer_pins=config.layer_pins)


def arena_plan_for(model, config: Config, stage: LayerRange | None = None, ple_bytes: int | None = None,
                   synchronous: bool | None = None) -> ArenaPlan:
    """The arena this model and configuration get (`--arena` or the budget rule); a pipeline
    stage's for its own MoE layers. ple_bytes: a PLE model's row cache (RowCachePlan.nbytes),
    reserved from the budget. synchronous: engine_arena_plan's (a caller that runs the plan's
    `applied(config)`)."""
    h = model.experts_file.header
    moe = model.cfg.n_moe_layers if stage is None else len(stage.moe_layers(model.cfg))
    dense = stored_bytes(model.dense)  # as held: the stored bytes, not float32's
    total = h.n_records if stage is None else moe * h.n_experts
    return engine_arena_plan(config=config, slot_bytes=h.padded_bytes, moe_layers=moe,
                             top_k=model.cfg.n_experts_per_token, n_experts=model.cfg.n_experts, total_experts=total,
                             dense_bytes=dense, model_files=_model_files(model),
                             ple_bytes=ple_bytes, synchronous=synchronous)


def _model_files(model) -> tuple[Path, ...]:
    """The files the model reads, each once (a GGUF run in place is both the model and its
    experts, and a split one every part)."""
    return tuple(dict.fromkeys(Path(p) for p in (model.model_path, *model.experts_file.files)))


@dataclass(frozen=True)
class Ledger:
    """A streaming engine's running totals; the difference of two is one run's report."""

    decode_counts: CacheStats = CacheStats()
    prompt_counts: CacheStats = CacheStats()
    decode_tokens: int = 0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    host_s: float = 0.0  # decode windows' host turns (prompt turns are left out)
    waiting_s: float = 0.0
    after_s: float = 0.0
    phase_s: tuple[tuple[str, float], ...] = ()
    paging: object = None  # the system's paging counters when the ledger was read (a PagingSnapshot)
    ple_rows: RowStats = RowStats()  # PLE row traffic of the decode windows (models with a row store)

    def minus(self, other: "Ledger") -> "Ledger":
        sub = {f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)
               if f.type in ("int", "float")}
        phases = dict(other.phase_s)
        return Ledger(decode_counts=stats_delta(self.decode_counts, other.decode_counts),
                      prompt_counts=stats_delta(self.prompt_counts, other.prompt_counts),
                      phase_s=tuple((k, v - phases.get(k, 0.0)) for k, v in self.phase_s),
                      ple_rows=self.ple_rows.minus(other.ple_rows), **sub)


def _open_logpos(path: str):
    """`config.logpos` opened for appending; an OSError is refused naming the field."""
    try:
        return open(path, "ab")
    except OSError as e:
        raise ConfigError(f"logpos {path}: cannot open ({e.strerror or e}); name a writable file") from None


class StreamingEngine(SessionEngine):
    """An engine that pages routed experts through `arena` (the Engine protocol: strata.engines)."""

    def __init__(self, model, config: Config, arena: Arena, compute: LayerCompute, io: ReaderPool,
                 *, keep_trace: bool = False, notes: tuple[str, ...] = (), kind: str = "numpy streaming",
                 stage: LayerRange | None = None, ngram_rows: StreamedNgramRows | None = None) -> None:
        super().__init__(model, config)
        # PLE: a StreamedNgramRows with the model's row ids; each window reads ahead every PLE
        # layer's rows before layer 0 (the PLE layers take them from it); the engine closes it
        self.ngram_rows = ngram_rows
        if ngram_rows is not None and stage is not None and not stage.embeds:
            raise ConfigError("ngram_rows: a pipeline stage that does not embed has no tokens to hash")
        self.kind = kind
        self.arena, self.compute, self.io = arena, compute, io
        # a pipeline stage runs its layer range only; its cache and `io` see its MoE layers only
        self.stage = stage or LayerRange.whole(model.cfg)
        if config.layer_pins and not compute.synchronous:
            raise ConfigError("layer_pins: this backend computes a window's layers after the turns (MLX); "
                              "set layer_pins=off, or use the numpy backend")
        self.cache_config = cache_config_for(model, config, arena.capacity, self.stage)
        least = self.cache_config.min_capacity
        if arena.capacity < least:
            raise ArenaTooSmallError(
                f"arena of {arena.capacity} slots ({fmt_bytes(arena.capacity * arena.slot_bytes)}) cannot hold one "
                f"window's selections of every MoE layer plus the read-ahead depth: needs at least {least} slots")
        self.streamer = Streamer(self.cache_config, io, keep_trace=keep_trace, moce_pre=config.moce_pre,
                                 reference=config.reference_cache)
        self.moe_layers = self.stage.moe_layers(model.cfg)  # (local) MoE index -> model layer
        self.selector = Selector(model.cfg, config.moce_policy(), router_rules(model.cfg, model.dense, self.moe_layers),
                                 self.moe_layers)
        self.notes = notes
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self._ledger = Ledger()
        self._paging0 = paging_snapshot()
        self._logpos = _open_logpos(config.logpos) if config.logpos else None

    # -------------------------------------------------------- the engine's steps

    def _prefill(self, tokens: np.ndarray) -> np.ndarray:
        return self._prompt(tokens, all_logits=False)

    def _decode(self, token: int) -> np.ndarray:
        return self._timed_window(np.asarray([token], dtype=np.int64))[-1]

    def _window(self, tokens: np.ndarray) -> np.ndarray:
        """T positions as one cache window when T fits `config.window`, else through the prompt
        path (chunks, several passes where a layer's union does not fit)."""
        if len(tokens) <= self.cache_config.window:
            return self._timed_window(tokens)
        return self._prompt(tokens, all_logits=True)

    def _truncate(self, n: int) -> None:
        self.compute.trim(n)  # the arena keeps its experts: a new prompt finds them resident

    def kept_position(self, n: int) -> int:
        return self.compute.kept_position(super().kept_position(n))

    def _cache_totals(self) -> CacheStats:
        return self.streamer.totals

    def _prompt(self, tokens: np.ndarray, *, all_logits: bool) -> np.ndarray:
        before = self.streamer.totals
        start = time.perf_counter()
        logits = prefill_chunks(self, tokens, all_logits=all_logits)
        led = self._ledger
        counts = stats_delta(self.streamer.totals, before)
        self._ledger = dataclasses.replace(
            led, prompt_counts=stats_sum(led.prompt_counts, counts), prompt_tokens=led.prompt_tokens + len(tokens),
            prompt_s=led.prompt_s + time.perf_counter() - start)
        return logits

    def _timed_window(self, tokens: np.ndarray) -> np.ndarray:
        before, times = self.streamer.totals, self._turn_times()
        rows_before = self.ngram_rows.stats() if self.ngram_rows is not None else None
        start = time.perf_counter()
        logits = self.window(tokens)
        led = self._ledger
        if rows_before is not None:
            led = dataclasses.replace(led, ple_rows=led.ple_rows.plus(self.ngram_rows.stats().minus(rows_before)))
        now = self._turn_times()
        self._ledger = dataclasses.replace(
            led, decode_counts=stats_sum(led.decode_counts, stats_delta(self.streamer.totals, before)),
            decode_tokens=led.decode_tokens + len(tokens), decode_s=led.decode_s + time.perf_counter() - start,
            host_s=led.host_s + now[0] - times[0], waiting_s=led.waiting_s + now[1] - times[1],
            after_s=led.after_s + now[2] - times[2])
        return logits

    def _turn_times(self) -> tuple[float, float, float]:
        t = self.streamer.times
        return t.host, t.waiting, t.after

    # -------------------------------------------------------- the loop

    def _clock(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self.phase_s[phase] += now - start
        return now

    def window(self, tokens: np.ndarray) -> np.ndarray:
        """One decode window over `tokens` (T <= config.window positions). A pipeline stage
        that does not embed takes the hidden state as `tokens`; one that does not head returns it.

        Shapes:
            tokens: [T] (or hidden [T, D]) -> logits float32 [T, V] (or hidden [T, D])
        """
        s, c, cfg, conf = self.streamer, self.compute, self.model.cfg, self.config
        s.begin_window()
        if self.ngram_rows is not None:  # PLE: the exact read-ahead, every PLE layer's rows before layer 0
            self.ngram_rows.read_ahead(self._tokens, tokens)
        x = c.embed(tokens) if self.stage.embeds else tokens
        moe = 0
        for layer in self.stage.layers:
            kind = cfg.kinds[layer]
            t0 = time.perf_counter()
            x = c.mixer(layer, x, window=True)  # a recurrent layer keeps a snapshot per position
            t0 = self._clock("attention", t0)
            if kind.ffn is Ffn.DENSE:
                x = c.dense_ffn(layer, x)
                self._clock("dense", t0)
                continue
            m, moe = moe, moe + 1
            h = c.router_input(layer, x)
            selections = self.selector.select(m, c.router_logits(layer, h), s.resident_mask(m))
            t0 = self._clock("route", t0)
            uses: list[Use] = []
            shared: list = []
            overlap = (lambda: shared.append(c.shared(layer, h))) if conf.shexp_overlap else None
            s.at_layer(m, union_in_rank_order(selections), on_use=uses.append, overlap=overlap)
            t0 = self._clock("turn", t0)
            # A synchronous backend (numpy: `routed` returns when the experts are computed) has
            # its hand-off before `routed`, so the split turn's AfterLayer(m) runs there, and
            # the next MoE layer's read-aheads land during layer l's routed experts instead of
            # only during the next layer's mixer (docs/perf.md: late read-aheads 2,700 -> 0).
            # Same events in the same order, so the same decisions: the slots Use(m) handed over
            # are pinned for the window, never read-ahead victims. An asynchronous backend
            # (MLX: `routed` ends in async_eval) hands off after `routed`, as before.
            early = not conf.split_turn or c.synchronous
            if early:  # the old order (timed as host) or a synchronous backend's hand-off
                self.after_layer(m, h, in_turn=not conf.split_turn)
                t0 = self._clock("after", t0)
            slots, weights = slots_for(selections, uses[0])
            part = c.routed(layer, h, slots, weights)
            t0 = self._clock("routed", t0)
            if not early:  # compute is handed off: the host's bookkeeping runs beside it
                self.after_layer(m, h)
                t0 = self._clock("after", t0)
            if not shared:
                shared.append(c.shared(layer, h))
                t0 = self._clock("shared", t0)
            x = c.combine(x, [part], shared[0])
            self._clock("combine", t0)
        if not self.stage.heads:
            return x
        t0 = time.perf_counter()
        logits = c.head(x)
        self._clock("head", t0)
        self.dump(logits)
        return logits

    def after_layer(self, m: int, h, *, in_turn: bool = False) -> None:
        """AfterLayer(m) with the read-ahead guesses for MoE layer m+1 (and m+2 with prefetch2),
        from this layer's router input h and those layers' (Q8_0) routers."""
        k, layers = self.config.prefetch, self.moe_layers
        g1 = g2 = ()
        if k and m + 1 < len(layers):
            g1 = self._guesses(m + 1, h, k)
        if k and self.config.prefetch2 and m + 2 < len(layers):
            g2 = self._guesses(m + 2, h, k)
        self.streamer.after_layer(m, g1, g2, in_turn=in_turn)

    def _guesses(self, m: int, h, k: int) -> tuple[int, ...]:
        """k read-ahead guesses for MoE layer m (ranked by its own rule: a sigmoid rule adds its bias)."""
        layer = self.moe_layers[m]
        try:
            return self.selector.guesses(self.compute.guess_logits(layer, h), k, m)
        except NonFiniteError as e:  # the guessed layer's router is what produced them
            raise NonFiniteError(f"layer {layer}: {e} (its read-ahead guess)") from None

    def dump(self, logits: np.ndarray) -> None:
        """Append every position's logits to `config.logpos` (for KLD), when set."""
        if self._logpos is not None:
            try:
                self._logpos.write(np.ascontiguousarray(logits, dtype=np.float32).tobytes())
                self._logpos.flush()
            except OSError as e:  # a full disk (/dev/full), a revoked mount: the field, not a traceback
                raise ConfigError(f"logpos {self.config.logpos}: cannot write ({e.strerror or e}); "
                                  "name a file on a disk with room") from None

    @property
    def dumping(self) -> bool:
        return self._logpos is not None

    # -------------------------------------------------------- report / lifetime

    def ledger(self) -> Ledger:
        """The running totals now (pass one to `report(since=...)` for a run's own report)."""
        return dataclasses.replace(self._ledger, phase_s=tuple(self.phase_s.items()), paging=paging_snapshot())

    def report(self, since: Ledger | None = None) -> StreamReport:
        """The stream report of the decode windows since `since` (default: the engine's life),
        with what the system paged meanwhile (major faults, page-ins, swap)."""
        now = self.ledger()
        led = now if since is None else now.minus(since)
        paging = PagingDelta.between(since.paging if since is not None else self._paging0, now.paging)
        io = self.io.note + "".join(f"; {n}" for n in self.notes)
        return build_report(
            decode=asdict(led.decode_counts), tokens=led.decode_tokens, seconds=led.decode_s, host_s=led.host_s,
            waiting_s=led.waiting_s, after_s=led.after_s, slot_bytes=self.arena.slot_bytes,
            read_bytes=self.model.experts_file.read_bytes_per_record,
            arena_slots=self.arena.capacity, io=io, policy=self.selector.policy.describe(),
            prompt_tokens=led.prompt_tokens, prompt_s=led.prompt_s,
            prompt_reads=led.prompt_counts.reads_issued,
            profile=dict(led.phase_s) if self.config.profile else None, paging=paging,
            **led.ple_rows.report_args())

    def close(self) -> None:
        if not self._closed:
            super().close()
            self.io.close()
            if self.ngram_rows is not None:
                self.ngram_rows.close()
            if self._logpos is not None:
                try:
                    self._logpos.close()
                except OSError:  # the rows it could not flush: their write was refused when it failed (dump)
                    pass
