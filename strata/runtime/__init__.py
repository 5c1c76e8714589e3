"""The streaming runtime: arena, reader pool, the split-turn decode loop, the prompt path and the
stream report (docs/runtime.md). Every slot decision is the reference cache machine's.

Modules, one concept each:
    arena     Arena protocol, NumpyArena (one 4096-aligned mapping)
    io        ReaderPool: threads, urgent-first preadv into slots, cancel, wait, fault hooks
    fast_cache FastCache: the in-place twin of the reference cache machine (same actions)
    streamer  Streamer: owns the cache state, applies its actions to the pool
    selector  routing (MoCE) and read-ahead guesses through strata.reference.routing.route
    compute   LayerCompute protocol, NumpyCompute (the reference pieces over arena slots)
    decode    StreamingEngine (the split-turn loop), open_streaming_engine
    prompt    chunked prefill
    budget    the arena size: --arena or the SPEC §7 budget rule
    report    StreamReport
"""
