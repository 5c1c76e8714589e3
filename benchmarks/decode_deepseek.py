"""DeepSeek-V3's synthetic for benchmarks/decode.py: its small smoke-test shape, and the 61 layers
extrapolated from a run over fewer (`--layers N`).

Why extrapolate: the full model is 3 dense layers and 58 MoE layers of 256 experts of 3 x 7168 x
2048 (13.8 MB of Q2_0 each): ~204 GB of experts plus ~34 GB of float16 dense weights, which fit
neither one H200's 139 GiB (all-resident) nor its 64 GiB disk or 128 GiB of RAM (the streaming
part's `.experts` file). A decoded token reads every layer's dense weights and k experts once, so
its time is close to proportional to its bytes: the estimate scales the measured ms/token by the
bytes of 61 layers over the bytes of the N measured, and beside it gives the plain per-layer ms x
61 (which counts the N-layer run's dense-layer share and the head at N's proportions).

What is random and what repeats (the decode's time depends on the bytes it moves, not on the
values): the dense weights are random float16 of their real shapes, every layer its own; the
all-resident arena past decode_memory.DISTINCT_ABOVE (8 GB: 3 MoE layers) is one MoE layer's 256
random records copied into every MoE layer's slots (distinct memory, repeated values); the
streaming part's `.experts` file repeats a pool of 32 records (benchmarks/_random_experts.py),
each with its own place and checksum in a real file the real engine reads. Estimated from the
bytes (H200: ~3.3 TB/s device copy), building is milliseconds of device time: 8 layers (3 dense,
5 MoE) are a 17.6 GB arena copied from a 3.5 GB pool and 9.5 GB of dense weights (16 layers:
44.7 GB and 13.2 GB); what a run waits on is each kernel specialisation's first call (an NVRTC
compile, seconds each; ~15 for an uncompiled decode at this shape and 2 more for the compiled
step, counted on the emulator) and, streaming, the file's 3.5 GB a MoE layer written at the
host's file-system rate (decode.py prints each phase's seconds and the write's GB/s as it ends).
"""

from __future__ import annotations


from decode_memory import _record, dense_bytes
from strata.model_config import Ffn, LayerType, Mixer, ModelConfig
from strata.testing.mlx_params import DEEPSEEK_V3_SHAPE

# the pattern at a smoke test's size: a dense first layer, then three MoE layers in 4 groups
SMALL_DEEPSEEK = DEEPSEEK_V3_SHAPE.with_fields(
    n_layers=4, layer_types=(LayerType(Mixer.MLA, Ffn.DENSE),) + (LayerType(Mixer.MLA, Ffn.MOE),) * 3,
    hidden_size=256, n_heads=4, n_kv_heads=4, head_dim=48, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
    qk_nope_head_dim=32, v_head_dim=32, n_experts=32, n_experts_per_token=4, n_group=4, topk_group=2,
    expert_ffn_size=64, shared_ffn_size=64, dense_ffn_size=128, vocab_size=512, max_context=256)


def token_bytes(cfg: ModelConfig) -> int:
    """Bytes a decoded token reads at a short context: every dense weight but the embedding table
    (one row of it), k experts per MoE layer."""
    return dense_bytes(cfg) - cfg.vocab_size * cfg.hidden_size * 2 + cfg.n_moe_layers * cfg.n_experts_per_token * _record(cfg).padded_bytes


def deepseek_extrapolation(full: ModelConfig, cfg: ModelConfig, res: dict) -> list:
    """The byte budget a token of the measured and of the full model, the measured parts' per-layer
    ms and their 61-layer estimates: into res (idempotent: a run prints them after every part, so a
    later part's kill keeps them) -> the table's rows."""
    ratio = token_bytes(full) / token_bytes(cfg)
    res.update({"deepseek_full_layers": full.n_layers, "deepseek_measured_layers": cfg.n_layers,
                "deepseek_full_bytes_per_token": token_bytes(full), "deepseek_measured_bytes_per_token": token_bytes(cfg)})
    read = res.get("read_GBps") or 0.0
    at_read = lambda b: f"{b / read / 1e6:.2f} ms at {read:.0f} GB/s read" if read else ""  # noqa: E731
    rows = [(f"DeepSeek-V3 bytes a token, {cfg.n_layers} layers measured", f"{token_bytes(cfg) / 1e9:.2f} GB", at_read(token_bytes(cfg))),
            (f"DeepSeek-V3 bytes a token, {full.n_layers} layers", f"{token_bytes(full) / 1e9:.2f} GB",
             f"x{ratio:.2f} the measured layers'; " + at_read(token_bytes(full)))]
    for name, key in (("all-resident (engine)", "resident_engine_ms_per_token"), ("streaming", "stream_ms_per_token")):
        ms = res.get(key)
        if not ms:
            continue
        per_layer = ms / cfg.n_layers
        est = ms * ratio
        tag = key.split("_")[0]
        res.update({f"deepseek_{tag}_ms_per_layer": per_layer, f"deepseek_{tag}_full_ms_by_bytes": est,
                    f"deepseek_{tag}_full_ms_by_layers": per_layer * full.n_layers})
        rows.append((f"DeepSeek-V3 {name}: {cfg.n_layers} layers measured", f"{ms:.2f} ms/token",
                     f"{per_layer:.3f} ms a layer"))
        rows.append((f"  extrapolated to {full.n_layers} layers", f"{est:.1f} ms/token",
                     f"by bytes (x{ratio:.2f}); {per_layer * full.n_layers:.1f} by layers"))
    return rows
