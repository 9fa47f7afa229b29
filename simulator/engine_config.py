"""A simulated engine's configuration: the vLLM flags it follows, checked. Pure."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Final

CPU_WRITE_POLICIES: Final = ("write-through", "write-back")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """vLLM's flags: `--num-gpu-blocks-override`, `--block-size`, `--max-num-batched-tokens`,
    `--max-num-seqs`, `--async-scheduling` / `--no-async-scheduling`; `cpu_blocks`: the CPU offload tier's
    capacity in blocks (0: none); `cpu_write_policy`: when a block reaches it, "write-through" (as it is
    computed: vLLM's `OffloadingConnector`, SGLang HiCache's default) or "write-back" (when the GPU
    evicts it: SGLang HiCache's `write_back`); `model`: the served model name (its metrics'
    `model_name`); `dp_rank`: the data-parallel rank in its events.

    The defaults are vLLM's for its OpenAI server on an H100-class GPU (`EngineArgs.get_batch_defaults`:
    8,192 batched tokens and 1,024 sequences with 70 GiB or more, not an A100; 2,048 and 256 below), the
    default latency profile's GPU; and async scheduling, which vLLM turns on unless something in its
    configuration cannot take it (`VllmConfig.__post_init__`)."""

    num_gpu_blocks: int = 4096  # including vLLM's reserved null block
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    cpu_blocks: int = 0
    cpu_write_policy: str = "write-through"
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
        if self.cpu_write_policy not in CPU_WRITE_POLICIES:
            choices = ", ".join(CPU_WRITE_POLICIES)
            raise ValueError(f"cpu_write_policy must be one of {choices}, got {self.cpu_write_policy!r}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every decode takes a token)")


def add_scheduling_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--async-scheduling` / `--no-async-scheduling` and `--cpu-write-policy`, as `epp-sim replay` and
    `epp-sim serve-engine` take them."""
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's engine core schedules a step while the one before runs (vLLM's default): a request "
        "arriving mid-step joins a step later; --no-async-scheduling: the synchronous core",
    )
    parser.add_argument(
        "--cpu-write-policy",
        choices=CPU_WRITE_POLICIES,
        default="write-through",
        help="when a block reaches the CPU tier: write-through (as it is computed: vLLM's "
        "OffloadingConnector, SGLang HiCache's default) or write-back (when the GPU evicts it) "
        "(default %(default)s)",
    )
