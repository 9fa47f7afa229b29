"""The cost model: model profiles, the TTFT estimate and its online calibration. Pure.

`profile` says what a model costs on its hardware (KV bytes per token, prefill and decode
step coefficients, tier bandwidths); `estimate` turns a pod's load and cache hit into an
estimated time to first token, term by term; `calibration` fits the prefill and queue
coefficients online from observed times to first byte; `service` ties them together per
model for the scheduler and the server.
"""
