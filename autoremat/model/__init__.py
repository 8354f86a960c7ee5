"""Model: what a graph costs, in bytes and seconds, under a given save/recompute choice.

Per node (`profile`, into `graph_profile`'s `GraphProfile`): storage bytes, FLOPs, roofline time (`devices`),
measured kernel scratch (`scratch`), Inductor's fusion and what its code allocates (`fusion`, `inductor_code`)
and the 16-bit safety of each call (`precision_measure`).
Per plan: the exact execution order (`schedule`, a `Schedule`) and the live bytes at every op (`memory`, with
`cuts`, `recomputed_writes`, `inplace`, `region_crossings`), the read windows the ILP plans on (`lifetimes`),
and the fixed parts of the budget (`ledger`, `optimizers`). Imports `capture/`, `passes/` and the shared modules.
"""
