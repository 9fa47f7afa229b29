"""`epp demo`: simulated vLLM pods, the EPP and a real Envoy on one machine (`make demo`)."""
