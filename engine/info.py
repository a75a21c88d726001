"""What the engine tells the app about its model and its KV pool: plain data, like the events."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    source: str
    device: str
    dtype: str
    model_path: str  # which forward runs: "lean-llama" or "transformers"
    decode_path: str  # how a decode step runs: "fused C++" (one native call), "CUDA graph" (+ torch.compile),
    #                   or "PyTorch ops"
    precision: str  # fp32, fp16, bf16 or int8
    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_window: int
    kv_bytes_per_token: int  # by the formula
    chat_template: bool = True  # False: a base model's tokenizer, the messages joined as plain text


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """The pool at one moment, in blocks (like vLLM's kv_cache_usage_perc, with the cached part apart)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    num_used: int  # held by running requests
    num_cached: int  # held by nobody, kept for prefix reuse until evicted

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_used - self.num_cached

    @property
    def usage(self) -> float:
        """Share of the pool held by running requests, 0-1."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block
