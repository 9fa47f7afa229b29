"""In-tree plugins, one per module. `epp.scheduling.builtin` lists them."""
