"""Public test helpers: a fake OpenAI-compatible model server and a real-Envoy runner.

Used by our tests, benchmarks and demo; usable in yours.
"""
