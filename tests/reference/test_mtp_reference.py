"""The MTP layer's reference (strata/reference/mtp.py) against the published code's composition:
transformers' own Qwen3-Next decoder layer and norms, wired as the serving code's MTP forward
(norm the next token's embedding and the target's hidden state, concatenate, fc, the layer,
the final norm, the shared head)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

from strata.reference.mtp import MtpShape, MtpWeights, mtp_logits  # noqa: E402
from tests.budgets import MTP_REFERENCE_LOGIT_BUDGET  # noqa: E402
from tests.hf_mtp import mtp_layer  # noqa: E402

D, V, E, F, T = 64, 97, 8, 32, 7


def _published(seed: int):
    """(config, tensors under the published `mtp.*` names, embedding, head, torch modules)."""
    config = qwen3_next.Qwen3NextConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        num_experts=E, num_experts_per_tok=3, moe_intermediate_size=F,
                                        shared_expert_intermediate_size=48, vocab_size=V)
    c, tensors, modules = mtp_layer(config, seed)
    embed, head = torch.randn(V, D), torch.randn(V, D) * 0.1
    return c, tensors, embed, head, modules


def _serving_forward(c, modules, embed, head, hidden, next_tokens, positions):
    layer, norms, fc = modules
    rotary = qwen3_next.Qwen3NextRotaryEmbedding(c)
    with torch.no_grad():
        x = torch.cat([norms["pre_fc_norm_embedding"](embed[next_tokens]), norms["pre_fc_norm_hidden"](hidden)], -1)
        x = fc(x)[None]
        pos = positions[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = layer(x, position_embeddings=rotary(x, pos), attention_mask=mask, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        return (norms["norm"](y[0]) @ head.T).numpy()


@pytest.mark.parametrize("seed", [0, 1])
def test_mtp_logits_match_the_published_composition(seed):
    c, tensors, embed, head, modules = _published(seed)
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((T, D)).astype(np.float32)
    next_tokens = rng.integers(0, V, T)
    positions = np.arange(3, 3 + T)
    want = _serving_forward(c, modules, embed, head, torch.from_numpy(hidden), torch.from_numpy(next_tokens),
                            torch.from_numpy(positions))
    shape = MtpShape(n_heads=4, n_kv_heads=2, head_dim=32, rotary_dim=8, rope_theta=10000.0, top_k=3,
                     norm_topk_prob=True, eps=c.rms_norm_eps)
    got = mtp_logits(MtpWeights.from_checkpoint(tensors, E), shape, hidden, next_tokens, embed.numpy(),
                     head.numpy(), positions)
    assert got.shape == (T, V)
    assert np.abs(got - want).max() <= MTP_REFERENCE_LOGIT_BUDGET * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_a_missing_mtp_tensor_is_named():
    _, tensors, *_ = _published(0)
    del tensors["mtp.fc.weight"]
    with pytest.raises(KeyError, match="mtp.fc.weight"):
        MtpWeights.from_checkpoint(tensors, E)
