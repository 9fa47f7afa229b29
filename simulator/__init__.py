"""Trace-replay simulator: runs the production scheduler against simulated engines.

The engine model, traces and replay commands arrive with the simulator issue; this package
exists now so that the `epp-sim` entry point and the layout are in place.
"""
