"""The streaming runtime, backend-agnostic: the arena and compute protocols, the reader pool, the
split-turn decode loop, the prompt path and the stream report (docs/runtime.md). Every slot
decision is the cache machine's (strata.cache); the backends (strata.numpy_backend,
strata.mlx_backend) implement the protocols; strata.engines assembles engines.

Modules, one concept each:
    arena     Arena protocol, SlotArena (the slot geometry every arena shares)
    compute   LayerCompute protocol: the per-layer math the loop asks a backend for
    io        ReaderPool: threads, urgent-first preadv into slots, cancel, wait, fault hooks
    streamer  Streamer: owns the cache state, applies its actions to the pool
    selector  routing (MoCE) and read-ahead guesses through strata.reference.routing.route
    decode    StreamingEngine (the split-turn loop over layers of every kind), Ledger
    prompt    chunked prefill
    budget    the arena size: --arena or the design §7 budget rule
    report    StreamReport
"""
