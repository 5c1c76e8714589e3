"""Tier 2: MoE families strata has no native module for, run with mlx-lm's own model file.

A checkpoint directory as mlx-lm's `convert` writes it (config.json + safetensors, mlx-community's
files) loads with mlx-lm's model class for everything but the routed experts; each `SwitchGLU`
is replaced by strata's streamed expert layer: experts live in a fixed arena of slots that the
cache machine (strata.cache) manages and the reader pool (strata.runtime.io) fills, each expert's
slice of the stacked tensors read in place from the shards, the read-ahead guess taken from the
next MoE layer's own gate module. The family's routing is mlx-lm's, untouched, so logits equal
mlx-lm's own bit for bit. mlx-lm is an optional extra (`strata-moe[mlx-lm]`).

    source.py          is a path a tier-2 checkpoint; the one-line refusal without mlx-lm
    expert_tensors.py  where each expert's bytes are in the shards; the slot's pieces
    arena.py           the arena: one MLX array per piece, [capacity, ...], filled in place
    reader.py          the reader pool over the shards (scattered reads, verified)
    guesses.py         read-ahead scores from a MoE block's own gate module
    switch.py          the streamed expert layer (replaces SwitchGLU / SwitchMLP) and its turns
    moce.py            MoCE where the family routes in a replaceable gate module (DeepSeek-style)
    records.py         the experts repacked into aligned records (`strata convert DIR`)
    model.py           Tier2Model and `load_tier2`: mlx-lm's model with the layers replaced
    engine.py          Tier2Engine: the Engine protocol over mlx-lm's forward and KV cache
"""

from strata.tier2.source import is_tier2_source, require_mlx_lm

__all__ = ["is_tier2_source", "require_mlx_lm"]
