"""A simulated engine's configuration: the vLLM flags it follows, checked. Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """vLLM's flags: `--num-gpu-blocks-override`, `--block-size`, `--max-num-batched-tokens`,
    `--max-num-seqs`, `--async-scheduling` / `--no-async-scheduling`; `cpu_blocks`: the CPU offload tier's
    capacity in blocks (0: none); `model`: the served model name (its metrics' `model_name`); `dp_rank`:
    the data-parallel rank in its events.

    The defaults are vLLM's for its OpenAI server on an H100-class GPU (`EngineArgs.get_batch_defaults`:
    8,192 batched tokens and 1,024 sequences with 70 GiB or more, not an A100; 2,048 and 256 below), the
    default latency profile's GPU; and async scheduling, which vLLM turns on unless something in its
    configuration cannot take it (`VllmConfig.__post_init__`)."""

    num_gpu_blocks: int = 4096  # including vLLM's reserved null block
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    cpu_blocks: int = 0
    model: str = "model"
    dp_rank: int | None = None
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (one is the null block)")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.cpu_blocks < 0:
            raise ValueError("cpu_blocks must be >= 0")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every decode takes a token)")
