"""`strata convert HF_DIR OUT`: a Hugging Face MoE checkpoint -> OUT.gguf + OUT.experts."""

from __future__ import annotations

import argparse
import signal

HELP = """\
Convert a downloaded Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json), an
mlx-lm checkpoint or a llama.cpp GGUF into OUT.gguf (dense weights, config, tokenizer, chat
template) and OUT.experts (routed experts). Streams tensor by tensor; nothing appears under
OUT's names until the conversion is complete. See docs/convert.md and docs/models.md.

families (config.json model_type): Qwen3-MoE (qwen3_moe), Qwen2-MoE (qwen2_moe), OLMoE (olmoe),
Mixtral (mixtral), Qwen3-Next (qwen3_next), Qwen3.5-MoE (qwen3_5_moe, qwen3_5_moe_text),
DeepSeek-V3 (deepseek_v3, kimi_k2), GLM-4.7-Flash (glm4_moe_lite), GLM-4.5 (glm4_moe),
MiniMax-M2 (minimax_m2), gpt-oss (gpt_oss), Qwen4-Exp (qwen4_exp, qwen4_exp_text).

llama.cpp GGUFs (general.architecture): qwen3moe, qwen2moe, olmoe, llama (MoE), qwen3next,
qwen35moe, qwen4exp (Qwen3.8-Flash-Next), deepseek2 (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash), glm4moe,
minimax-m2, gpt-oss; a split
GGUF by its first part (name-00001-of-0000N.gguf).

HF_DIR may be a hub id (Qwen/Qwen3-30B-A3B): its snapshot in the local Hugging Face cache
(HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub); strata does not download.

Without OUT, HF_DIR is a checkpoint directory run on tier 2 (docs/tier2.md): its experts are
repacked, bits unchanged, into one aligned record each (HF_DIR/strata-experts.records), which
tier 2 then reads with one read per expert instead of one per piece.

examples:
  strata convert ~/models/Qwen3-30B-A3B /data/qwen3-30b --experts q2_0
  strata convert ~/models/GLM-5-mlx-4bit                repack a tier-2 checkpoint's experts in place
  strata convert Qwen/Qwen3-30B-A3B /data/qwen3-30b     the checkpoint in the local hub cache
  strata convert GLM-4.5-Air-Q4_K_M-00001-of-00002.gguf /data/glm45   experts kept as stored"""


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(name, help="convert a Hugging Face MoE checkpoint", description=HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint directory (float, block-wise FP8, or an mlx-lm one; "
                                                    "or a llama.cpp .gguf), or a hub id in the local Hugging Face cache")
    p.add_argument("out", metavar="OUT", nargs="?", help="output path (OUT.gguf and OUT.experts are written); "
                                                         "none: repack a tier-2 checkpoint's experts")
    p.add_argument("--experts", default=None, help="routed expert type: q2_0, q4_0, q8_0, f16, f32 (default q2_0; an "
                                                "MLX-quantized checkpoint's or a llama.cpp GGUF's experts keep "
                                                "their own types, bit for bit)")
    p.add_argument("--dense", default=None, help="dense matrix type: f32, f16, q8_0 (default f32; a llama.cpp "
                                             "GGUF's dense matrices keep their own types, bit for bit)")
    p.add_argument("--ngrams", default="f16", help="a PLE model's n-gram row store (OUT.ngrams) row type: f32, f16, "
                                                "q8_0, q4_0 (default f16; docs/qwen4.md gives their KLD)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # so a `kill` (SIGTERM) cleans up like Ctrl-C does


def run(args: argparse.Namespace) -> int:
    from strata.convert import convert
    from strata.errors import ConfigError
    from strata.formats.quant_types import parse_quant_type
    from strata.hub_cache import looks_like_hub_id, snapshot_dir

    from strata.cli.paths import check_output_path

    if args.out is None:
        return _repack(args)
    try:
        expert_type = None if args.experts is None else parse_quant_type(args.experts)
        dense_type = None if args.dense is None else parse_quant_type(args.dense)
        ngram_type = parse_quant_type(args.ngrams)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_output_path(args.out, "OUT", make_dirs=True)  # before hours of conversion, not after (the converter makes directories)
    source = snapshot_dir(args.hf_dir) if looks_like_hub_id(args.hf_dir) else args.hf_dir
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        r = convert(source, args.out, expert_type=expert_type, dense_type=dense_type, progress=not args.quiet,
                    ngram_type=ngram_type)
    finally:
        signal.signal(signal.SIGTERM, previous)
    c = r.cfg
    print(f"wrote {r.model_path} and {r.experts_path}: {r.family}, {c.n_layers} layers, {c.n_experts} experts "
          f"(top-{c.n_experts_per_token}), experts {r.experts_described}, dense {r.dense_described}, "
          f"{r.seconds:.1f} s")
    if r.ngrams_path is not None:
        print(f"wrote {r.ngrams_path}: the PLE n-gram row store, rows {args.ngrams.upper()}")
    for note in r.notes:
        print(f"note: {note}")
    if r.requant_kld is not None:
        print(r.requant_kld.line(r.expert_type))
    return 0


def _repack(args: argparse.Namespace) -> int:
    """`strata convert DIR`: a tier-2 checkpoint's experts as aligned records (strata.tier2.records)."""
    import sys
    import time
    from pathlib import Path

    from tqdm import tqdm

    from strata.errors import ConfigError
    from strata.tier2.source import is_tier2_source, require_mlx_lm

    source = Path(args.hf_dir)
    if not is_tier2_source(source):
        raise ConfigError(f"{source}: give OUT (`strata convert {source} OUT`); without it HF_DIR must be a checkpoint "
                          "directory (config.json and .safetensors) whose experts tier 2 repacks")
    if args.experts is not None or args.dense is not None:
        raise ConfigError("--experts / --dense: the repack keeps the checkpoint's own bits; give OUT to convert")
    require_mlx_lm(source)
    from strata.tier2.plan import checkpoint_layout
    from strata.tier2.records import RECORDS_NAME, write_records

    (source / RECORDS_NAME).unlink(missing_ok=True)  # an earlier repack: the experts are read from the shards
    tensors = checkpoint_layout(source).tensors
    start = time.perf_counter()
    with tqdm(total=tensors.n_records, desc="repacking experts", unit="expert", disable=args.quiet, file=sys.stderr,
              dynamic_ncols=True) as bar:
        path = write_records(tensors, progress=lambda n: bar.update(n - bar.n))
    print(f"wrote {path}: {tensors.n_records} experts ({tensors.n_layers} MoE layers x {tensors.n_experts}), one "
          f"record of {tensors.slot_bytes} bytes each (the pieces' {tensors.record_bytes} bytes unchanged), "
          f"{time.perf_counter() - start:.1f} s")
    return 0
