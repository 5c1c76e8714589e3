"""Engines: the protocol the generation loop drives, and `open_engine`, the one place that
chooses an engine for a model and a configuration.

An engine is a session over one model: it holds the positions it has processed and continues
or trims them (strata.session says which positions can be restored). Four engines share the
protocol:

    reference        numpy, every expert resident (strata.numpy_backend.engine.ReferenceEngine)
    numpy streaming  the runtime's StreamingEngine over a NumpyArena and NumpyCompute
    mlx resident     every expert in one MLX arena, routing on the GPU (MlxEngine)
    mlx streaming    the runtime's StreamingEngine over an MlxArena and MlxCompute

`session_engine(model, config)` is the engine a `Model` keeps across `generate` calls: experts
are read once per process, and a prompt that extends what the session holds prefills only the
new suffix.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from strata.config import Backend, Config, load_config
from strata.reference.attention import KVPrecision
from strata.formats.quant_types import QuantType
from strata.session import EngineStats

__all__ = ["Engine", "EngineStats", "open_engine", "resolve_backend", "mlx_refusal", "mlx_gpu_available",
           "session_engine", "close_session"]


class Engine(Protocol):
    """A long-lived session over one model.

    Shapes: T positions, V vocab.
        prefill(tokens [T]) -> logits [V] of the last position
        decode(token) -> logits [V]
        decode_window(tokens [T]) -> logits [T, V] (T = 1 is decode)
    """

    model: object  # the strata.loader.Model it runs (None for an engine built from bare params)
    config: Config | None

    @property
    def length(self) -> int:
        """Positions processed and held."""

    @property
    def tokens(self) -> tuple[int, ...]:
        """Their token ids, in order."""

    def prefill(self, tokens) -> np.ndarray: ...

    def decode(self, token: int) -> np.ndarray: ...

    def decode_window(self, tokens) -> np.ndarray: ...

    def kept_position(self, n: int) -> int:
        """The largest m <= n that trim(m) can restore."""

    def trim(self, n: int) -> None:
        """Keep the first n positions."""

    def reset(self) -> None:
        """Keep no positions (resident experts stay)."""

    def stats(self) -> EngineStats: ...

    def greedy_pipeline(self):
        """Greedy decoding with each next token chosen on the device (strata.device_greedy), or None."""

    def close(self) -> None: ...


def mlx_gpu_available() -> bool:
    """Whether MLX has a GPU here (Metal or CUDA)."""
    try:
        import mlx.core as mx
    except ImportError:
        return False
    cuda = getattr(mx, "cuda", None)
    return bool(mx.metal.is_available() or (cuda is not None and cuda.is_available()))


def mlx_expert_types() -> frozenset:
    """The expert types the MLX backend computes: Q2_0 (its fused kernels) and MLX's own types
    (affine 4/8-bit, MXFP4: their fused kernel, kernels/moe_native.py, or gather_qmm on the ops
    path; MXFP4 not on CUDA's ops path, `native_refusal`)."""
    from strata.formats.mlx_affine import AFFINE_SPECS
    from strata.mlx_backend.quants import native_refusal

    return frozenset(q for q in (QuantType.Q2_0, QuantType.MXFP4, *AFFINE_SPECS) if native_refusal(q) is None)


def header_layouts(header) -> frozenset:
    """The distinct record layouts of an `.experts` header's layers."""
    from strata.formats.expert_record import RecordLayout

    triples = header.layer_qtypes or ((header.qtype,) * 3,)
    return frozenset(RecordLayout(g, header.hidden, header.expert_ffn, header.biases, up_qtype=u, down_qtype=d)
                     for g, u, d in triples)


def gpu_kernel_refusal(header) -> str | None:
    """Why no fused MLX expert kernel reads every layer's records of an `.experts` header on a GPU
    (None: one does, a type per layer and projection as stored: Q2_0's, MLX's own types', and
    llama.cpp's K / IQ types', kernels/moe_ggml.py)."""
    from strata.mlx_backend.experts import fused_refusal

    whys = sorted({why for rec in header_layouts(header) if (why := fused_refusal(rec)) is not None})
    return "; ".join(whys) or None


def mlx_refusal(header) -> str | None:
    """Why the MLX backend cannot compute the experts of an `.experts` header (None: it can). On a
    GPU, every layer's records read by a fused kernel suffice (`gpu_kernel_refusal`); MLX's ops
    path reads one type per file of those `mlx_expert_types` names. Otherwise: a type without an
    MLX kernel or ops path (IQ3_S, BF16, ...; llama.cpp's types off a GPU), or, off a GPU, types
    that differ per layer or projection."""
    gpu = mlx_gpu_available()
    no_kernel = gpu_kernel_refusal(header) if gpu else None
    if gpu and no_kernel is None:
        return None
    known = ", ".join(q.name for q in sorted(mlx_expert_types(), key=int))
    if header.mixed:
        if gpu:
            return f"MLX has no GPU kernel for this model's mix {header.type_names} ({no_kernel})"
        return f"MLX computes experts of one type per file ({known}); this model's mix {header.type_names}"
    if QuantType(header.qtype) not in mlx_expert_types():
        kernels = f" ({no_kernel})" if gpu else " off a GPU"
        return f"MLX computes experts of {known}{kernels}; this model's are {QuantType(header.qtype).name}"
    return None


def resolve_backend(model, config: Config) -> Backend:
    """`Backend.AUTO`: MLX where it has a GPU and a fused kernel reads every layer's experts as
    stored (`gpu_kernel_refusal`: Q2_0, MLX's own types, llama.cpp's K / IQ types with a kernel,
    mixed per layer and projection), numpy otherwise (with a note: `auto_backend_note`). On a
    CPU-only machine numpy is the faster choice where it matters most: it processes prompts
    2.5-10x faster than MLX's CPU build, and MLX decodes within 0.69-1.11x of its time
    (benchmarks/backends.py; docs/perf.md, "Backend choice"); numpy's arithmetic is also the
    reference's (bit-exact at λ = 0). An explicit backend is taken as asked; MLX asked for
    experts it cannot compute (`mlx_refusal`) is a one-line ConfigError."""
    header = model.experts_file.header
    why = mlx_refusal(header) if config.backend is Backend.MLX else None
    if why is not None:
        from strata.errors import ConfigError
        from strata.option_names import option

        raise ConfigError(f"backend mlx: {why} (use {option('backend', 'numpy')} or auto, or convert with "
                          f"{option('experts', 'q2_0', python='expert_type')})")
    if config.backend is not Backend.AUTO:
        return config.backend
    if mlx_gpu_available() and gpu_kernel_refusal(header) is None:
        return Backend.MLX
    return Backend.NUMPY


def auto_backend_note(model, config: Config) -> str | None:
    """The line a report carries where `--backend auto` chose numpy on a machine with an MLX GPU
    because MLX cannot compute these experts (never a silent change of engine); else None."""
    if config.backend is not Backend.AUTO or not mlx_gpu_available():
        return None
    header = model.experts_file.header
    why = gpu_kernel_refusal(header)
    return None if why is None else f"backend auto: numpy computes these experts ({header.type_names}: {why})"


def open_engine(model, config: Config | None = None, *, stream: bool | None = None, plan=None, hook=None,
                keep_trace: bool = False, ple_hook=None, ple_latency=None) -> Engine:
    """The engine for `model` (a Model or a path) under `config` (default: `STRATA_*` over the
    defaults; a mapping of Config fields is read as `Config(**mapping)`). Streaming whenever the config names an arena or the budget rule (design §7) says
    the experts do not all fit; otherwise all-resident, which is what streaming would compute
    anyway (with every expert resident MoCE's bonus lifts all logits alike, so routing is the
    model's own) without a reader pool or slot bookkeeping. The caller closes it.

    stream: True streams even where every expert fits (tests, benchmarks), False never streams,
    None lets the plan decide. plan: an ArenaPlan to use instead of the budget rule's. hook (an
    I/O fault hook) and keep_trace (the cache's event trace) are for tests and tools; ple_hook and
    ple_latency are faults on a PLE model's row reads (an IOHook; the advised reader's latency).

    A model with PLE rows (strata.runtime.ngram_source, which the engines ask) has its row cache's
    pages reserved from the arena's budget here; each engine opens its own row source."""
    from strata.api_args import as_config
    from strata.loader import Model, load
    from strata.runtime.decode import arena_plan_for
    from strata.runtime.ngram_source import row_cache_bytes

    config = as_config(config)  # a Config or a mapping of its fields
    from strata.threads import apply_threads

    from strata.tier2.model import Tier2Model

    model = model if isinstance(model, (Model, Tier2Model)) else load(model)
    config = config if config is not None else load_config()
    if isinstance(model, Tier2Model):  # mlx-lm's model file, experts streamed (strata.tier2)
        from strata.tier2.engine import Tier2Engine

        return Tier2Engine.open(model, config, stream=stream, plan=plan, hook=hook, keep_trace=keep_trace)
    apply_threads(config.threads, model.cfg.hidden_size)  # process-wide BLAS threads (strata/threads.py)
    mlx = resolve_backend(model, config) is Backend.MLX
    plan = plan or arena_plan_for(model, config, ple_bytes=row_cache_bytes(model, config), synchronous=not mlx)
    config = plan.applied(config)  # a short arena's fitted read-ahead depth and pins (plan.knobs says which)
    if config.kv_cache is not KVPrecision.F32 and not mlx:
        from strata.errors import ConfigError

        raise ConfigError(f"kv_cache {config.kv_cache.value}: the MLX engines only (numpy's caches are float32)")
    streaming = plan.streaming if stream is None else stream
    row_faults = dict(hook=ple_hook, latency=ple_latency)
    if not streaming:
        if mlx:
            from strata.mlx_backend.engine import open_resident
        else:
            from strata.numpy_backend.engine import open_resident
        return open_resident(model, config, row_faults=row_faults)
    if mlx:
        from strata.mlx_backend.engine import streaming_parts
    else:
        from strata.numpy_backend.engine import streaming_parts
    notes = (plan.knobs, None if mlx else auto_backend_note(model, config))
    return _streaming(model, config, plan, streaming_parts, hook=hook, keep_trace=keep_trace,
                      kind="mlx streaming" if mlx else "numpy streaming", row_faults=row_faults,
                      note="; ".join(n for n in notes if n) or None)


def _streaming(model, config: Config, plan, parts, *, hook, keep_trace: bool, kind: str, row_faults: dict,
               note: str | None = None):
    """The runtime's StreamingEngine over a backend's arena and compute, with a reader pool, and
    the model's PLE row source where it has one (strata.runtime.ngram_source: the compute's rows,
    read ahead by the engine when streamed; row_faults: faults on its reads). note: a line for
    the report."""
    from strata.runtime.decode import StreamingEngine
    from strata.runtime.ngram_source import ple_rows_for
    from strata.runtime.piece_reader import reader_pool_for

    ple = ple_rows_for(model, config, stream=True, **row_faults)
    pool = None
    try:
        if ple is None:
            arena, compute, notes = parts(model, config, plan)
        else:
            arena, compute, notes = parts(model, config, plan, rows=ple.rows)
            notes = (*notes, ple.reason)
        notes = (*notes, note) if note else notes
        pool = reader_pool_for(model.experts_file, arena, threads=config.io_threads, direct=config.direct_io,
                          verify=config.verify_reads, timeout=config.io_timeout, hook=hook,
                          switch_interval=config.io_switch_ms / 1e3)
        return StreamingEngine(model, config, arena, compute, pool, keep_trace=keep_trace, notes=notes, kind=kind,
                               ngram_rows=None if ple is None else ple.streamed)
    except BaseException:
        if pool is not None:
            pool.close()
        if ple is not None:
            ple.close()
        raise


# ---------------------------------------------------------------- the engine a Model keeps


def session_engine(model, config: Config) -> Engine:
    """The engine `model` keeps for `config`: the one it holds when that was opened with an
    equal config, else a new one (one arena per model: the old one is closed first, once no
    call is using it; strata.sharing.SharedSession.wait_until_idle)."""
    with model.session_lock:
        held = model.session
        if held is not None and held.config == config and not held.closed:
            return held
        if held is not None and not held.closed:
            held.sharing.wait_until_idle("this call's config differs from the session's (a new engine would "
                                         "close the one that iterator runs on)")
        close_session(model)
        engine = open_engine(model, config)
        model.session = engine
        return engine


def close_session(model) -> None:
    """Close the engine `model` keeps, if any."""
    held, model.session = model.session, None
    if held is not None:
        held.close()


def common_prefix(a, b) -> int:
    """How many leading token ids two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


__all__ += ["common_prefix"]
