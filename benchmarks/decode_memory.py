"""What benchmarks/decode.py's parts need in memory, checked before anything is built: a part that
cannot fit is skipped with a note naming the bytes, instead of an out-of-memory kill (or, on MLX's
CUDA build, managed memory silently paging to the host and a wrong measurement).

Counts follow strata.testing.mlx_params.random_params (float16 dense weights, float32 routers,
Q2_0 records of RecordLayout.padded_bytes), MlxLayerKV (float32 [KVH, max_context, HD] keys and
values), MlxLatentKV (float32 [max_context, c + r]) and DeltaNetState (float32; up to KEPT_SNAPSHOTS
kept per layer).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from strata.formats.expert_record import RecordLayout
from strata.formats.quant_types import QuantType
from strata.model_config import Ffn, Mixer, ModelConfig
from strata.reference.deltanet import KEPT_SNAPSHOTS, conv_channels

USABLE = 0.92  # of device memory: MLX's buffer cache, the CUDA context and temporaries need the rest
H200_BYTES = 139 * 2**30  # what an H200 reports; assumed where MLX does not say
# arenas larger than this are a repeated pool of records (random_records): the values do not move a
# decode's bytes, and a pool bounds the build's device work and peak (DeepSeek-V3: 3.5 GB a MoE layer)
DISTINCT_ABOVE = 8 * 10**9
FILE_SLACK = 1.05  # the .experts file's header and alignment, and room to spare on its file system


def _record(cfg: ModelConfig) -> RecordLayout:
    return RecordLayout(QuantType.Q2_0, cfg.hidden_size, cfg.expert_ffn_size)


def dense_bytes(cfg: ModelConfig) -> int:
    """random_params' dense weights (no Q8_0 guess copies)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    qr, kr = cfg.n_heads * hd, cfg.n_kv_heads * hd
    total = 2 * cfg.vocab_size * d * 2 + d * 2
    for t in cfg.kinds:
        if t.ffn is Ffn.DENSE:  # ffn norm and the dense SwiGLU, no router
            total += d * 2 + 3 * d * cfg.dense_ffn_size * 2
        else:
            total += d * 2 + cfg.n_experts * d * 4  # ffn norm, float32 router
        if cfg.has_shared_expert and t.ffn is not Ffn.DENSE:
            total += 3 * d * cfg.shared_ffn_size * 2 + d * 2
        if t.mixer is Mixer.MLA:  # random_mla: W_qa | W_kva, W_qb, W_uk, W_uv, W_o and the norms
            h, c, r, ql = cfg.n_heads, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, cfg.mla.q_lora_rank
            n, v = cfg.mla.qk_nope_head_dim, cfg.mla.v_head_dim
            total += 2 * ((ql + c + r) * d + h * (n + r) * (ql or d) + h * (n + v) * c + d * h * v + d + ql + c)
        elif t.mixer is Mixer.DELTANET:
            hv, v = cfg.deltanet.linear_v_heads, cfg.deltanet.linear_v_heads * cfg.deltanet.linear_v_head_dim
            c = conv_channels(cfg)
            total += (c + v + 2 * hv) * d * 2 + d * v * 2 + c * cfg.deltanet.linear_conv_kernel * 2 + 8 * hv + 2 * d
        else:
            total += (qr * (1 + int(cfg.attention_output_gate)) + 2 * kr) * d * 2 + d * qr * 2 + 2 * d + 4 * hd
    return total


def state_bytes(cfg: ModelConfig) -> int:
    """KV caches and DeltaNet states with their kept snapshots (a long decode keeps KEPT_SNAPSHOTS)."""
    kv = 2 * cfg.n_kv_heads * cfg.max_context * cfg.head_dim * 4
    dn = 4 * (cfg.deltanet.linear_v_heads * cfg.deltanet.linear_k_head_dim * cfg.deltanet.linear_v_head_dim
              + conv_channels(cfg) * max(cfg.deltanet.linear_conv_kernel - 1, 0))
    latent = 4 * cfg.max_context * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)  # MlxLatentKV
    return sum(dn * (KEPT_SNAPSHOTS + 1) if t.mixer is Mixer.DELTANET else latent if t.mixer is Mixer.MLA else kv
               for t in cfg.kinds)


def resident_distinct(cfg: ModelConfig) -> int:
    """Distinct records for the all-resident arena (0: all): two MoE layers' worth past DISTINCT_ABOVE."""
    n = cfg.n_moe_layers * cfg.n_experts
    if n * _record(cfg).padded_bytes <= DISTINCT_ABOVE:
        return 0
    return 2 * cfg.n_experts if cfg.n_moe_layers % 2 == 0 else cfg.n_experts


def resident_bytes(cfg: ModelConfig) -> int:
    """Device bytes of the all-resident part at its peak (the arena, its record pool, dense, states)."""
    rec = _record(cfg).padded_bytes
    return (cfg.n_moe_layers * cfg.n_experts + resident_distinct(cfg)) * rec + dense_bytes(cfg) + state_bytes(cfg)


def stream_device_bytes(cfg: ModelConfig, slots: int) -> int:
    return slots * _record(cfg).padded_bytes + dense_bytes(cfg) + state_bytes(cfg)


def experts_file_bytes(cfg: ModelConfig) -> int:
    return cfg.n_moe_layers * cfg.n_experts * _record(cfg).padded_bytes


def device_memory(gpu: bool) -> tuple[int, str]:
    """(bytes, where the number comes from) of the memory MLX allocates from."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("memory_size", "total_memory"):
        if info.get(key):
            return int(info[key]), f"MLX {key}"
    if gpu:
        return H200_BYTES, "assumed (an H200)"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"


def _available_ram() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def stream_dir(cfg: ModelConfig) -> Path | None:
    """Where the streaming part's .experts file fits: /dev/shm (a miss is a memory copy), else the
    temporary directory; None where neither holds it."""
    need = int(experts_file_bytes(cfg) * FILE_SLACK)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need and _available_ram() > need:
        return shm
    tmp = Path(tempfile.gettempdir())
    return tmp if shutil.disk_usage(tmp).free > need else None


def fit_note(part: str, cfg: ModelConfig, slots: int, gpu: bool) -> str:
    """'fits: ...' or why `part` (resident, streaming) cannot run here."""
    mem, source = device_memory(gpu)
    usable = USABLE * mem
    gb = lambda b: f"{b / 1e9:.1f} GB"  # noqa: E731
    if part == "resident":
        need = resident_bytes(cfg)
        if need > usable:
            return (f"needs {gb(need)} of device memory, {USABLE:.0%} of {gb(mem)} ({source}) is {gb(usable)}: "
                    f"run with --layers N (the per-layer shape, fewer layers)")
        return f"fits: {gb(need)} of {gb(usable)}"
    need = stream_device_bytes(cfg, slots)
    if need > usable:
        return f"needs {gb(need)} of device memory for {slots} slots; {gb(usable)} usable: fewer --slots"
    where = stream_dir(cfg)
    if where is None:
        return (f"the .experts file needs {gb(experts_file_bytes(cfg))} in /dev/shm or the temporary directory "
                f"and neither has it: run with --layers N, or on a machine with more memory")
    return f"fits: {gb(need)} of device memory; the {gb(experts_file_bytes(cfg))} file in {where}"
