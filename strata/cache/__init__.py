"""The expert cache: the state machine that decides which slot holds which expert (docs/cache.md).

Modules, one concept each:
    types    events, actions, CacheConfig, CacheStats, slot states (the machine's vocabulary)
    state    CacheState (frozen) and its views
    machine  the reference: `step(state, event) -> (state, actions)`, pure; it defines correct
    fast     FastCache: the in-place twin the runtime steps (same actions, held to the reference)
    replay   replaying a recorded event sequence through the reference

Nothing here does I/O or computes routing: the runtime applies the actions, the reference
routing chooses the experts.
"""
