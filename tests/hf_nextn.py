"""A DeepSeek-V3 or GLM-4.5 multi-token-prediction ("nextn") layer under the published names
(`model.layers.{n}.*`, n = num_hidden_layers): transformers' own decoder layer (DeepSeek-V3's an
MLA + MoE layer, its rope interleaved as published; GLM-4.5's attention + MoE) plus enorm, hnorm, eh_proj and shared_head, noise on
every parameter (the norms' and selection bias's constant inits included), and the published
module computed from them (`nextn_logits`) for the drafter's test (tests/speculative/test_speculative_nextn.py)."""

from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _classes(config):
    """(decoder layer class, rotary embedding class) of the config's architecture."""
    if config.model_type == "glm4_moe":
        from transformers.models.glm4_moe import modeling_glm4_moe as m
        return m.Glm4MoeDecoderLayer, m.Glm4MoeRotaryEmbedding
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    return m.DeepseekV3DecoderLayer, m.DeepseekV3RotaryEmbedding


def nextn_layer(config, seed: int, scale: float = 0.2):
    """(tensors by published name, transformers' decoder layer) for a DeepseekV3Config or
    Glm4MoeConfig `config`."""
    import torch

    n, d, v = config.num_hidden_layers, config.hidden_size, config.vocab_size
    c = type(config)(**config.to_dict())
    c._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = _classes(c)[0](c, n).eval()  # n >= first_k_dense_replace: an MoE layer
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * scale + (1.0 if name.endswith("norm.weight") else 0.0))
        layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(c.n_routed_experts) * 0.1)
    rng, pre = np.random.default_rng(seed), f"model.layers.{n}."
    tensors = {pre + "eh_proj.weight": rng.normal(0, scale, (d, 2 * d)),
               pre + "enorm.weight": 1 + rng.normal(0, scale, d), pre + "hnorm.weight": 1 + rng.normal(0, scale, d),
               pre + "shared_head.norm.weight": 1 + rng.normal(0, scale, d),
               pre + "shared_head.head.weight": rng.normal(0, scale, (v, d)),
               pre + "embed_tokens.weight": rng.normal(0, scale, (v, d))}  # the published copy (unused)
    tensors = {k: w.astype(np.float32) for k, w in tensors.items()}
    f = c.moe_intermediate_size
    for k, w in layer.state_dict().items():
        w = w.float().numpy()
        if k == "mlp.experts.gate_up_proj":  # transformers fuses them; the checkpoint has one per expert
            for e in range(c.n_routed_experts):
                tensors[f"{pre}mlp.experts.{e}.gate_proj.weight"] = np.ascontiguousarray(w[e, :f])
                tensors[f"{pre}mlp.experts.{e}.up_proj.weight"] = np.ascontiguousarray(w[e, f:])
        elif k == "mlp.experts.down_proj":
            for e in range(c.n_routed_experts):
                tensors[f"{pre}mlp.experts.{e}.down_proj.weight"] = np.ascontiguousarray(w[e])
        else:
            tensors[pre + k] = w.copy()
    return tensors, layer


def nextn_logits(config, tensors, layer, hidden: np.ndarray, next_embeddings: np.ndarray) -> np.ndarray:
    """The published module over a sequence: h = eh_proj([enorm(embed(t + 1)); hnorm(h_t)]), one
    decoder layer (transformers', causal, positions 0..T-1), shared_head.norm, shared_head.head.

    Shapes: hidden [T, D] (the target's final-normed hidden states); next_embeddings [T, D] -> [T, V]"""
    import torch

    pre, eps = f"model.layers.{config.num_hidden_layers}.", config.rms_norm_eps
    x = np.concatenate([_rms(next_embeddings, tensors[pre + "enorm.weight"], eps),
                        _rms(hidden, tensors[pre + "hnorm.weight"], eps)], -1) @ tensors[pre + "eh_proj.weight"].T
    c = layer.self_attn.config
    t = len(x)
    rotary = _classes(c)[1](c)
    xt = torch.from_numpy(np.asarray(x, np.float32))[None]
    positions = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        y = layer(xt, attention_mask=mask, position_ids=positions,
                  position_embeddings=rotary(xt, positions))
    y = (y[0] if isinstance(y, tuple) else y)[0].numpy()
    return _rms(y, tensors[pre + "shared_head.norm.weight"], eps) @ tensors[pre + "shared_head.head.weight"].T


def checkpoint_with_nextn(tmp_path_factory, arch: str = "deepseek_v3", seed: int = 3):
    """(the checked-in checkpoint of `arch` (deepseek_v3, glm4_moe) with a nextn layer added, its
    nextn tensors by published name, transformers' decoder layer, the transformers config)."""
    import shutil

    from strata.convert.safetensors_reader import Checkpoint
    from tests import hf_models
    from tests.convert_parity import save_as_one_file

    plain = hf_models.cached_checkpoint(arch, tmp_path_factory)[0]
    src = tmp_path_factory.mktemp("nextn") / "ckpt"
    shutil.copytree(plain, src)
    with Checkpoint(src) as ck:
        tensors = {n: ck.read(n) for n in ck.tensors}
    config = hf_models.hf_config(arch)
    nextn, layer = nextn_layer(config, seed)
    save_as_one_file(src, {**tensors, **nextn})
    return src, nextn, layer, config
