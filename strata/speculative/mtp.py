"""The MTP drafter: the model's own multi-token-prediction layer proposes the next token.

Qwen3-Next / Qwen3.5 checkpoints ship one MTP layer (kept by the converter as `mtp.*` dense
tensors; its reference strata/reference/mtp.py), DeepSeek-V3 / Kimi-K2 / GLM-4.7-Flash and
GLM-4.5 one "nextn" layer (kept as `nextn.*`; its reference strata/reference/nextn.py): the same module in
two forms. At a window's start the session holds positions
0..p and `token` (sampled from position p's logits) opens the window; the MTP layer reads the
target's last hidden state h_p (after the final norm) and embed(token) and gives the logits of
the token after it: the one draft (argmax, a point mass: `Draft.probs` None), verified by the
window like any other.

This is the numpy reference drafter: it computes the target's hidden states itself with the
reference forward (every expert resident, the same arithmetic as the reference engine, one
position behind the context), and the MTP layer over every position it has (the layer attends
over its own earlier positions, as the serving code's MTP KV cache does). Its draft costs a
target decode step besides the window (the gate's ms count it; its expert reads are not in the
gate's bytes, being outside the arena): it shows what the MTP layer predicts and that
verification keeps output lossless, not a speed-up. Reading h_p
from the engine that already computed it is what a fast MTP drafter needs next.
"""

from __future__ import annotations

from collections import ChainMap
from typing import Mapping, Sequence

import numpy as np

from strata.errors import ParameterError
from strata.formats.model_file import read_model
from strata.model_config import TensorNames, dense_tensor_shapes
from strata.reference.attention import rms_norm
from strata.reference.model import forward
from strata.reference.model_state import ModelState
from strata.reference.mtp import MtpShape, MtpWeights, mtp_logits
from strata.reference.nextn import NextnLayer
from strata.speculative.drafter import NO_DRAFT, Draft
from strata.tensor_names import drafter_only

__all__ = ["MtpDrafter", "MTP_DEPTH"]

MTP_DEPTH = 1  # one MTP layer: one drafted token per window


class MtpDrafter:
    """Drafts one token per window through `model`'s MTP layer (a strata.loader.Model whose
    converter kept one: `cfg.deltanet.mtp_layers`, or DeepSeek-V3 / GLM-4.5's `cfg.sigmoid.nextn_layers`)."""

    name = "mtp"

    def __init__(self, model) -> None:
        if model is None:
            raise ParameterError("mtp_draft: this engine has no model to read the MTP layer from; open it from "
                                 "a loaded model (strata.load)")
        cfg = model.cfg
        if not (cfg.deltanet.mtp_layers or cfg.sigmoid.nextn_layers):
            raise ParameterError(f"mtp_draft: {model.model_path.name} has no MTP layer; convert a Qwen3-Next / "
                                 "Qwen3.5 checkpoint that ships mtp.* tensors (or a DeepSeek-V3 / GLM-4.5 one with its "
                                 "nextn layer), or use suffix_draft")
        n = TensorNames
        self.params = model.resident_params()
        self.embedding = np.asarray(model.dense[n.token_embd], np.float32)
        dense = drafter_dense(model)
        if cfg.sigmoid.nextn_layers:
            self.nextn = NextnLayer(cfg, dense)
        else:
            self.nextn = None
            self.weights = MtpWeights.from_dense(dense, cfg.n_experts)
            self.shape = MtpShape.of(cfg)
            self.head = self.embedding if cfg.tie_embeddings else np.asarray(model.dense[n.output], np.float32)
        self.output_norm = np.asarray(model.dense[n.output_norm], np.float32)
        self.start(())

    def start(self, context: Sequence[int]) -> None:
        self._context: list[int] = []
        self._hidden: list[np.ndarray] = []  # h_t after the final norm, for positions 0..len - 1
        self._state = ModelState.empty(self.params.cfg)
        self.extend(context)

    def extend(self, tokens: Sequence[int]) -> None:
        self._context.extend(int(t) for t in tokens)

    def draft(self, n: int) -> Draft:
        """Shapes: -> Draft of min(n, 1) tokens, probs None (the MTP logits' argmax)."""
        if n < 1 or len(self._context) < 2:
            return NO_DRAFT
        self._catch_up()
        hidden = np.stack(self._hidden)  # positions 0..p, p = len(context) - 2
        following = np.asarray(self._context[1:])  # the token at t + 1 for each position t
        if self.nextn is not None:
            logits = self.nextn.logits(hidden, self.embedding[following])
        else:
            logits = mtp_logits(self.weights, self.shape, hidden, following, self.embedding, self.head,
                                np.arange(len(hidden)))
        return Draft((int(np.argmax(logits[-1])),))

    def _catch_up(self) -> None:
        """The target's hidden states up to the position before the context's last token (the
        session's positions; the last token opens the window)."""
        done, want = len(self._hidden), len(self._context) - 1
        if done >= want:
            return
        x, self._state = forward(self.params, self._state, np.asarray(self._context[done:want]), hidden=True)
        normed = rms_norm(x, self.output_norm, self.params.cfg.rms_norm_eps)
        self._hidden.extend(normed)


def drafter_dense(model) -> Mapping[str, np.ndarray]:
    """`model`'s dense weights with its drafter-only tensors (the MTP / nextn layer), which a load
    leaves in the model file (strata.tensor_names.drafter_only), read from it now."""
    names = frozenset(n for n in dense_tensor_shapes(model.cfg) if drafter_only(n))
    return ChainMap(read_model(model.model_path, names=names).dense, model.dense) if names else model.dense
