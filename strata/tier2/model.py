"""Tier2Model: a checkpoint directory run with mlx-lm's own model class, experts streamed.

`load_tier2(directory)` builds the model as mlx-lm's `load_model` does (its config, class,
sanitize, quantization and weights; lazily, so nothing is read yet), finds every switch layer
(`SwitchGLU`, `SwitchMLP`), locates each one's stacked expert tensors in the shards
(strata.tier2.expert_tensors), drops the model's references to them (they are never read whole)
and then materializes the rest: the dense weights as mlx-lm loads them. An engine installs its
arena into the switch layers (`install`): each one's projections then read the arena's slots,
and a StreamedSwitch takes its place. Nothing is written beside the checkpoint.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from strata.tokenizer import Tokenizer
from strata.tier2.plan import DEFAULT_MAX_CONTEXT, TOP_K_KEYS, config_value, not_runnable
from strata.tier2.source import require_mlx_lm

__all__ = ["Tier2Config", "Tier2Model", "load_tier2", "not_runnable", "TOP_K_KEYS", "DEFAULT_MAX_CONTEXT"]

@dataclass(frozen=True)
class Tier2Config:
    """What the generation loop and the cache need of a tier-2 model."""

    model_type: str
    vocab_size: int
    max_context: int
    n_moe_layers: int
    n_experts: int
    n_experts_per_token: int
    native: bool  # strata also has a native module for this model_type (`strata convert`)


@dataclass(eq=False)
class Tier2Model:
    """A loaded tier-2 model. `mlx_model` is mlx-lm's Model; `switches` its SwitchGLU modules by
    MoE layer as (path, parent module, attribute, the SwitchGLU); `tensors` the experts in the
    shards; `session` the engine it keeps (strata.engines.session_engine)."""

    cfg: Tier2Config
    mlx_model: object
    tokenizer: Tokenizer
    tensors: object  # ExpertTensors
    switches: list
    scorers: list  # per MoE layer: its gate's read-ahead scorer or None (strata.tier2.guesses)
    gates: list  # per MoE layer: the family's own `gate` module of its block (None where it has none)
    model_path: Path
    dense_bytes: int
    session: object = field(default=None, repr=False)
    ngrams_file: object = None  # no PLE tables on tier 2
    installed: object = field(default=None, repr=False)  # the engine whose arena the switch layers read
    session_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # as Model's (strata/sharing.py)

    tier = 2

    @property
    def experts_file(self):
        """The experts' source as the runtime reads a model's `.experts` file: its `header`
        geometry (record and slot bytes, layers, experts), `path`, `record_offset` (speculation's
        byte counts, the reader pool); the shards' stacked tensors (ExpertTensors)."""
        return self.tensors

    def why(self) -> str:
        """One line: which tier runs and why."""
        t = self.cfg.model_type
        if self.cfg.native:
            return (f"tier 2: mlx-lm's {t} model file, experts streamed from the checkpoint (strata's native {t} "
                    f"path needs `strata convert {self.model_path} OUT` first)")
        return f"tier 2: mlx-lm's {t} model file, experts streamed from the checkpoint (no native {t} module in strata)"

    def install(self, arena, stream, owner, *, gates=None) -> None:
        """Point every switch layer's stacked tensors at `arena` and route its calls through
        `stream`, for the engine `owner` (`installed`): engines over one model each install
        theirs before a forward, so two open at once never read each other's arena. `gates`:
        per MoE layer the gate module that routes in its block (strata.tier2.moce), or None for
        the family's own."""
        from mlx.utils import tree_unflatten

        from strata.tier2.switch import StreamedSwitch

        for m, (path, parent, attr, inner) in enumerate(self.switches):
            inner.update(tree_unflatten(list(arena.arrays_of(m).items())))
            setattr(parent, attr, StreamedSwitch(inner, m, stream))
            if self.gates[m] is not None:
                setattr(parent, "gate", self.gates[m] if gates is None else gates[m])
        self.installed = owner

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def __enter__(self) -> "Tier2Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _native_model_types() -> frozenset:
    from strata.convert.architectures import BY_MODEL_TYPE

    return frozenset(BY_MODEL_TYPE)


def _parent(model, path: str):
    obj, parts = model, path.split(".")
    for p in parts[:-1]:
        obj = obj[int(p)] if isinstance(obj, list) else obj[p]
    return obj, parts[-1]


def _scorer(model, path: str, n_experts: int, input_dims: int):
    """The read-ahead scorer of the MoE block that owns the switch layer at `path`: its parent's
    gate, else its grandparent's (DeepSeek-V4.1 keeps the switch layer in an `experts` module
    beside the gate)."""
    from strata.tier2.guesses import gate_scorer

    parts = path.split(".")
    for inner in (path, ".".join(parts[:-1])):  # the switch layer's parent, then the parent's parent
        if "." not in inner:
            break
        scorer = gate_scorer(_parent(model, inner)[0], n_experts, input_dims)
        if scorer is not None:
            return scorer
    return None


def load_tier2(directory: str | Path) -> Tier2Model:
    """mlx-lm's model of `directory` with its routed experts left on disk (module doc)."""
    directory = Path(directory)
    require_mlx_lm(directory)
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from strata.convert.tokenizer_files import read_tokenizer_files
    from strata.tier2.plan import checkpoint_layout

    layout = checkpoint_layout(directory)
    model, config, tensors = layout.model, layout.config, layout.tensors
    switches, scorers, gates = [], [], []
    for path, inner in layout.found:
        parent, attr = _parent(model, path)
        switches.append((path, parent, attr, inner))
        gates.append(parent.get("gate"))
        first = inner["gate_proj"] if "gate_proj" in inner else inner["fc1"]  # SwitchGLU's / SwitchMLP's
        scorers.append(_scorer(model, path, tensors.n_experts, first.input_dims))
        # the lazy file arrays go: the experts are read per slot, never whole
        inner.update(tree_unflatten([(p.name, mx.zeros((0,), mx.uint8)) for p in tensors.pieces]))
    params = [a for _, a in tree_flatten(model.parameters())]
    mx.eval(params)
    dense = sum(a.nbytes for a in params)
    vocab = config_value(config, ("vocab_size",))
    limit = config_value(config, ("max_position_embeddings",)) or DEFAULT_MAX_CONTEXT
    tf = read_tokenizer_files(directory)
    eos = tf.special_tokens.get("eos_token")
    tok = Tokenizer.from_json(tf.tokenizer_json, chat_template=tf.chat_template, source=str(directory),
                              eos_tokens=(eos,) if eos else ())
    cfg = Tier2Config(model_type=layout.model_type, vocab_size=int(vocab or tf.vocab_size), max_context=int(limit),
                      n_moe_layers=tensors.n_layers, n_experts=tensors.n_experts, n_experts_per_token=layout.top_k,
                      native=layout.model_type in _native_model_types())
    return Tier2Model(cfg=cfg, mlx_model=model, tokenizer=tok, tensors=tensors, switches=switches, scorers=scorers,
                      gates=gates, model_path=directory, dense_bytes=dense)
