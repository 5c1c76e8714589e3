"""Routing traces: what the routers saw on a text, saved as one self-contained `.npz`.

A trace holds, for every token × layer, the router input h = rms_norm(x) (the reference engine's dump of
router inputs), the router logits z = W_router(l)·h(l) as the forward pass computed them, the
routers themselves, the model's rule (with each MoE layer's selection bias for sigmoid-routed
models: the rule is then per layer) and its own (λ = 0) selections. That is all the replay and recall
tools need (the read-ahead guesses W_router(l+1)·h(l) are recomputed from it), so they never
need the model files.

A tier-2 model's trace (strata.tools.tier2_trace) records the family's own routing instead:
mlx-lm's gate modules are of many forms (quantized, biased, grouped, sqrt-softplus, ...) that no
RouterRule re-derives, so it holds the selections the family's gate made (`family_routing`), the
read-ahead scores each next gate gave on this layer's input exactly as the tier-2 runtime ranks
them (`guesses`), and no router matrices (router inputs and routers of width 0). Replaying it
takes the recorded selections at λ = 0 (MoCE needs a native module) and the recorded guesses.

The λ = 0 router inputs are what a replay re-routes under MoCE. Under a bonus the real hidden
states drift from them (a swapped expert changes the residual stream); the replay ignores that
drift, as the reference engine's replay did. `strata quality` runs the model itself, in decode order, and
measures misses with the drift included.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata.errors import ConfigError, FormatError
from strata.model_config import RoutingOrder, TensorNames
from strata.numpy_backend.quant_kernels import REFERENCE_OPS, CpuOps
from strata.reference.model import ModelParams, ModelState, forward, plain_select, router_rule
from strata.reference.routing import RouterRule, Selection, route
from strata.tools.closed_loop import GuessRouters
from strata.tools.quality import decode_token, engine_params

__all__ = ["Trace", "record_trace", "save_trace", "load_trace", "TRACE_VERSION"]

TRACE_VERSION = 3  # 3: tier 2's family routing and recorded guesses; 2: the rule's groups and scaling, and
_READ_VERSIONS = (1, 2, 3)  # per-layer selection biases (1 and 2 are still read)
_INPUT_DTYPES = {"f32": np.float32, "f16": np.float16}


@dataclass(frozen=True, eq=False)
class Trace:
    """One text's routing, token by token.

    Shapes:
        tokens:        int64 [T]
        router_inputs: float32 or float16 [T, L, D]   h(t, l), the input of layer l's router
        routers:       float32 [L, E, D]              W_router(l)
        logits:        float32 [T, L, E]              z(t, l) exactly as the forward pass computed it
        selected:      int64 [T, L, k]                the model's own selection, rank order
        weights:       float32 [T, L, k]              its combine weights
        biases:        float32 [L, E] or None         each layer's selection bias (SIGMOID_TOPK)
        guesses:       {a: float32 [T, L - a, E]}     recorded read-ahead scores for layer l+a after
                                                      layer l (tier 2); empty: computed from routers

    `rules` are the per-layer rules (`rule` with each layer's bias): what routing, the replay
    and `reroute_check` use. `family_routing` (tier 2): `selected` is the family's own routing,
    which `rule` does not re-derive from `logits` (those are its gate's selection scores, NaN
    where the gate is of a form tier 2 does not score); `weights` are NaN (not recorded).
    """

    tokens: np.ndarray
    router_inputs: np.ndarray
    routers: np.ndarray
    logits: np.ndarray
    selected: np.ndarray
    weights: np.ndarray
    rule: RouterRule
    meta: dict = field(default_factory=dict)
    biases: np.ndarray | None = field(default=None, repr=False)
    guesses: dict = field(default_factory=dict, repr=False)
    family_routing: bool = False

    def __post_init__(self) -> None:
        if self.biases is None:
            rules = (self.rule,) * self.n_layers
        else:
            rules = tuple(self.rule.for_layer(b) for b in np.asarray(self.biases, np.float32))
        object.__setattr__(self, "_rules", rules)

    @property
    def rules(self) -> tuple[RouterRule, ...]:
        return self._rules

    @property
    def n_tokens(self) -> int:
        return int(self.router_inputs.shape[0])

    @property
    def n_layers(self) -> int:
        return int(self.routers.shape[0])

    @property
    def n_experts(self) -> int:
        return int(self.routers.shape[1])

    @property
    def top_k(self) -> int:
        return self.rule.k

    def guess_logits(self, ahead: int, *, pred_q8: bool = False) -> np.ndarray:
        """The read-ahead guess after layer l for layer l+ahead: W_router(l+ahead) · h(t, l),
        one [1, D] row at a time as decoding computes it (so it is bit-identical to the
        runtime's guess; a [T, D] matmul may round differently). `pred_q8`: on the Q8_0 copy.

        A trace with recorded guesses (tier 2) returns those: they are the scores the gate
        module gave, as the runtime ranked them (`pred_q8` has no meaning there).

        Shapes: -> float32 [T, L - ahead, E]; row l is the guess made after layer l.
        """
        T, L, E = self.n_tokens, self.n_layers, self.n_experts
        if ahead < 1 or ahead >= L:
            return np.zeros((T, 0, E), np.float32)
        if self.family_routing:
            if ahead not in self.guesses:
                raise ConfigError(f"this tier-2 trace recorded read-ahead scores {sorted(self.guesses)} layers "
                                  f"ahead, not {ahead}")
            return self.guesses[ahead]
        routers = GuessRouters(self.routers, pred_q8=pred_q8)
        h = self.router_inputs.astype(np.float32, copy=False)
        out = np.empty((T, L - ahead, E), np.float32)
        for t in range(T):
            for l in range(L - ahead):
                out[t, l] = routers.logits(l + ahead, h[t, l])
        return out

    def truncated(self, n_tokens: int) -> "Trace":
        """The first n_tokens tokens."""
        return Trace(self.tokens[:n_tokens], self.router_inputs[:n_tokens], self.routers, self.logits[:n_tokens],
                     self.selected[:n_tokens], self.weights[:n_tokens], self.rule, dict(self.meta), self.biases,
                     {a: g[:n_tokens] for a, g in self.guesses.items()}, self.family_routing)


def record_trace(params: ModelParams, tokens, *, input_dtype: str = "f32", decode_order: bool = True,
                 meta: dict | None = None, progress: Callable[[int], None] | None = None,
                 ops: CpuOps = REFERENCE_OPS) -> Trace:
    """Run the model over `tokens` at λ = 0 and record every router input, logit and selection.

    decode_order: one token at a time with the KV cache, as generation (and the streaming
    runtime) computes it, on the products `ops` (strata.tools.quality's docstring: the numpy
    engine's, so the trace's numbers are the runtime's bit for bit); off: one reference forward
    over the whole sequence (faster; equal up to float32 rounding). `progress(n)`: called with
    the tokens done so far after each one (decode order; once at the end otherwise).

    Shapes: tokens [T] -> Trace with T tokens
    """
    if input_dtype not in _INPUT_DTYPES:
        raise ValueError(f"trace input dtype must be one of {sorted(_INPUT_DTYPES)}, got {input_dtype!r}")
    cfg = params.cfg
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"a trace needs a non-empty token sequence, got shape {tokens.shape}")
    if decode_order:
        params, select = engine_params(params, ops), plain_select(cfg, params.dense)
        state, inputs, sels = ModelState.empty(cfg), [], []
        for tok in tokens.tolist():
            seen: list[tuple[np.ndarray, Selection]] = []  # per MoE layer: (router input [D], selection)
            _, state = decode_token(params, state, tok, select, lambda m, sel, h, z: seen.append((h[0], sel)), ops=ops)
            inputs.append(np.stack([h for h, _ in seen]))  # [L, D]
            sels.append([sel for _, sel in seen])  # L selections
            if progress is not None:
                progress(len(sels))
        h = np.stack(inputs)  # [T, L, D]
    else:
        _, _, ft = forward(params, ModelState.empty(cfg), tokens, trace=True)
        h = ft.router_inputs.transpose(1, 0, 2)  # [T, L, D]
        sels = [[ft.selections[m][t] for m in range(cfg.n_moe_layers)] for t in range(len(tokens))]
        if progress is not None:
            progress(len(sels))
    routers = np.stack([np.asarray(params.dense[TensorNames.block(l, TensorNames.router)], np.float32)
                        for l in cfg.moe_layers])  # [L, E, D]: MoE layers only
    biases = None
    if cfg.sigmoid.router_bias:  # the rules `forward` routed by (`router_rules`): one bias per MoE layer
        biases = np.stack([np.asarray(params.dense[TensorNames.block(l, TensorNames.exp_probs_b)], np.float32)
                           for l in cfg.moe_layers])  # [L, E]
    return Trace(
        tokens=tokens, router_inputs=np.ascontiguousarray(h).astype(_INPUT_DTYPES[input_dtype]), routers=routers,
        logits=np.array([[s.logits for s in row] for row in sels], np.float32),
        selected=np.array([[s.experts for s in row] for row in sels], np.int64),
        weights=np.array([[s.weights for s in row] for row in sels], np.float32),
        rule=router_rule(cfg), meta=dict(meta or {}), biases=biases,
    )


def save_trace(path: str | Path, trace: Trace) -> Path:
    """Write `trace` as an uncompressed .npz (the suffix is added when missing)."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    r = trace.rule
    header = {
        "version": TRACE_VERSION, "k": r.k, "order": r.order.name, "norm_topk_prob": r.norm_topk_prob,
        "n_group": r.n_group, "topk_group": r.topk_group, "scaling": r.scaling, "meta": trace.meta,
        "routing": "family" if trace.family_routing else "rule",
    }
    extra = {} if trace.biases is None else {"biases": np.asarray(trace.biases, np.float32)}
    extra.update({f"guesses{a}": np.asarray(g, np.float32) for a, g in trace.guesses.items()})
    np.savez(path, tokens=trace.tokens, router_inputs=trace.router_inputs, routers=trace.routers,
             logits=trace.logits, selected=trace.selected, weights=trace.weights, header=np.array(json.dumps(header)),
             **extra)
    return path


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by `save_trace` (or `strata trace`)."""
    path = Path(path)
    if not path.exists() and path.suffix != ".npz" and path.with_name(path.name + ".npz").exists():
        path = path.with_name(path.name + ".npz")
    if not path.exists():
        raise FormatError(f"{path}: no such trace file")
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(str(z["header"]))
            arrays = {k: z[k] for k in ("tokens", "router_inputs", "routers", "logits", "selected", "weights")}
            biases = z["biases"] if "biases" in z.files else None
            guesses = {int(k.removeprefix("guesses")): z[k] for k in z.files
                       if k.startswith("guesses") and k.removeprefix("guesses").isdigit()}
    except (OSError, KeyError, ValueError) as e:
        raise FormatError(f"{path}: not a strata trace ({e})") from None
    if header.get("version") not in _READ_VERSIONS:
        raise FormatError(f"{path}: trace version {header.get('version')!r}, this strata reads "
                          f"{', '.join(map(str, _READ_VERSIONS))}")
    try:  # version 1 traces have no groups, scaling or biases: the defaults are what they describe
        rule = RouterRule(int(header["k"]), RoutingOrder[header["order"]], bool(header["norm_topk_prob"]),
                          int(header.get("n_group", 1)), int(header.get("topk_group", 1)),
                          float(header.get("scaling", 1.0)))
    except (KeyError, ConfigError) as e:
        raise FormatError(f"{path}: not a strata trace (its rule: {e})") from None
    t, l, d = arrays["router_inputs"].shape
    e = arrays["routers"].shape[1]
    if (arrays["routers"].shape != (l, e, d) or arrays["selected"].shape != (t, l, rule.k)
            or arrays["logits"].shape != (t, l, e) or (biases is not None and biases.shape != (l, e))
            or any(g.shape != (t, l - a, e) for a, g in guesses.items())):
        raise FormatError(f"{path}: inconsistent trace shapes "
                          f"{ {k: v.shape for k, v in arrays.items()} }")
    try:  # the per-layer rules: biases only with SIGMOID_TOPK, finite
        return Trace(rule=rule, meta=header.get("meta", {}), biases=biases, guesses=guesses,
                     family_routing=header.get("routing") == "family", **arrays)
    except ConfigError as e:
        raise FormatError(f"{path}: not a strata trace (its selection biases: {e})") from None


def reroute_check(trace: Trace) -> float:
    """Fraction of (token, layer) whose λ = 0 selection recomputed from the stored logits equals
    the stored one (1.0 unless the file was edited). A tier-2 trace's selections are the
    family's own routing, which no rule re-derives: NaN."""
    if trace.family_routing:
        return float("nan")
    z = trace.logits
    same = [np.array_equal(route(z[t, l], trace.rules[l]).experts, trace.selected[t, l])
            for t in range(trace.n_tokens) for l in range(trace.n_layers)]
    return float(np.mean(same)) if same else 1.0
