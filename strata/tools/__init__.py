"""The analysis kit (design §8, docs/analysis.md): measurements driven by the reference routing and
the reference cache state machine, never a second copy of either.

    trace        record router inputs, logits and λ = 0 selections (.npz)
    closed_loop  MoCE routing against simulated residency, driving `step` (shared by all below)
    replay       the closed-loop simulator over a trace; capacity / read-ahead / policy grids
    belady       Belady's MIN bound on a selection stream
    recall       read-ahead recall one and two layers ahead
    quality      KLD and routed-output error vs λ = 0, scored in decode order
    sweep        the J × λ policy table
    options, tables, plots   CLI flags -> configurations, text/Markdown tables, PNGs
"""
