"""A Qwen3-Next MTP layer under the published names (`mtp.*`), made from transformers' own
decoder layer and norms with noise on every parameter (the norms' zero init included), for the
reference test (tests/reference/test_mtp_reference.py) and the converter's (tests/convert/test_convert_mtp.py)."""

from __future__ import annotations

import numpy as np


def mtp_layer(config, seed: int, scale: float = 0.2):
    """(tensors by published name, (layer, norms, fc) torch modules) for a Qwen3NextConfig-like
    `config` (its attention, expert and shared-expert sizes)."""
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

    c = qwen3_next.Qwen3NextConfig(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    c._attn_implementation = "eager"
    torch.manual_seed(seed)
    layer = qwen3_next.Qwen3NextDecoderLayer(c, 0).eval()
    norms = {n: qwen3_next.Qwen3NextRMSNorm(c.hidden_size, eps=c.rms_norm_eps) for n in
             ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    fc = torch.nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
    with torch.no_grad():
        for p in [*layer.parameters(), *fc.parameters(), *(q for n in norms.values() for q in n.parameters())]:
            p.copy_(torch.randn_like(p) * scale)
    f, n_experts = c.moe_intermediate_size, c.num_experts
    tensors = {"mtp.fc.weight": fc.weight.detach().numpy().copy()}
    tensors.update({f"mtp.{n}.weight": m.weight.detach().numpy().copy() for n, m in norms.items()})
    for k, v in layer.state_dict().items():
        v = v.numpy()
        if k == "mlp.experts.gate_up_proj":  # transformers fuses them; the checkpoint has one per expert
            for e in range(n_experts):
                tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = np.ascontiguousarray(v[e, :f])
                tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = np.ascontiguousarray(v[e, f:])
        elif k == "mlp.experts.down_proj":
            for e in range(n_experts):
                tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = np.ascontiguousarray(v[e])
        else:
            tensors[f"mtp.layers.0.{k}"] = v.copy()
    return c, tensors, (layer, norms, fc)
