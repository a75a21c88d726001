"""The KV cache: the keys and values of every token seen so far, one slot per position.

It is allocated once per request, with room for the prompt plus the reply (rounded up to whole
blocks), and filled explicitly, layer by layer, by the model's forward. Its sizes are read from the
real tensors, so the app can show them beside the formula.
"""
from __future__ import annotations

import torch


def kv_bytes_formula(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int, num_tokens: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element x tokens."""
    return 2 * num_layers * num_kv_heads * head_dim * element_size * num_tokens


def round_up(num_tokens: int, block: int) -> int:
    return -(-num_tokens // block) * block


class KVCache:
    """Preallocated keys and values for one sequence, in one tensor kv: [layers, 2, kv_heads, capacity,
    head_dim]; k and v are its halves, [layers, kv_heads, capacity, head_dim] each."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.kv = torch.zeros((num_layers, 2, num_kv_heads, capacity_tokens, head_dim), dtype=dtype, device=device)
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]
        self._filled = [0] * num_layers  # tokens written per layer

    @property
    def capacity_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def num_tokens(self) -> int:
        """Positions written in every layer."""
        return min(self._filled)

    @property
    def bytes_per_token(self) -> int:
        layers, heads, _, head_dim = self.k.shape
        return 2 * layers * heads * head_dim * self.k.element_size()

    @property
    def bytes_used(self) -> int:
        return self.bytes_per_token * self.num_tokens

    @property
    def bytes_allocated(self) -> int:
        return self.kv.nbytes

    def reserve(self, pos: int, num_tokens: int) -> int:
        """The end of positions [pos, pos + num_tokens), checked to fit in the cache."""
        end = pos + num_tokens
        if end > self.capacity_tokens:
            raise ValueError(f"KV cache full: {end} tokens do not fit in {self.capacity_tokens}")
        return end

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([kv_heads, T, head_dim]) at positions [pos, pos+T) of one layer and return
        that layer's keys and values for positions [0, pos+T)."""
        end = self.reserve(pos, k.shape[1])
        self.k[layer, :, pos:end] = k
        self.v[layer, :, pos:end] = v
        self._filled[layer] = end
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def mark_written(self, end: int) -> None:
        """Positions [0, end) are now filled in every layer (by a kernel writing kv directly)."""
        self._filled = [end] * len(self._filled)

    def update_kv(self, layer: int, pos: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same with keys and values together, kv: [2, kv_heads, T, head_dim], in one copy."""
        end = self.reserve(pos, kv.shape[2])
        self.kv[layer, :, :, pos:end] = kv
        self._filled[layer] = end
        return self.k[layer, :, :end], self.v[layer, :, :end]
