"""Opt-in tests against a real vLLM engine on the CPU (`make test-vllm`); skipped unless configured."""
