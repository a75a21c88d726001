"""The fallback model path: transformers' own forward, for architectures the lean path does not know.

Its cache is transformers' DynamicCache, which grows by concatenation; this wrapper reports its size
from the real tensors with the same properties as KVCache.
"""
from __future__ import annotations

import copy
import inspect

import torch

from ..config import DEFAULT_BLOCK_TOKENS
from ..errors import NotEnoughMemory
from ..info import PoolUsage
from .llama import DTYPE_NAMES, LeanLlama


CONTEXT_WINDOW = 2048  # for a config that names none


class DynamicKVCache:
    num_dropped = 0  # transformers' cache keeps every token (no sliding window)

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache

        self.inner = DynamicCache(config=model.config)
        # what it can grow to, the context window (it allocates nothing ahead: bytes_allocated is what it
        # holds); never 0, which is a remote server's cache, out of sight
        self.capacity_tokens = getattr(model.config, "max_position_embeddings", None) or CONTEXT_WINDOW

    def _tensors(self) -> list[torch.Tensor]:
        found = []
        for layer in getattr(self.inner, "layers", []):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 4:
                    found.append(tensor)
        return found

    @property
    def num_tokens(self) -> int:
        return self.inner.get_seq_length()

    @property
    def bytes_used(self) -> int:
        return sum(t.nbytes for t in self._tensors())

    @property
    def bytes_allocated(self) -> int:
        return self.bytes_used

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_used // self.num_tokens if self.num_tokens else 0


class DynamicPool:
    """transformers' caches are per request and grow as they go: no blocks, no budget, no prefix reuse.
    The scheduler talks to this as to a KVPool."""

    prefix_caching = False

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def check_fits(self, num_tokens: int) -> None:
        pass

    def allocate(self, prompt_ids, num_tokens: int, reuse: bool = True) -> DynamicKVCache:  # nothing to reuse
        return DynamicKVCache(self.model)

    def name_full_blocks(self, sequence, token_ids) -> None:
        pass

    def free(self, sequence, token_ids=None) -> None:
        pass

    def drop_cached(self) -> None:
        pass

    def usage(self) -> PoolUsage:
        return PoolUsage(0, 1, 0, 0, 0)


class TransformersRunner:
    name = "transformers"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.dtype = model.dtype
        self.precision = DTYPE_NAMES.get(model.dtype, "")
        self.context_window = getattr(model.config, "max_position_embeddings", None) or CONTEXT_WINDOW
        self.device = model.device
        # transformers 5.x renamed `past_key_values` to `cache`; accept either.
        parameters = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"

    @property
    def multiply_adds(self) -> tuple[int, int]:
        """(one layer's multiply-adds per token, lm_head's), counted from the model's own matrices, for
        architectures whose config names no Llama-style sizes: every Linear (and GPT-2's Conv1D) but the
        output embedding, spread evenly over the layers."""
        head = self.model.get_output_embeddings()
        total = sum(m.weight.numel() for m in self.model.modules()
                    if m is not head and (isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"))
        return total // self.model.config.num_hidden_layers, head.weight.numel()

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward pass reads: all but the embeddings, of which it reads only the rows
        it needs (unless the output embedding is the same table: lm_head reads all of it)."""
        head = self.model.get_output_embeddings().weight
        by_rows = {id(m.weight) for m in self.model.modules() if isinstance(m, torch.nn.Embedding)} - {id(head)}
        return sum(p.nbytes for p in self.model.parameters() if id(p) not in by_rows)

    def new_cache(self, capacity_tokens: int) -> DynamicKVCache:
        return DynamicKVCache(self.model)

    def new_pool(self, budget_bytes: int, block_size: int = DEFAULT_BLOCK_TOKENS,
                 prefix_caching: bool = True) -> DynamicPool:
        return DynamicPool(self.model)

    def decode(self, tokens: list[int], positions: list[int], caches: list[DynamicKVCache]) -> torch.Tensor:
        """One token for each of B sequences, one forward each (caches of different lengths)."""
        return torch.stack([self.forward(torch.tensor([token], device=self.device), pos, cache)
                            for token, pos, cache in zip(tokens, positions, caches)])

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: int, cache: DynamicKVCache, need_logits: bool = True,
                prompt: bool = False, every_row: bool = False) -> torch.Tensor | None:
        """prompt: transformers' forward either way; every_row: [T, vocab], the logits at every position."""
        positions = torch.arange(pos, pos + ids.shape[0], device=self.device)
        out = self.model(input_ids=ids[None], position_ids=positions[None], cache_position=positions,
                         use_cache=True, logits_to_keep=0 if every_row else 1, **{self._cache_arg: cache.inner})
        if not need_logits:
            return None
        return out.logits[0] if every_row else out.logits[0, -1]


def in_dtype(model, dtype: torch.dtype):
    """The model with its weights in dtype: itself, or a converted copy (the loaded one stays as it is)."""
    if model.dtype == dtype:
        return model
    if isinstance(model, torch.nn.Module):  # its to() converts in place; a FolderModel's reads its file anew
        model = copy.deepcopy(model)
    return model.to(dtype)


def make_runner(model: torch.nn.Module, precision: str = "auto", prefer_lean: bool = True,
                cache_dir: str | None = None, tensor_parallel: int = 1):
    """The lean Llama path when the architecture allows it, else transformers' forward; with
    tensor_parallel > 1 the lean path split over that many processes (auto precision: fp32 there).

    precision "auto": int8 for an fp32 model on CPU where the native decode step runs it (about 3x
    fp32's decode speed at ~91% top-1 agreement with fp32, measured by `phasescope bench`), else the
    model's own dtype (fp32 on CPU, bf16 on CUDA)."""
    if tensor_parallel > 1:
        if not LeanLlama.supports(model):
            raise ValueError(f"tensor parallelism needs the lean Llama-family forward, not {model.config.model_type}")
        from ..tensor_parallel import start

        return start(model, "fp32" if precision == "auto" else precision, tensor_parallel, cache_dir=cache_dir)
    if prefer_lean and LeanLlama.supports(model):
        if precision == "auto" and model.device.type == "cpu" and model.dtype == torch.float32:
            runner = LeanLlama(model, "int8", cache_dir=cache_dir)
            if runner.fused is not None:
                return runner
            try:  # no native step here (no compiler, odd widths): fp32 decodes faster, where it fits
                return LeanLlama(model, "fp32", cache_dir=cache_dir)
            except NotEnoughMemory:
                return runner
        return LeanLlama(model, precision, cache_dir=cache_dir)
    if precision == "int8":
        raise ValueError(f"precision int8 needs the lean Llama-family path; {model.config.model_type} models "
                         "run on transformers' forward in fp32, fp16 or bf16")
    return TransformersRunner(model)
