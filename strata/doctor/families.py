"""Parameter counts of a Hugging Face config, by part, without reading a weight.

Families strata runs (every converter family, strata/convert/architectures.py) are counted through
strata's own definitions: the converter's `ModelConfig` and `dense_tensor_shapes`, so the doctor
and the converter cannot disagree. A config strata refuses (a feature it does not run, a
pre-quantized checkpoint) is counted by its family's own `count_published` (strata/families/), and
any other MoE config by the generic counter (GQA attention, every layer MoE), so it still gets a
byte budget. `PartCounts` and the counting helpers are strata/families/counts.py's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from strata.convert.architectures import BY_MODEL_TYPE
from strata.convert.hf_config import HFConfig
from strata.errors import StrataError
from strata.families.counts import PartCounts, count_generic, text_config
from strata.families.qwen4_exp import Qwen4Names, ple_layers
from strata.families.registry import published_counter
from strata.layer_kinds import Mixer
from strata.model_config import TensorNames, dense_tensor_shapes
from strata.tensor_names import drafter_only
from strata.ple_store import table_shapes

__all__ = ["PartCounts", "count_hf", "count_strata", "text_config"]


def count_hf(raw: dict, path: str = "config.json") -> PartCounts:
    """Count a config.json (already parsed). Supported families go through strata's converter;
    the others through their own counter; an unknown MoE config through the generic one."""
    c = text_config(raw)
    t = c.get("model_type") or ""
    supported = _supported(raw, path)
    if supported is not None:
        return supported
    return (published_counter(t) or count_generic)(c, t)


def _kv_per_position(cfg) -> int:
    """Cached floats per position: K and V of every attention layer (a recurrent layer's state is
    fixed; a latent-attention layer caches its latent and rope key)."""
    per = {Mixer.ATTENTION: 2 * cfg.n_kv_heads * cfg.head_dim,
           Mixer.MLA: cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim}
    return sum(per.get(k.mixer, 0) for k in cfg.kinds)


def _supported(raw: dict, path: str) -> PartCounts | None:
    """Counts through strata's converter, or None where the family is not one strata runs (or the
    config uses a feature it does not run: the reason is kept for the report)."""
    family = BY_MODEL_TYPE.get(raw.get("model_type"))
    if family is None:
        return None
    hf = HFConfig(Path(path), raw, family.name)
    try:
        cfg = family.model_config(hf, frozenset())  # no checkpoint: tensors are not consulted
    except StrataError as e:  # a feature strata does not run: count the family's structure itself
        t = raw.get("model_type") or ""
        counts = (published_counter(t, by_prefix=False) or count_generic)(text_config(raw), t)
        return _replace(counts, family=family.name, why_not=str(e).split(": ", 1)[-1])
    return count_strata(cfg, family.name)


def count_strata(cfg, family: str = "strata") -> PartCounts:
    """Counts of a model strata runs, from its ModelConfig and `dense_tensor_shapes`."""
    parts: dict[str, int] = {}
    for name, shape in dense_tensor_shapes(cfg).items():
        n = 1
        for d in shape:
            n *= d
        if name.endswith(Qwen4Names.ple_ngram):  # a made model's table among the dense: the row store's part
            continue
        if drafter_only(name):  # the MTP / nextn layer: left in the file unless drafting (strata.tensor_names)
            continue
        part = _strata_part(name)
        parts[part] = parts.get(part, 0) + n
    embedding = parts.pop("embedding")
    return PartCounts(
        family=family, model_type=cfg.architecture, supported=True, why_not="", hidden=cfg.hidden_size,
        vocab=cfg.vocab_size, n_layers=cfg.n_layers, moe_layers=cfg.n_moe_layers, n_experts=cfg.n_experts,
        top_k=cfg.n_experts_per_token, expert_ffn=cfg.expert_ffn_size,
        expert_weights=3 * cfg.hidden_size * cfg.expert_ffn_size, embedding=embedding, dense=parts,
        kv_per_position=_kv_per_position(cfg), tie_embeddings=cfg.tie_embeddings,
        model_config=cfg, **_ple_counts(cfg, ple_layers, table_shapes))


def _ple_counts(cfg, ple_layers, table_shapes) -> dict:
    if not ple_layers(cfg):
        return {}
    shapes = table_shapes(cfg)
    width = next(iter(shapes.values()))[1]
    return dict(ple_table_values=sum(r * w for r, w in shapes.values()), ple_row_width=width,
                ple_rows_per_token=cfg.qwen4.ple_embed_dim // width * len(shapes))


def _strata_part(name: str) -> str:
    n = TensorNames
    if name == n.token_embd:
        return "embedding"
    if name == n.output:
        return "head"
    if name.endswith(n.router):
        return "router"
    if "_shexp" in name:
        return "shared_expert"
    if name.endswith("norm.weight"):
        return "norms"
    return "attention"


def _replace(counts: PartCounts, **changes) -> PartCounts:
    return dataclasses.replace(counts, supported=False, **changes)
