"""The reference engine's model at full size, synthetic: decode ms/token all-resident and
streaming, and the per-token byte budget beside the reference engine's measured one.

    python benchmarks/decode.py --shape qwen4-seed [--layers N] [--ple-gb G] [--tokens 8]
    python benchmarks/qwen4_seed.py [the same flags] [--tiny]

The shape (`seed_shape`): 48 layers = 36 gated DeltaNet + 12 indexed attention (every 4th),
hidden 2560, 256 experts top-10 of ffn 576 (a Q2_0 record of 1.38 MB), a gated shared expert of
512, 4 hyper-connection streams of rank 320, attention 16 q / 4 kv heads of 128 (QSA: 16 indexer
heads of 64, blocks of 16, a budget of 2048), and a PLE module on every DeltaNet layer: 3-grams,
4 heads per order (8 n-gram heads of rows 64 wide, ple_embed_dim 512), its tables in a row store
on disk, F16 rows. At full size (`--ple-gb 0`) the tables' primes start at 2,000,003: about
74 GB of rows, the order of the published checkpoint's ~90 GB. `--ple-gb G` lowers the primes so
the store is about G GB (a 64 GiB-disk machine holds the model file, the 17 GB of experts and a
store of ~24 GB: `--ple-gb 24`); a token reads the same rows either way (8 per PLE layer).

Files (`--dir`, default a temporary directory; kept with `--keep`): the model file (dense weights
random normal, stored F16 (routers and 1-D tensors F32), held as stored: each tensor a window of one pool of normals,
benchmarks/_pooled_random.py, so 48 layers build in seconds), the `.experts` (a pool of random
valid Q2_0 records repeated, benchmarks/_random_experts.py: values do not matter), the `.ngrams` (one random shard of rows
repeated, written shard by shard, never a table in memory). Full size: every shape, the experts
file (17 GB at 48 layers) and the reads per token; not full size unless `--ple-gb 0`: the row
store (the tables' row counts), whose reads per token are the same. Engines through `strata.open_engine` on MLX where it has a GPU, else numpy:
all-resident, and streaming through a quarter of the experts. PLE rows are streamed in both, as
the reference engine streams them (the row cache: ple_reserve's default, read ahead by the
streaming engine). `--tiny` is the same structure at test sizes (tests/benchmarks/test_bench_qwen4_seed.py).
Each step's seconds are printed as it ends (`step ...`: a run cut short by a time limit still says
where its time went); then a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import strata  # noqa: E402
from _random_experts import make_experts_file  # noqa: E402
from strata.config import Backend, Config  # noqa: E402
from strata.formats.expert_record import RecordLayout  # noqa: E402
from strata.formats.experts_file import ExpertsFile  # noqa: E402
from strata.formats.model_file import stored_type_of, write_model  # noqa: E402
from strata.formats.quant_types import QuantType  # noqa: E402
from strata.model_config import Ffn, LayerType, Mixer, ModelConfig, RoutingOrder, TensorNames  # noqa: E402
from strata.model_config import dense_tensor_shapes  # noqa: E402
from strata.ple_store import table_shapes  # noqa: E402
from strata.families.qwen4_exp import ple_layers  # noqa: E402
from strata.runtime.ngram_source import rows_per_position  # noqa: E402
from strata.testing.models import SHAPES, byte_level_tokenizer_json, make_dense  # noqa: E402
from _pooled_random import pooled_normals, write_pooled_store  # noqa: E402

FULL_LAYERS = 48
FULL_PLE_BASE = 2_000_003  # the first prime of the full-size tables: ~74 GB of F16 rows
ROW_TYPE = QuantType.F16
DENSE_TYPE = QuantType.F16  # the model file's dense type (`build`; routers and 1-D tensors F32)
F16_FROM = 1 << 16  # tensors of at least this many weights are made float16, as the model file stores them
# The reference engine's measured reads per decoded token, MB (its own quant types): 3.6 GB dense
# + 0.66 GB of experts. Its names; `PARTS` says which strata tensors each one is.
REFERENCE_MB = {"attention qkv (DeltaNet in_proj qkv)": 711, "DeltaNet out": 444, "attention gate (DeltaNet z)": 379,
                "HC (Q8_0)": 670, "attn q (+ output gate)": 262, "attn output": 151, "router (F32)": 126,
                "read-ahead router": 123, "shared expert": 146, "indexer / k / v / ssm": 70, "output head": 521,
                "experts": 660}  # 10 x 48 x 1.38 MB


def _layer_types(n: int) -> tuple[LayerType, ...]:
    return tuple(LayerType(Mixer.INDEXED_ATTENTION if (l + 1) % 4 == 0 else Mixer.DELTANET, Ffn.MOE) for l in range(n))


def seed_shape(layers: int = FULL_LAYERS, *, ple_gb: float = 0.0, tiny: bool = False) -> ModelConfig:
    """The shape (module doc) with its first `layers` layers; the PLE store about `ple_gb` GB
    (0: full size)."""
    kinds = _layer_types(layers)
    ple = ",".join(str(l) for l, k in enumerate(kinds) if k.mixer is Mixer.DELTANET)
    if tiny:
        cfg = SHAPES["qwen4"].with_fields(n_layers=layers, layer_types=kinds, ple_layer_ids=ple, n_experts=32,
                                          n_experts_per_token=4, ngram_heads_per_order=4, ple_embed_dim=256,
                                          ngram_vocab_base=2003, ple_row_store=True)
        return cfg
    cfg = SHAPES["qwen4"].with_fields(
        architecture="qwen4_exp_text", vocab_size=151936, hidden_size=2560, n_layers=layers,
        layer_types=kinds, n_heads=16, n_kv_heads=4, head_dim=128, rotary_dim=64, n_experts=256, n_experts_per_token=10,
        expert_ffn_size=576, shared_ffn_size=512, routing_order=RoutingOrder.SOFTMAX_TOPK, max_context=4096,
        linear_k_heads=16, linear_v_heads=32, linear_k_head_dim=128, linear_v_head_dim=128, linear_conv_kernel=4,
        hc_count=4, hc_lowrank=320, indexer_heads=16, indexer_head_dim=64, indexer_budget=2048, indexer_block=16,
        ple_layer_ids=ple, ple_embed_dim=512, ple_conv_kernel=4, ngram_size=3, ngram_heads_per_order=4,
        ngram_vocab_base=FULL_PLE_BASE, ngram_vocab_divisor=128, ngram_seed=1234, ngram_eos_token=151645,
        ple_row_store=True)
    if ple_gb:
        cfg = cfg.with_fields(ngram_vocab_base=max(1009, int(FULL_PLE_BASE * ple_gb * 1e9 / store_bytes(cfg))))
    return cfg


def store_bytes(cfg: ModelConfig) -> int:
    """The row store's size (ROW_TYPE rows, pages of 4096 bytes: rows never cross a page)."""
    total = 0
    for rows, width in table_shapes(cfg).values():
        per_page = 4096 // (width * 2)
        total += -(-rows // per_page) * 4096
    return total


def step(name: str, since: float) -> float:
    """Print a step's seconds now (flushed: a run killed later still shows it); -> the clock."""
    now = time.perf_counter()
    print(f"step {name}: {now - since:.1f} s", flush=True)
    return now


def build(base: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """Write the three files (module doc); -> the model path."""
    base.parent.mkdir(parents=True, exist_ok=True)
    model_path, experts_path = base.with_suffix(".gguf"), base.with_suffix(".experts")
    t = time.perf_counter()
    make_experts_file(experts_path, cfg, seed)
    with ExpertsFile.open(experts_path) as xf:
        experts_identity = xf.identity
    t = step(f"build .experts ({experts_path.stat().st_size / 1e9:.1f} GB)", t)
    with write_pooled_store(base.with_suffix(".ngrams"), shapes=table_shapes(cfg), qtype=ROW_TYPE,
                            seed=seed) as store:
        ngrams_identity = store.identity
        t = step(f"build .ngrams ({store.n_pages * store.page_bytes / 1e9:.1f} GB)", t)
    with pooled_normals(seed, f16_from=F16_FROM):
        dense = make_dense(cfg, seed)
    write_model(model_path, cfg, dense, tokenizer_json=byte_level_tokenizer_json(), dense_type=DENSE_TYPE,
                experts_identity=experts_identity, ngrams_identity=ngrams_identity)
    step(f"build model file ({model_path.stat().st_size / 1e9:.1f} GB)", t)
    return model_path


def _built(base: Path, cfg: ModelConfig) -> Path:
    """The files at `base` if they were built for `cfg` (and are complete), else built there."""
    from strata.formats.model_file import read_model_config

    model_path = base.with_suffix(".gguf")
    try:
        if read_model_config(model_path) == cfg and base.with_suffix(".ngrams").exists():
            return model_path
    except Exception:  # noqa: BLE001 - absent or unreadable: build again
        pass
    return build(base, cfg)


def _part(name: str) -> str:
    n = TensorNames
    checks = ((n.ssm_qkv, "attention qkv (DeltaNet in_proj qkv)"), (n.ssm_out, "DeltaNet out"),
              (n.ssm_z, "attention gate (DeltaNet z)"), (".hc_", "HC (Q8_0)"), ("hc_output", "HC (Q8_0)"),
              (n.attn_q, "attn q (+ output gate)"), (n.attn_gate, "attn q (+ output gate)"),
              (n.attn_output, "attn output"), (n.router, "router (F32)"), ("_shexp", "shared expert"),
              (".ple_", "PLE key / value / conv"), (n.output, "output head"))
    for key, part in checks:
        if key in name or name.endswith(key):
            return part
    return "indexer / k / v / ssm"


def files_bytes(cfg: ModelConfig) -> int:
    """The three files' size, about: the experts, the row store, the dense weights as F16."""
    rec = RecordLayout(QuantType.Q2_0, cfg.hidden_size, cfg.expert_ffn_size)
    dense = sum(2 * int(np.prod(shape)) for shape in dense_tensor_shapes(cfg).values())
    return cfg.n_moe_layers * cfg.n_experts * rec.padded_bytes + store_bytes(cfg) + dense


def files_dir(cfg: ModelConfig) -> str | None:
    """/dev/shm where it (and the RAM) holds the files with a tenth to spare: no disk writes or
    fsyncs in the build (at 48 layers ~29 GB, the experts' 17 GB fsync alone is seconds of a
    150 s run) and a miss is a memory copy, as decode.py's runs; else None (the temporary directory)."""
    import os
    import shutil

    shm, need = Path("/dev/shm"), files_bytes(cfg) * 1.1
    if not (shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need):
        return None
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    return str(shm) if avail > 2 * need else None  # the files, and the engines' own host memory beside them


def token_budget(cfg: ModelConfig, *, float32: bool = False) -> dict[str, int]:
    """Bytes one decoded token reads, by the reference engine's parts, as strata holds them: dense
    tensors once each as the model file stores them (the embedding one row), the read-ahead
    router's Q8_0 copy, one ROW_TYPE row per n-gram head of each PLE layer, k expert records per
    MoE layer. float32: the dense tensors as float32 instead (what the MLX engines held before
    they kept dense weights as stored)."""
    out: dict[str, int] = {}
    for name, shape in dense_tensor_shapes(cfg).items():
        stored = stored_type_of(name, shape, DENSE_TYPE)
        n = (4 if float32 or stored is QuantType.F32 else 2) * int(np.prod(shape))
        if name == TensorNames.token_embd:
            out["embedding row"] = n // shape[0]
            continue
        out[_part(name)] = out.get(_part(name), 0) + n
    routers = cfg.n_moe_layers * cfg.n_experts * cfg.hidden_size
    out["read-ahead router"] = routers * 34 // 32  # Q8_0: 34 bytes per 32 weights (Config.pred_q8)
    width = next(iter(table_shapes(cfg).values()))[1]
    out["PLE rows"] = rows_per_position(cfg) * width * 2
    rec = RecordLayout(QuantType.Q2_0, cfg.hidden_size, cfg.expert_ffn_size).record_bytes
    out["experts"] = cfg.n_moe_layers * cfg.n_experts_per_token * rec
    return out


@contextlib.contextmanager
def _profiled(top: int, what: str):
    """cProfile over the block when top > 0: its `top` functions by cumulative time printed at the
    end, also when interrupted (a run stopped by its time limit shows where the time went)."""
    if top <= 0:
        yield
        return
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        stats = pstats.Stats(prof, stream=sys.stdout)
        for order in ("cumulative", "tottime"):  # the chain, then the leaves (where the host waited)
            print(f"--- {what}: the top {top} by {order} time", flush=True)
            stats.sort_stats(order).print_stats(top)
        sys.stdout.flush()


def decode_ms(model, config: Config, *, stream: bool, tokens: int, prompt: int = 8,
              profile_top: int = 0) -> tuple[float, object]:
    """ms per decoded token after a `prompt`-token prefill and one warm decode (first calls JIT-compile);
    -> (ms, the stream report of the timed tokens or None). profile_top: cProfile the open, the
    prefill and the first decode (never the timed tokens)."""
    what = "streaming" if stream else "all-resident"
    t = time.perf_counter()
    prompt_ids = list(range(32, 32 + prompt))
    with contextlib.ExitStack() as stack:
        with _profiled(profile_top, f"{what} open, prefill, first decode"):
            engine = stack.enter_context(strata.open_engine(model, config, stream=stream))
            t = step(f"{what} open", t)
            engine.prefill(prompt_ids)
            t = step(f"{what} prefill {prompt} tokens", t)
            token = prompt_ids[-1]
            engine.decode(token)  # warm
            step(f"{what} first decode", t)
        since = engine.ledger() if stream else None
        start = time.perf_counter()
        for _ in range(tokens):
            token = int(np.argmax(engine.decode(token))) % 256
        ms = (time.perf_counter() - start) * 1e3 / tokens
        step(f"{what} {tokens} timed tokens ({ms:.1f} ms/token)", start)
        return ms, (engine.report(since) if stream else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=FULL_LAYERS)
    ap.add_argument("--ple-gb", type=float, default=0.0, help="the row store's size in GB (0: full size, ~74 GB)")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens prefilled before decoding (default 8)")
    ap.add_argument("--tiny", action="store_true", help="the structure at test sizes")
    ap.add_argument("--dir", default=None, help="where the files go (default: /dev/shm where it holds them, "
                                                "else a temporary directory)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="build into DIR once and reuse the files there "
                                                               "(a second call skips the build: minutes at full size)")
    ap.add_argument("--backend", choices=("auto", "numpy", "mlx"), default="auto")
    ap.add_argument("--profile-top", type=int, default=0, metavar="N",
                    help="cProfile each engine's open, prefill and first decode: print the top N functions")
    ap.add_argument("--stacks-every", type=float, default=0.0, metavar="S",
                    help="print every thread's stack every S seconds (faulthandler: also while the main "
                         "thread waits inside MLX, where a time limit's SIGINT cannot reach Python)")
    ap.add_argument("--skip", default="", help="comma list of runs to skip: resident, streaming")
    args = ap.parse_args(argv)
    if not 0 < args.layers <= FULL_LAYERS:
        ap.error(f"--layers must be 1..{FULL_LAYERS}")
    if args.stacks_every > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.stacks_every, repeat=True, file=sys.stdout)
    cfg = seed_shape(args.layers, ple_gb=args.ple_gb, tiny=args.tiny)
    skip = set(filter(None, args.skip.split(",")))
    from strata.runtime import ngram_source

    # the reference engine streams its PLE rows: measure that, never the tables read whole
    ngram_source.resident_room = lambda model, config: 0
    where = args.dir if args.dir is not None else files_dir(cfg)
    print(f"files in {where or tempfile.gettempdir()} (~{files_bytes(cfg) / 1e9:.1f} GB)", flush=True)
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        t0 = time.perf_counter()
        path = _built(Path(args.keep) / "qwen4_seed", cfg) if args.keep else build(Path(tmp) / "qwen4_seed", cfg)
        build_s = time.perf_counter() - t0
        t = time.perf_counter()
        with strata.load(path) as model:
            step("load", t)
            backend = Backend(args.backend)
            base = Config(backend=backend, moce_lambda=0.0)
            from strata.runtime.decode import cache_config_for

            least = cache_config_for(model, base, 1).min_capacity  # the smallest legal arena (tiny sizes)
            quarter = f"{max(cfg.n_moe_layers * cfg.n_experts // 4, least)}slots"
            runs, reports = {}, {}
            if "resident" not in skip:
                # its one-time read of every expert skips their CRC-32 (17 GB at 48 layers, ~7 s on the
                # H200's host with zlib; decoding does not depend on it); streaming verifies each read
                runs["all-resident"], _ = decode_ms(model, base.replace(verify_reads=False), stream=False, tokens=args.tokens, prompt=args.prompt,
                                                    profile_top=args.profile_top)
            if "streaming" not in skip:
                runs[f"streaming, arena {quarter}"], reports["streaming"] = decode_ms(
                    model, base.replace(arena=quarter, profile=True), stream=True, tokens=args.tokens,
                    prompt=args.prompt, profile_top=args.profile_top)
            store = model.ngrams_file
            store_gb = store.n_pages * store.page_bytes / 1e9
    budget, before = token_budget(cfg), token_budget(cfg, float32=True)
    print(f"qwen4-seed: {cfg.n_layers} layers ({len(ple_layers(cfg))} PLE), hidden {cfg.hidden_size}, "
          f"{cfg.n_experts} experts top-{cfg.n_experts_per_token}, row store {store_gb:.2f} GB; "
          f"built in {build_s:.0f} s")
    print(f"{'run':36} {'ms/token':>9}")
    for name, ms in runs.items():
        print(f"{name:36} {ms:9.1f}")
    rep = reports.get("streaming")
    if rep is not None:
        print(f"  streaming: {rep.text()}")
    scale = cfg.n_layers / FULL_LAYERS  # the reference's figures are for 48 layers: per-layer parts scale
    print(f"{'bytes per token':40} {'strata (dense as stored)':>24} {'reference engine':>17}")
    for part in sorted(set(budget) | set(REFERENCE_MB), key=lambda p: -budget.get(p, 0)):
        mine = f"{budget[part] / 1e6:.1f} MB" if part in budget else "-"
        per_layer = scale if part != "output head" else 1.0  # the head is read once whatever the depth
        ref = f"{REFERENCE_MB[part] * per_layer:.0f} MB" if part in REFERENCE_MB and not args.tiny else "-"
        print(f"  {part:38} {mine:>24} {ref:>17}")
    experts = budget["experts"]
    print(f"  {'total: dense + PLE rows / experts':38} {(sum(budget.values()) - experts) / 1e9:>20.2f} GB / "
          f"{experts / 1e9:.2f} GB   reference {0.521 + (3.6 - 0.521) * scale:.2f} GB / {0.66 * scale:.2f} GB")
    print(f"  {'dense + PLE rows with float32 dense':38} {(sum(before.values()) - experts) / 1e9:>20.2f} GB   "
          "(before the MLX engines held dense weights as stored)")
    print(json.dumps({"bench": "qwen4_seed", "layers": cfg.n_layers, "tiny": args.tiny, "store_GB": store_gb,
                      "ms_per_token": runs, "bytes_per_token": budget,
                      "bytes_per_token_float32_dense": before, "reference_MB_48_layers": REFERENCE_MB,
                      "build_s": build_s, "ple": None if rep is None else {
                          "rows_read_per_token": rep.ple_rows_read_per_token,
                          "rows_hit_per_token": rep.ple_rows_hit_per_token,
                          "bytes_per_token": rep.ple_bytes_per_token, "wait_ms_per_token": rep.ple_wait_ms_per_token}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
