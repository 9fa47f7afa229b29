"""Cache-aware Endpoint Picker (EPP) for LLM inference behind Envoy."""

__version__ = "0.1.0"
