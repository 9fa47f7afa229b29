"""Fuzz targets (`make fuzz`)."""

# Modules with numba-compiled functions (docs/architecture.md, "Compiled loops"): atheris rewrites the
# bytecode of what it instruments, which numba cannot compile, so the targets leave these out.
COMPILED = [
    "epp.kvindex.prefix_walk",
    "epp.kvindex.block_chain",
    "epp.kvindex.cuckoo",
    "epp.kvindex.ownership",
    "epp.kvindex.removal_loop",
    "epp.kvindex.queue_loop",
    "epp.kvindex.store_loop",
    "epp.kvindex.event_scan",
    "epp.kvindex.rolling",
    "epp.costmodel.estimate",
]
