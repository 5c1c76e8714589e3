"""Tier2Engine: the Engine protocol over mlx-lm's forward and KV cache, experts streamed.

mlx-lm's model runs the layer loop; each streamed switch layer takes its MoE layer's cache turn
(strata.tier2.switch), so the runtime's streamer, cache machine and reader pool do what they do
for native models: the same decisions from the same turns whatever the I/O timing, the same
stream report. Prompts follow mlx-lm's own schedule (`generate_step`): every position but the
last in chunks of PREFILL_STEP inside a held region, then the last position alone, so the logits
are the ones mlx-lm's own generate computes. The engine's logits are mlx-lm's log-probabilities
as its sampler sees them (`_scores`), so greedy decoding picks mlx-lm's tokens. Decode windows of
up to `config.window` positions are one cache window; a longer window runs as prompt chunks.

At full residency (the budget rule: every expert fits) the arena has a slot per expert and each
is read once, on first use. KV caches that cannot be trimmed (recurrent layers) restore only
their full length or nothing (`kept_position`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict

import numpy as np

from strata.cache.types import CacheConfig, stats_delta, stats_sum
from strata.config import Backend, Config
from strata.reference.attention import KVPrecision
from strata.errors import ArenaTooSmallError, ConfigError
from strata.runtime.decode import Ledger
from strata.runtime.memory import PagingDelta, paging_snapshot
from strata.runtime.report import StreamReport, build_report
from strata.runtime.streamer import Streamer
from strata.session import SessionEngine
from strata.tier2.arena import PieceArena
from strata.tier2.moce import check_moce, moce_gates
from strata.tier2.plan import arena_plan, cache_config
from strata.tier2.reader import ShardReaderPool
from strata.tier2.switch import ExpertStream

__all__ = ["Tier2Engine", "cache_config_for", "arena_plan_for", "check_tier2_config", "PREFILL_STEP"]

PREFILL_STEP = 2048  # mlx-lm's generate_step default (prefill_step_size): the same chunks, the same logits


def cache_config_for(model, config: Config, capacity: int) -> CacheConfig:
    cfg = model.cfg
    return cache_config(cfg.n_moe_layers, cfg.n_experts, cfg.n_experts_per_token, config, capacity)


def arena_plan_for(model, config: Config):
    """`--arena` or the budget rule over the model's experts (a slot per expert when all fit):
    strata.tier2.plan's rule, the one `strata doctor` predicts with."""
    return arena_plan(tensors=model.tensors, top_k=model.cfg.n_experts_per_token, dense_bytes=model.dense_bytes,
                      config=config)


def check_tier2_config(config: Config, model_type: str | None = None) -> None:
    """Refuse, in one line, a setting tier 2 would otherwise ignore: it runs mlx-lm's forward on
    MLX with the family's own routing (MoCE only where strata.tier2.moce replaces the gate) and
    mlx-lm's KV cache. `model_type`: the checkpoint's (None: not known yet)."""
    check_moce(config.moce_policy(), model_type)
    if config.backend is Backend.NUMPY:
        raise ConfigError("--backend numpy: tier 2 runs mlx-lm's model files on MLX; the numpy engines need a "
                          "converted model (`strata convert DIR OUT`)")
    if config.kv_cache is not KVPrecision.F32:
        raise ConfigError(f"--kv-cache {config.kv_cache.value}: tier 2 keeps mlx-lm's own KV cache; leave it at f32")
    if config.logpos:
        raise ConfigError("--logpos: not on tier 2 yet (the logit dump is the native engines')")
    if config.layer_pins:
        raise ConfigError("layer_pins: tier 2 computes a window's layers on MLX after the turns; set "
                          "layer_pins=off (the numpy engines of a converted model take it)")


class Tier2Engine(SessionEngine):
    """mlx-lm's model with its switch layers streamed through an arena of `capacity` slots."""

    kind = "tier 2 (mlx-lm)"

    def __init__(self, model, config: Config, capacity: int, *, hook=None, keep_trace: bool = False,
                 reason: str = "") -> None:
        super().__init__(model, config)
        from mlx_lm.models.cache import make_prompt_cache

        check_tier2_config(config, model.cfg.model_type)
        self.cache_config = cache_config_for(model, config, capacity)
        least = self.cache_config.min_capacity
        if capacity < least:
            raise ArenaTooSmallError(f"arena of {capacity} slots cannot hold one window's selections of every MoE "
                                     f"layer plus the read-ahead depth: needs at least {least} slots")
        self.arena = PieceArena(capacity, model.tensors)
        self.io = ShardReaderPool(model.tensors, self.arena, threads=config.io_threads, verify=config.verify_reads,
                                  timeout=config.io_timeout, hook=hook, switch_interval=config.io_switch_ms / 1e3)
        try:
            self.streamer = Streamer(self.cache_config, self.io, keep_trace=keep_trace, moce_pre=config.moce_pre,
                                     reference=config.reference_cache)
            self.stream = ExpertStream(self.streamer, model.scorers, prefetch=config.prefetch,
                                       prefetch2=config.prefetch2, split_turn=config.split_turn)
            self.policy = config.moce_policy()
            # MoCE: the family's gates replaced by ones that route with the cache's residency
            self.gates = None if self.policy.exact else moce_gates(model, self.policy, self.streamer)
            model.install(self.arena, self.stream, self, gates=self.gates)
        except BaseException:
            self.io.close()
            raise
        self._new_cache = lambda: make_prompt_cache(model.mlx_model)
        self.kv = self._new_cache()
        unguessed = sum(s is None for s in model.scorers[1:])
        self.notes = (model.why(), f"arena from {reason}" if reason else "arena as asked") + (
            (f"no read-ahead into {unguessed} MoE layers (their gate is of an unknown form)",) if unguessed else ())
        self._ledger = Ledger()
        self._paging0 = paging_snapshot()

    @classmethod
    def open(cls, model, config: Config, *, stream: bool | None = None, plan=None, hook=None,
             keep_trace: bool = False) -> "Tier2Engine":
        """The engine strata.engines.open_engine gives a Tier2Model: an arena of `plan.slots`
        slots (`--arena` or the budget rule), or a slot per expert where every expert fits or
        `stream` is False (full residency through the same layer: each expert read once)."""
        check_tier2_config(config, model.cfg.model_type)  # before the plan: a setting tier 2 ignores is said first
        plan = plan or arena_plan_for(model, config)
        capacity = plan.slots if plan.streaming else max(plan.total_experts, plan.min_slots)
        if stream is False:
            capacity = max(plan.total_experts, plan.min_slots)
        return cls(model, config, capacity, hook=hook, keep_trace=keep_trace, reason=plan.reason)

    # -------------------------------------------------------- forward

    def _forward(self, tokens: np.ndarray) -> "object":
        import mlx.core as mx

        if self.model.installed is not self:  # another engine over this model ran since
            self.model.install(self.arena, self.stream, self, gates=self.gates)
        return self.model.mlx_model(mx.array(tokens, dtype=mx.int32)[None], cache=self.kv)

    @staticmethod
    def _scores(logits) -> np.ndarray:
        """mlx-lm's next-token scores as its generate_step hands them to its sampler: the logits
        minus their logsumexp, in the model's dtype (bfloat16 rounding there can tie two tokens
        that the logits order, so argmax over these is mlx-lm's own greedy choice).
        Shapes: [1, T, V] -> float32 [T, V]"""
        import mlx.core as mx

        rows = logits[0]
        return np.array((rows - mx.logsumexp(rows, axis=-1, keepdims=True)).astype(mx.float32))

    def _held_chunks(self, tokens: np.ndarray, *, keep_logits: bool) -> list:
        """`tokens` as prompt chunks of PREFILL_STEP positions inside a held region; each chunk's
        logits [T, V] when keep_logits."""
        import mlx.core as mx

        s, rows = self.streamer, []
        s.hold_region(True)
        self.stream.held = True
        try:
            for start in range(0, len(tokens), PREFILL_STEP):
                s.begin_window()
                logits = self._forward(tokens[start:start + PREFILL_STEP])
                mx.eval([c.state for c in self.kv])
                if keep_logits:
                    rows.append(self._scores(logits))
        finally:
            self.stream.held = False
        s.hold_region(False)
        return rows

    def _one_window(self, tokens: np.ndarray) -> np.ndarray:
        self.streamer.begin_window()
        return self._scores(self._forward(tokens))

    def _prefill(self, tokens: np.ndarray) -> np.ndarray:
        before, start = self.streamer.totals, time.perf_counter()
        if len(tokens) > 1:
            self._held_chunks(tokens[:-1], keep_logits=False)
        logits = self._one_window(tokens[-1:])[-1]
        led = self._ledger
        self._ledger = dataclasses.replace(
            led, prompt_counts=stats_sum(led.prompt_counts, stats_delta(self.streamer.totals, before)),
            prompt_tokens=led.prompt_tokens + len(tokens), prompt_s=led.prompt_s + time.perf_counter() - start)
        return logits

    def _decode(self, token: int) -> np.ndarray:
        return self._timed(np.asarray([token], np.int64))[-1]

    def _window(self, tokens: np.ndarray) -> np.ndarray:
        return self._timed(tokens)

    def _timed(self, tokens: np.ndarray) -> np.ndarray:
        s = self.streamer
        before, t0 = s.totals, (s.times.host, s.times.waiting, s.times.after)
        start = time.perf_counter()
        if len(tokens) <= self.cache_config.window:
            logits = self._one_window(tokens)
        else:
            logits = np.concatenate(self._held_chunks(tokens, keep_logits=True))
        led = self._ledger
        self._ledger = dataclasses.replace(
            led, decode_counts=stats_sum(led.decode_counts, stats_delta(s.totals, before)),
            decode_tokens=led.decode_tokens + len(tokens), decode_s=led.decode_s + time.perf_counter() - start,
            host_s=led.host_s + s.times.host - t0[0], waiting_s=led.waiting_s + s.times.waiting - t0[1],
            after_s=led.after_s + s.times.after - t0[2])
        return logits

    # -------------------------------------------------------- session

    def _trimmable(self) -> bool:
        from mlx_lm.models.cache import can_trim_prompt_cache

        return can_trim_prompt_cache(self.kv)

    def kept_position(self, n: int) -> int:
        n = super().kept_position(n)
        return n if n in (0, self.length) or self._trimmable() else 0

    def _truncate(self, n: int) -> None:
        from mlx_lm.models.cache import trim_prompt_cache

        if n == 0:
            self.kv = self._new_cache()
        elif self._trimmable():
            trim_prompt_cache(self.kv, self.length - n)
        else:
            raise ConfigError(f"trim to {n} of {self.length}: this model's recurrent layers keep no snapshots "
                              "(kept_position says which positions can be restored)")

    def _cache_totals(self):
        return self.streamer.totals

    def _expert_reads(self) -> int:
        return self.io.reads_done

    # -------------------------------------------------------- report / lifetime

    def ledger(self) -> Ledger:
        return dataclasses.replace(self._ledger, paging=paging_snapshot())

    def report(self, since: Ledger | None = None) -> StreamReport:
        now = self.ledger()
        led = now if since is None else now.minus(since)
        paging = PagingDelta.between(since.paging if since is not None else self._paging0, now.paging)
        return build_report(
            decode=asdict(led.decode_counts), tokens=led.decode_tokens, seconds=led.decode_s, host_s=led.host_s,
            waiting_s=led.waiting_s, after_s=led.after_s, slot_bytes=self.arena.slot_bytes,
            arena_slots=self.arena.capacity, io=self.io.note + "".join(f"; {n}" for n in self.notes),
            policy=(self.policy.describe() + " (tier 2: strata's rule in the family's gate)" if self.gates
                    else "the family's own routing (λ = 0, exact)"),
            prompt_tokens=led.prompt_tokens, prompt_s=led.prompt_s,
            prompt_reads=led.prompt_counts.reads_issued, paging=paging)

    def close(self) -> None:
        if not self._closed:
            super().close()
            self.io.close()
