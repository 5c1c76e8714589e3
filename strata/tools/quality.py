"""What MoCE costs in quality, measured in decode order (design §8, ANCHORS: "score quality step
by step in decode order, never a whole batch at once").

A text is fed one token at a time with the KV cache, twice: the reference run routes with the
model's own rule (λ = 0); the policy run routes every (token, layer) through the closed loop
(`ClosedLoop`: MoCE against the residency the cache machine holds at that moment, then the
machine takes the turn and reads ahead from W_router(l+1)·h(l)). Both runs go through the same
`decode_token` with the same ops in the same order, so at λ = 0 their logits are bit-identical
and the KLD is exactly 0. `ops` (strata.numpy_backend.quant_kernels.CpuOps) are the products the
numpy engine computes with: the float32 reference's by default, or the compiled CPU kernels
(`tool_ops` in strata.tools.options: what `generate` would use), and then the loop computes what
the streaming runtime computes bit for bit (its dense view, its grouped experts).

Measured, over positions from `warmup` on:
- KLD(P_ref || P_policy) of the next-token distributions: mean, p90, p99, max;
- routed-output error: at every (token, layer) of the policy run, the routed output of the
  policy's selection vs the λ = 0 selection of the same logits on the same input, with exact
  expert weights: relMSE = Σ‖y_p − y_0‖² / Σ‖y_0‖², rel-L2 = √relMSE (the reference engine's pair);
- perplexity of the text under both runs;
- the policy run's cache counts (urgent misses etc.), closed loop including hidden-state drift.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from strata.formats.expert_record import ExpertWeights
from strata.formats.quant_matrix import QuantMatrix
from strata.formats.quant_types import QuantType
from strata.cache.types import CacheStats, stats_delta
from strata.model_config import Ffn, TensorNames
from strata.numpy_backend.prompt import grouped_moe_output
from strata.numpy_backend.quant_kernels import REFERENCE_OPS, CpuOps
from strata.reference.experts import expert_act
from strata.reference.model import (
    ExpertSource, ModelParams, ModelState, dense_ffn_output, embed, head, layer_router_logits, mixer_block,
    router_input, router_rule, router_rules,
)
from strata.reference.quants import dequantize
from strata.reference.routing import Selection, route
from strata.reference.sampling import log_softmax
from strata.tools.closed_loop import ClosedLoop, GuessRouters, LoopConfig

__all__ = ["DequantizedExperts", "engine_params", "decode_token", "RunOutput", "run_decode", "QualityResult", "quality",
           "kld_rows", "DEQUANT_CACHE_BYTES"]

DEQUANT_CACHE_BYTES = 2 << 30  # float32 copies of experts kept for speed (an LRU of this many bytes)

# (layer, selection, router input h [1, D], logits z [E]) after the layer's MoE output is known
Observer = Callable[[int, Selection, np.ndarray, np.ndarray], None]


class DequantizedExperts:
    """An ExpertSource serving float32 copies of another's experts (dequantized once, LRU-bounded).

    The reference gemv is `x @ dequantize(W).T`; an F32 matrix of the same values dequantizes
    to the same array, so every expert output is bit-identical to the quantized source's and
    the ~0.7 ms dequantization per expert call is paid once.
    """

    def __init__(self, source: ExpertSource, max_bytes: int = DEQUANT_CACHE_BYTES) -> None:
        self.source = source
        self.max_bytes = max_bytes
        self._cache: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        self._bytes = 0

    @staticmethod
    def _f32(m: QuantMatrix) -> QuantMatrix:
        if m.qtype is QuantType.F32:
            return m
        values = np.ascontiguousarray(dequantize(m), dtype=np.float32)  # [rows, cols]
        return QuantMatrix(QuantType.F32, m.n_rows, m.n_cols, values.view(np.uint8),
                           np.zeros((m.n_rows, 0), np.float16))

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        w = self._cache.get(key)
        if w is not None:
            self._cache.move_to_end(key)
            return w
        src = self.source.expert(layer, expert)
        w = ExpertWeights(self._f32(src.gate), self._f32(src.up), self._f32(src.down))
        size = sum(m.codes.nbytes for m in (w.gate, w.up, w.down))
        self._cache[key] = w
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._bytes -= sum(m.codes.nbytes for m in (old.gate, old.up, old.down))
        return w


def engine_params(params: ModelParams, ops: CpuOps = REFERENCE_OPS) -> ModelParams:
    """`params` as a numpy engine on `ops` computes with them: the dense weights through `ops`'
    view (whose `linear` is the engine's dense product) and, where the products are compiled,
    the stored experts (the kernels read their blocks; `DequantizedExperts`' float32 copies
    have no kernel and would take the reference's products). Idempotent."""
    experts = params.experts
    if ops.compiled and isinstance(experts, DequantizedExperts):
        experts = experts.source
    return ModelParams(params.cfg, ops.dense(params.dense), experts, rows=params.rows)


def decode_token(params: ModelParams, state: ModelState, token: int, select: Callable[[int, np.ndarray], Selection],
                 observe: Observer | None = None, *, ops: CpuOps = REFERENCE_OPS) -> tuple[np.ndarray, ModelState]:
    """One decode step through the public layer pieces, exactly `forward(params, state, [token],
    select=select)`'s ops in its order (tests/tools/test_tools_quality.py checks the bits), with a hook
    after each layer's MoE that sees the router input h (for the read-ahead guess). The routed
    experts are the numpy engines' (`grouped_moe_output` on `ops`: with the reference's ops,
    `moe_output`'s arithmetic); the dense products are `params.dense.linear` (`engine_params`).

    Shapes: -> logits float32 [vocab]
    """
    x = embed(params, np.array([token], np.int64))  # [1, D]
    layers, cfg = [], params.cfg
    for layer, kind in enumerate(cfg.kinds):
        x, layer_state = mixer_block(params, layer, state.layers[layer], x)
        layers.append(layer_state)
        h = router_input(params, layer, x)  # [1, D]
        if kind.ffn is Ffn.DENSE:
            x = x + dense_ffn_output(params, layer, h)
            continue
        m = cfg.moe_index(layer)  # the hooks and the cache count MoE layers
        z = layer_router_logits(params, layer, h)  # [1, E]
        sel = select(m, z[0])
        moe = grouped_moe_output(params, layer, h, [sel], ops=ops)
        if observe is not None:
            observe(m, sel, h, z[0])
        x = x + moe
    return head(params, x)[0], ModelState(tuple(layers))


@dataclass(frozen=True, eq=False)
class RunOutput:
    """One teacher-forced decode-order run. logits float32 [T, vocab]."""

    logits: np.ndarray = field(repr=False)
    stats: CacheStats | None = None  # policy run: the cache counts after the warm-up
    err_num: float = 0.0  # Σ‖y_p − y_0‖² over counted (token, layer)
    err_den: float = 0.0  # Σ‖y_0‖²
    changed: int = 0  # counted (token, layer) whose selection differs from λ = 0
    turns: int = 0  # counted (token, layer)


def _routed(params: ModelParams, layer: int, sel: Selection, h: np.ndarray, memo: dict,
            ops: CpuOps = REFERENCE_OPS) -> np.ndarray:
    """Σ w_i expert_i(h) in rank order (routed_experts' sum), expert outputs memoized per layer."""
    out = np.zeros(h.shape[-1], np.float32)
    for e, w in zip(sel.experts.tolist(), np.asarray(sel.weights, np.float32)):
        y = memo.get(e)
        if y is None:
            y = memo[e] = ops.expert(params.experts.expert(layer, e), h, expert_act(params.cfg))
        out += w * y
    return out


def run_decode(params: ModelParams, tokens, *, config: LoopConfig | None = None, warmup: int = 0,
               progress: Callable[[int], None] | None = None, ops: CpuOps = REFERENCE_OPS) -> RunOutput:
    """Feed `tokens` one at a time. config None: the reference (λ = 0, no cache). Otherwise the
    closed loop under `config`, with the routed-output error vs λ = 0 measured on the way.
    ops: the products (the module's docstring)."""
    params = engine_params(params, ops)
    cfg = params.cfg
    rule, rules = router_rule(cfg), router_rules(cfg, params.dense)  # rules: per MoE layer (selection biases)
    tokens = np.asarray(tokens, np.int64)
    loop = ClosedLoop(config, rule, cfg.n_moe_layers, cfg.n_experts, rules) if config is not None else None
    acc = {"num": 0.0, "den": 0.0, "changed": 0, "turns": 0}
    counting = [False]

    guess = None
    if config is not None and config.prefetch_depth:
        guess = GuessRouters([params.dense[TensorNames.block(l, TensorNames.router)] for l in cfg.moe_layers],
                             pred_q8=config.pred_q8)

    def observe(layer: int, sel: Selection, h: np.ndarray, z: np.ndarray) -> None:
        nxt = lambda a: guess.logits(layer + a, h) if guess is not None and layer + a < cfg.n_moe_layers else None  # noqa: E731
        loop.after(layer, nxt(1), nxt(2) if config.prefetch2 else None)
        if counting[0]:
            ref = route(z, rules[layer])
            memo: dict = {}
            y0 = _routed(params, layer, ref, h[0], memo, ops)
            same = np.array_equal(ref.experts, sel.experts) and np.array_equal(ref.weights, sel.weights)
            yp = y0 if same else _routed(params, layer, sel, h[0], memo, ops)
            acc["num"] += float(np.sum((yp.astype(np.float64) - y0) ** 2))
            acc["den"] += float(np.sum(y0.astype(np.float64) ** 2))
            acc["changed"] += int(not same)
            acc["turns"] += 1

    if loop is None:
        select, hook = (lambda layer, z: route(z, rules[layer])), None
    else:
        select, hook = loop.route, observe
    state = ModelState.empty(cfg)
    rows, before = [], None
    for t, tok in enumerate(tokens.tolist()):
        if loop is not None:
            if t == warmup:
                before, counting[0] = loop.totals(), True
            loop.begin_token()
        logits, state = decode_token(params, state, tok, select, hook, ops=ops)
        rows.append(logits)
        if progress is not None:
            progress(t)
    stats = stats_delta(loop.totals(), before) if loop is not None and before is not None else None
    return RunOutput(np.stack(rows), stats, acc["num"], acc["den"], acc["changed"], acc["turns"])


def kld_rows(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(P_ref || P) per row, in float64 from float32 log-probabilities (identical rows give
    exactly 0). Shapes: [T, V], [T, V] -> [T]"""
    lp_ref = log_softmax(ref_logits).astype(np.float64)
    lp = log_softmax(logits).astype(np.float64)
    return np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1)


def _perplexity(logits: np.ndarray, tokens: np.ndarray, start: int) -> float:
    """exp of the mean negative log-likelihood of tokens[t+1] at positions start..T-2."""
    if len(tokens) - 1 <= start:
        return float("nan")
    lp = log_softmax(logits[start:-1]).astype(np.float64)  # [T', V]
    nll = -lp[np.arange(len(lp)), tokens[start + 1:]]
    return float(np.exp(nll.mean()))


@dataclass(frozen=True)
class QualityResult:
    config: LoopConfig
    positions: int  # positions scored (after the warm-up)
    kld_mean: float
    kld_p90: float
    kld_p99: float
    kld_max: float
    relmse: float
    rel_l2: float
    changed_fraction: float  # (token, layer) turns whose selection differs from λ = 0
    ppl_ref: float
    ppl: float
    stats: CacheStats

    @property
    def urgent_per_token(self) -> float:
        return self.stats.urgent_misses / self.positions if self.positions else float("nan")

    def to_json(self) -> dict:
        s, n = self.stats, max(self.positions, 1)
        return {
            "label": self.config.label, **self.config.to_json(), "positions": self.positions,
            "kld_mean": self.kld_mean, "kld_p90": self.kld_p90, "kld_p99": self.kld_p99, "kld_max": self.kld_max,
            "relmse": self.relmse, "rel_l2": self.rel_l2, "changed_fraction": self.changed_fraction,
            "ppl_ref": self.ppl_ref, "ppl": self.ppl, "urgent_per_token": self.urgent_per_token,
            "readahead_hits_per_token": s.readahead_hits / n, "reads_per_token": s.reads_issued / n,
            "misses_by_rank_per_token": [m / n for m in s.urgent_misses_by_rank],
        }


def quality(params: ModelParams, tokens, config: LoopConfig, *, warmup: int = 0,
            reference: RunOutput | None = None, progress=None, ops: CpuOps = REFERENCE_OPS) -> QualityResult:
    """Score `config` against λ = 0 on `tokens` (teacher-forced, decode order). Pass the
    `reference` run (`run_decode(params, tokens, ops=ops)`) to reuse it across policies."""
    tokens = np.asarray(tokens, np.int64)
    if not 0 <= warmup < len(tokens):
        raise ValueError(f"warmup {warmup} must leave positions to score (text has {len(tokens)} tokens)")
    ref = reference if reference is not None else run_decode(params, tokens, progress=progress, ops=ops)
    run = run_decode(params, tokens, config=config, warmup=warmup, progress=progress, ops=ops)
    kl = kld_rows(ref.logits[warmup:], run.logits[warmup:])
    relmse = run.err_num / run.err_den if run.err_den > 0 else 0.0
    return QualityResult(
        config=config, positions=len(tokens) - warmup, kld_mean=float(kl.mean()),
        kld_p90=float(np.percentile(kl, 90)), kld_p99=float(np.percentile(kl, 99)), kld_max=float(kl.max()),
        relmse=relmse, rel_l2=float(np.sqrt(relmse)),
        changed_fraction=run.changed / run.turns if run.turns else 0.0,
        ppl_ref=_perplexity(ref.logits, tokens, warmup), ppl=_perplexity(run.logits, tokens, warmup),
        stats=run.stats,
    )


def fast_params(params: ModelParams, max_bytes: int = DEQUANT_CACHE_BYTES) -> ModelParams:
    """`params` with experts served dequantized once (bit-identical outputs, much faster)."""
    if isinstance(params.experts, DequantizedExperts):
        return params
    return ModelParams(params.cfg, params.dense, DequantizedExperts(params.experts, max_bytes), rows=params.rows)
