"""A lean forward pass for Llama-family models (Llama, SmolLM, Mistral, Qwen2 with its QKV bias).

It reads the weights of a loaded transformers model once, fuses Q/K/V and gate/up into single
matrices (dense, or int8 with `precision="int8"`), and writes keys and values into our own paged KV
pool. `forward` runs T tokens of one sequence at positions [pos, pos+T) (a prefill chunk); `decode`
runs one token of each of B sequences (a decode step), reading every weight once for all of them.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import DEFAULT_BLOCK_TOKENS
from ..errors import NotEnoughMemory
from ..events import WAKE
from ..kernels.cuda_graphs import GraphDecode
from ..kernels.fused import load_fused_decode
from ..kv_pool import KVPool, SequenceKV, blocks_for
from ..sampling import top_logits, top_logits_batch, top_tempered
from .loader import cache_root, memory_short
from .quantize import Int8Cache, Int8Linear, linear_factory

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def attention_window(config) -> int | None:
    """How many of the last tokens the model's attention sees, where its config sets a sliding window
    (Mistral 7B v0.1's 4,096; Qwen2's only with use_sliding_window): the lean forward attends to every
    token, so its context window ends there, where the two agree. None: it sees them all."""
    if getattr(config, "model_type", None) == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None) or None
INT8_FORMAT = 1  # the layout of the cached int8 weights: raise it when LeanLlama's fusing or quantizing changes
# Rows per MLP pass on CPU: a long prompt's [T, 2*I] gate/up output (25 MB at 2,048 tokens for SmolLM2)
# leaves the caches between the matrix products; 512 rows at a time stay in L3 (pp2048's MLP 9 % faster in
# int8, 2 % in fp32, alternating in one process; every row's sums are the same)
MLP_ROWS = 512
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# SDPA's kernels for the eager ops on CUDA: all but cuDNN's, which builds a plan for each new shape (tens to
# hundreds of ms; a prompt's length is new, and so is each decode step's context). The CUDA graphs' buckets
# fix their shapes, so they keep it.
EAGER_CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def matrix_numbers(config) -> tuple[int, int]:
    """The numbers in a Llama-family layer's matrices (q, k, v, o and the MLP's gate, up and down), which are
    also its multiply-adds per token, and in the head's."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    return attention + 3 * hidden * config.intermediate_size, hidden * config.vocab_size


def _fused(make, *parts: tuple[torch.nn.Module, int]):
    """One linear computing several linears (modules with .weight and .bias), their outputs concatenated;
    each part is (linear, pair_heads), see _paired. A cached int8 form is taken as it is: the fp32 rows
    are then never reordered or concatenated."""
    biases = [_paired(linear.bias, heads) for linear, heads in parts]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else linear.weight.new_zeros(linear.weight.shape[0])
                          for b, (linear, _) in zip(biases, parts)])
    if isinstance(make, Int8Cache):
        shape = (sum(_shape(linear)[0] for linear, _ in parts), _shape(parts[0][0])[1])
        cached = make.cached(shape, bias)
        if cached is not None:
            return cached
    return make(torch.cat([_paired(linear.weight, heads) for linear, heads in parts]).detach(), bias)


def _shape(linear) -> torch.Size:
    """A linear's weight's [out, in]; a FolderModel's says it without converting the weight to its dtype."""
    return linear.weight_shape if hasattr(linear, "weight_shape") else linear.weight.shape


def _paired(t: torch.Tensor | None, pair_heads: int) -> torch.Tensor | None:
    """A weight's or bias's rows as they are, or with pair_heads reordered within each head from the
    halves layout (x_i, x_{i+D/2}) to adjacent pairs, so that the rotary embedding is a complex product.
    Q and K reordered alike leave every attention score unchanged."""
    if t is None:
        return None
    t = t.detach()
    if not pair_heads:
        return t
    # [H*D, ...] -> [H, 2, D/2, ...] -> [H, D/2, 2, ...]
    return t.reshape(pair_heads, 2, t.shape[0] // pair_heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def eager_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """Attention as the textbook writes it: the whole score matrix S = Q K^T / sqrt(D) ([H, T, n], what
    a fused kernel never holds at once), the causal mask, softmax, then S V. q [H, T, D]; keys and values
    [KV, n, D], each KV head shared by H / KV query heads. Returns [H, T, D]."""
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
    scores = q @ keys.transpose(1, 2) / keys.shape[-1] ** 0.5  # [H, T, n]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ values


def score_matrix_bytes(num_heads: int, num_tokens: int, num_keys: int, element_size: int = 4) -> int:
    """What eager attention materializes for one layer: heads x queries x keys scores."""
    return num_heads * num_tokens * num_keys * element_size


class StageClock:
    """Adds the wall time since the previous lap to a stage of the forward pass (the explain mode's
    pipeline), after a device synchronize so that a stage's time is its own. Without a dict, nothing.
    wake: called before the clock starts, its time kept as WAKE (LeanLlama.wake_threads)."""

    def __init__(self, stage_ms: dict[str, float] | None, device: torch.device,
                 wake: Callable[[], object] | None = None) -> None:
        self.stage_ms, self.device = stage_ms, device
        if stage_ms is not None and wake is not None:
            stage_ms[WAKE] = wake()
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.stage_ms is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stage_ms[stage] = self.stage_ms.get(stage, 0.0) + (now - self.last) * 1000
        self.last = now


@dataclass(slots=True)
class _Layer:
    qkv: object  # x [T, C] -> [T, (H + 2*KV) * D]
    o: object  # [T, H*D] -> [T, C]
    gate_up: object  # [T, C] -> [T, 2*I]
    down: object  # [T, I] -> [T, C]
    attn_norm: torch.Tensor  # [C]
    mlp_norm: torch.Tensor  # [C]


class LeanLlama:
    """Llama-family forward over our KVCache. `forward` returns the last position's logits."""

    name = "lean-llama"
    native = True  # decode through the native step where it builds (a tensor-parallel slice cannot)
    explains = True  # forward and decode can time their stages and hand out attention weights (explain mode)
    drafts = True  # decode takes several positions of one sequence in a batch (speculative decoding)

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        """A Llama-family model with the family's SiLU MLP (a config naming another activation runs on
        transformers' forward)."""
        config = model.config
        return (getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES
                and getattr(config, "hidden_act", "silu") == "silu")

    def __init__(self, model: torch.nn.Module, precision: str = "auto", max_positions: int = 32768,
                 cache_dir: str | None = None) -> None:
        config = model.config
        self.device, self.dtype = model.device, model.dtype
        self.precision = DTYPE_NAMES.get(self.dtype, str(self.dtype)) if precision in ("auto", "fp32", "fp16",
                                                                                         "bf16") else precision
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        # which KV head each query head reads, where groups are uneven (a tensor-parallel slice); else
        # None: query head h reads KV head h // (heads / kv_heads)
        kv_head_of = getattr(config, "kv_head_of", None)
        uniform = [h // (self.num_heads // self.num_kv_heads) for h in range(self.num_heads)]
        self.kv_head_of = None if kv_head_of in (None, uniform) else torch.tensor(kv_head_of, device=model.device)
        self.eps = config.rms_norm_eps
        self.context_window = min(config.max_position_embeddings, max_positions,
                                  attention_window(config) or max_positions)
        if self.device.type == "cpu":
            self._check_room(config)
        make = linear_factory(self.precision, self.device)
        weights_key = getattr(model, "cache_key", None)  # a model read from a folder: its int8 form is kept
        if make is Int8Linear and weights_key:
            name = hashlib.sha256(f"{INT8_FORMAT}|{model.cache_name}".encode()).hexdigest()[:20]
            make = Int8Cache(cache_root(cache_dir) / "int8" / f"{name}.safetensors", weights_key)
        # fp32 activations (fp32, int8): rotary embedding as one in-place complex product on paired q/k
        # rows; half precision keeps the halves layout (complex half ops are thin on CPU)
        self.pair_rope = self.dtype == torch.float32
        self.layers = [self._layer(make, layer, self.pair_rope) for layer in model.model.layers]
        self.embed = model.model.embed_tokens.weight.detach()
        self.final_norm = model.model.norm.weight.detach()
        self.lm_head = make(model.lm_head.weight.detach(), None)
        self.cos, self.sin = self._rope_tables(model, self.context_window)
        half = self.head_dim // 2  # cos + i sin per position and pair (the stored sine's first half is negated)
        self.rotations = torch.complex(self.cos[..., :half], -self.sin[..., :half]) if self.pair_rope else None
        # decode (T = 1) as one native call where it can be built: fp32 or int8 weights on CPU
        is_native = (self.native and self.pair_rope and self.device.type == "cpu"
                     and self.precision in ("fp32", "int8"))
        self.fused = load_fused_decode(self, cache_root(cache_dir)) if is_native else None
        self._use_native_int8(self.fused)
        if isinstance(make, Int8Cache):
            make.save()  # after the native library has packed the rows (if it does): they are kept so
        # decode on a GPU: the step's kernels recorded once per batch and context bucket and replayed
        self.graphs = GraphDecode(self) if self.device.type == "cuda" else None
        # prefill's attention: "auto" (the native kernel where it is built, else PyTorch's fused SDPA),
        # "sdpa" (PyTorch's fused kernel) or "eager" (the score matrix materialized, as textbooks write it)
        self.attention = "auto"

    @property
    def decode_path(self) -> str:
        """How a decode step runs: one native call, replayed CUDA graphs, or PyTorch ops."""
        if self.fused is not None:
            return "fused C++"
        if self.graphs is not None:
            return "CUDA graph + torch.compile" if self.graphs.compile else "CUDA graph"
        return "PyTorch ops"

    def _use_native_int8(self, fused, keep_copy: bool = False) -> None:
        """int8 linears run through the native library's matmul, on the int8 rows the decode step reads
        (activations quantized per block of 64, as there), or with fused None through FBGEMM."""
        if self.precision == "int8":
            for linear in self._linears():
                linear.use_kernel(None if fused is None else fused.linear_int8, keep_copy)

    @contextmanager
    def fbgemm_linears(self, keep_copy: bool = False) -> Iterator[None]:
        """Within the block int8 linears run through FBGEMM (one activation scale per tensor, its own packed
        copy of the weights), all else as before: int8 prefill as it was before the native kernel. With
        keep_copy FBGEMM's copy outlives the block (comparisons that alternate; a block without lets it go)."""
        self._use_native_int8(None)
        try:
            yield
        finally:
            self._use_native_int8(self.fused, keep_copy)

    @contextmanager
    def pytorch_decode(self) -> Iterator[None]:
        """Within the block nothing native runs, even where the native library is built: decode and
        prefill's attention run the PyTorch ops, int8 linears FBGEMM, no CUDA graph (to compare the two)."""
        native, self.fused = self.fused, None
        graphs, self.graphs = self.graphs, None
        self._use_native_int8(None)
        try:
            yield
        finally:
            self.fused, self.graphs = native, graphs
            self._use_native_int8(native)

    def _stage_clock(self, stage_ms: dict[str, float] | None) -> StageClock:
        return StageClock(stage_ms, self.device, self.wake_threads)

    def wake_threads(self) -> float:
        """Before a forward whose stages are timed: its threads woken first, or the first stage's time would
        hold their waking (FusedDecode.wake_threads; the native step wakes its own); nothing without the
        native library. Returns the ms."""
        return self.fused.wake_threads() if self.fused is not None else 0.0

    def top_logits(self, logits: torch.Tensor, k: int) -> tuple[list[int], list[float], float]:
        """sampling.top_logits, from the native library when decode uses it."""
        return (self.fused.top_logits if self.fused is not None else top_logits)(logits, k)

    def top_tempered(self, scores: torch.Tensor, k: int, scale: float) -> tuple[list[int], list[float], float]:
        """sampling.top_tempered, from the native library when decode uses it."""
        return (self.fused.top_tempered if self.fused is not None else top_tempered)(scores, k, scale)

    @property
    def nucleus(self):
        """FusedDecode.nucleus where decode is native (else None: sampling's _kept finds the nucleus)."""
        return self.fused.nucleus if self.fused is not None else None

    @property
    def penalized(self):
        """FusedDecode.penalized where decode is native (else None: sampling's apply_repetition_penalty)."""
        return self.fused.penalized if self.fused is not None else None

    def top_logits_batch(self, logits: torch.Tensor, k: int) -> list[tuple[list[int], list[float], float]]:
        """top_logits of each row of logits [B, vocab]."""
        return (self.fused.top_logits_batch if self.fused is not None else top_logits_batch)(logits, k)

    def _check_room(self, config) -> None:
        """Refuse, in one line, weights that would not fit in the memory left (see NotEnoughMemory)."""
        layer, head = matrix_numbers(config)  # the head: tied to the embedding in fp32 it takes no more, counted
        numel = self.num_layers * layer + head
        element = 1 if self.precision == "int8" else torch.tensor([], dtype=self.dtype).element_size()
        if (free := memory_short(numel * element)) is not None:
            raise NotEnoughMemory(self.precision, numel * element, free, numel)

    def _layer(self, make, layer: torch.nn.Module, pair_rope: bool) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        heads, kv_heads = (self.num_heads, self.num_kv_heads) if pair_rope else (0, 0)
        qkv = _fused(make, (attn.q_proj, heads), (attn.k_proj, kv_heads), (attn.v_proj, 0))
        return _Layer(qkv=qkv, o=_fused(make, (attn.o_proj, 0)),
                      gate_up=_fused(make, (mlp.gate_proj, 0), (mlp.up_proj, 0)),
                      down=_fused(make, (mlp.down_proj, 0)),
                      attn_norm=layer.input_layernorm.weight.detach(),
                      mlp_norm=layer.post_attention_layernorm.weight.detach())

    def _rope_tables(self, model: torch.nn.Module, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The model's own rotary module knows its rope type and scaling. Tables are [positions, 1, D];
        # the sine's first half is negated so that rotate_half(x) * sin == x.roll(D/2) * sin.
        positions = torch.arange(num_positions, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(probe, positions)
        half = self.head_dim // 2
        sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return cos[0, :, None, :].contiguous(), sin[:, None, :].contiguous()

    def _linears(self) -> list:
        layers = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return layers + [self.lm_head]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward pass reads (the embedding reads only the rows it needs)."""
        norms = sum(layer.attn_norm.nbytes + layer.mlp_norm.nbytes for layer in self.layers)
        return sum(lin.nbytes for lin in self._linears()) + norms + self.final_norm.nbytes

    def new_pool(self, budget_bytes: int, block_size: int = DEFAULT_BLOCK_TOKENS, prefix_caching: bool = True,
                 kv_dtype: torch.dtype | None = None) -> KVPool:
        """The KV pool, in the activations' dtype or kv_dtype (fp16 halves what long contexts read)."""
        kv_dtype = kv_dtype or self.dtype
        if self.fused is not None and kv_dtype == torch.float16 and not self.fused.kv_formats & 2:
            raise ValueError("an fp16 KV cache needs a CPU with the F16C instructions for the native decode step")
        return KVPool.with_budget(budget_bytes, self.num_layers, self.num_kv_heads, self.head_dim, block_size,
                                  kv_dtype, self.device, prefix_caching)

    def new_cache(self, capacity_tokens: int) -> SequenceKV:
        """One sequence's cache in a pool of its own (for tests and one-off forwards)."""
        size = DEFAULT_BLOCK_TOKENS
        pool = KVPool(self.num_layers, self.num_kv_heads, self.head_dim, blocks_for(capacity_tokens, size), size,
                      self.dtype, self.device, prefix_caching=False)
        return pool.allocate([], capacity_tokens)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: int, cache: SequenceKV, need_logits: bool = True,
                stage_ms: dict[str, float] | None = None, prompt: bool = False,
                every_row: bool = False) -> torch.Tensor | None:
        """ids: [T] token ids of one sequence at positions [pos, pos+T). Returns logits [vocab] of the last.
        stage_ms: a dict that receives the time of each stage (FORWARD_STAGES), for the explain mode.
        prompt: a prompt's chunk, which runs the prefill's kernels even for one token (one token otherwise
        takes the decode step, whose attention sums in another order): a prompt's logits then do not
        depend on how much of it came from the prefix cache, which int8 would turn into other tokens.
        every_row: the logits at every position instead, [T, vocab] (a prompt's own logprobs)."""
        if ids.shape[0] == 1 and stage_ms is None and not prompt:
            return self.decode([int(ids[0])], [pos], [cache])[0]
        logits = self._forward_rows(ids, [(cache, pos, ids.shape[0])], need_logits, self._stage_clock(stage_ms),
                                    every_row)
        return logits if logits is None or every_row else logits[0]

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int], caches: list[SequenceKV],
               capture: int | None = None, stages: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None, dict]:
        """One token for each of B sequences: tokens[b] at positions[b]. Returns logits [B, vocab]; with
        capture (an index into the batch) or stages, (logits, weights, the step's time per stage), weights
        being that sequence's attention weights [layers, heads, positions + 1] (the native step with
        capture only; else None)."""
        last = max(p + cache.num_dropped for p, cache in zip(positions, caches))  # the rotary tables' reach
        if self.fused is not None and last < self.fused.num_positions:
            return self.fused(tokens, positions, caches, capture, stages)  # one native call for the whole batch
        if self.graphs is not None and capture is None and not stages:
            logits = self.graphs(tokens, positions, caches)  # one graph replay, where a bucket fits
            if logits is not None:
                return logits
        ids = torch.tensor(tokens, device=self.device)
        if capture is not None or stages:  # the PyTorch ops time their stages but hand out no attention weights
            stage_ms = {}
            segments = [(cache, pos, 1) for cache, pos in zip(caches, positions)]
            return self._forward_rows(ids, segments, True, self._stage_clock(stage_ms)), None, stage_ms
        if self.precision == "int8" and self.lm_head.runs_on == "FBGEMM":
            # FBGEMM's int8 linear quantizes its input per tensor: in a batch, one sequence's activations
            # would set another's scale. Each sequence goes alone, so its tokens keep independent of its
            # neighbours (the native kernels quantize each row's blocks on their own).
            return torch.cat([self._forward_rows(ids[i:i + 1], [(cache, pos, 1)], True)
                              for i, (cache, pos) in enumerate(zip(caches, positions))])
        return self._forward_rows(ids, [(cache, pos, 1) for cache, pos in zip(caches, positions)], True)

    def _forward_rows(self, ids: torch.Tensor, segments: list[tuple[SequenceKV, int, int]],
                      need_logits: bool, clock: StageClock | None = None,
                      every_row: bool = False) -> torch.Tensor | None:
        """ids: [N] tokens of consecutive segments (cache, pos, T), one per sequence. Linears run on all
        N rows at once; attention runs per segment, over its own cache. Returns each segment's last
        logits, [segments, vocab], or with every_row the logits of all N rows, [N, vocab]. clock: where
        the time of each stage goes (explain mode)."""
        clock = clock or StageClock(None, self.device)
        x = F.embedding(ids, self.embed)  # [N, C]
        shape = x.shape[-1:]
        clock.lap("embedding")
        for index, layer in enumerate(self.layers):
            x = x + self._join(self._attention_block(index, layer, x, segments, clock))
            clock.lap("attention")
            x = x + self._join(self._mlp_block(layer, x, clock))
            clock.lap("ffn")
        if not need_logits:
            return None
        if not every_row:
            ends = torch.tensor([0] + [t for _, _, t in segments], device=self.device).cumsum(0)[1:] - 1
            x = x[ends]
        h = F.rms_norm(x, shape, self.final_norm, self.eps)
        clock.lap("final_norm")
        logits = self._logits(h)  # [segments, vocab], or [N, vocab]
        clock.lap("lm_head")
        return logits

    def _attention_block(self, index: int, layer: _Layer, x: torch.Tensor,
                         segments: list[tuple[SequenceKV, int, int]], clock: StageClock) -> torch.Tensor:
        """Layer index's attention over rows x [N, C] of consecutive segments, before the residual: the
        norm, QKV, attention per segment over its own cache, and the output projection."""
        h = F.rms_norm(x, x.shape[-1:], layer.attn_norm, self.eps)
        clock.lap("norm")
        qkv = layer.qkv(h)  # [N, (H + 2KV) * D]: q, k, v side by side
        rows, start = [], 0
        for cache, pos, num_tokens in segments:
            rows.append(self._attention(index, qkv[start:start + num_tokens], pos, cache))
            start += num_tokens
        return layer.o(torch.cat(rows) if len(rows) > 1 else rows[0])

    def _mlp_block(self, layer: _Layer, x: torch.Tensor, clock: StageClock) -> torch.Tensor:
        """The layer's MLP over rows x [N, C], before the residual: the norm, gate/up, SiLU(gate) * up, down."""
        h = F.rms_norm(x, x.shape[-1:], layer.mlp_norm, self.eps)
        clock.lap("norm")
        if h.shape[0] <= MLP_ROWS or self.device.type != "cpu":
            return self._mlp(layer, h)
        return torch.cat([self._mlp(layer, h[start:start + MLP_ROWS]) for start in range(0, h.shape[0], MLP_ROWS)])

    @staticmethod
    def _mlp(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(h).chunk(2, dim=-1)  # [N, I] each
        return layer.down(F.silu(gate) * up)

    def _join(self, partial: torch.Tensor) -> torch.Tensor:
        """The output of a layer's attention or MLP. Here it is whole; a tensor-parallel slice holds a
        part of the sum, which its all-reduce completes (tensor_parallel.py)."""
        return partial

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def _sdpa_kernels(self):
        """The SDPA kernels the eager ops may use: on CUDA all but cuDNN's (EAGER_CUDA_ATTENTION), else any."""
        return sdpa_kernel(EAGER_CUDA_ATTENTION) if self.device.type == "cuda" else nullcontext()

    def _causal_mask(self, pos: int, num_tokens: int) -> torch.Tensor | None:
        if num_tokens == 1:
            return None  # one query attends to every cached key
        # query i sits at position pos+i and may see keys 0..pos+i: [T, pos+T] boolean
        keys = torch.arange(pos + num_tokens, device=self.device)
        queries = torch.arange(pos, pos + num_tokens, device=self.device)
        return keys[None, :] <= queries[:, None]

    def _rotate(self, qk: torch.Tensor, at: slice | torch.Tensor) -> torch.Tensor:
        """q and k heads qk [T, H + KV, D] rotated at the positions `at` picks from the rotary tables (a
        slice, or one position per row): where the rows are paired (fp32), in place as complex products;
        else cos, sin and the half-roll, into a new tensor. Returns the rotated heads."""
        if self.pair_rope:
            torch.view_as_complex(qk.unflatten(-1, (-1, 2))).mul_(self.rotations[at])
            return qk
        return qk * self.cos[at] + qk.roll(self.head_dim // 2, dims=-1) * self.sin[at]

    def _attention(self, index: int, qkv: torch.Tensor, pos: int, cache: SequenceKV) -> torch.Tensor:
        """qkv: [T, (H + 2KV) * D] of one sequence at positions [pos, pos+T) of its cache -> attention
        output [T, H*D]. Rotated at their positions in the text: pos + what a sliding window dropped."""
        num_tokens = qkv.shape[0]
        rope = pos + cache.num_dropped
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk = self._rotate(qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim),
                          slice(rope, rope + num_tokens))  # rotary embedding of q and k at once
        if self.pair_rope:  # (in place: qkv holds the rotated q and k)
            kv = qkv[:, heads * head_dim:].view(num_tokens, 2, kv_heads, head_dim).permute(1, 2, 0, 3)
            native = self.fused is not None and self.fused.has_prefill_attention and self.attention == "auto"
            if native:  # writes k, v into the pool and reads them there, in place
                return self.fused.prefill_attention(qkv, index, pos, cache)
            cache.write_kv(index, pos, kv)
            keys, values = cache.layer_kv(index, pos + num_tokens)  # [KV, pos+T, D] each
            q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
        else:
            q, k = qk.split([heads, kv_heads], dim=1)  # [T, H, D], [T, KV, D]
            v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
            keys, values = cache.update(index, pos, k.transpose(0, 1), v.transpose(0, 1))
        keys, values = keys.to(qkv.dtype), values.to(qkv.dtype)  # a no-op unless the cache is fp16
        if self.kv_head_of is not None:  # uneven groups: each query head gets its own copy of its KV head
            keys, values = keys[self.kv_head_of], values[self.kv_head_of]
        if self.attention == "eager":
            out = eager_attention(q.transpose(0, 1), keys, values, self._causal_mask(pos, num_tokens))
        else:
            # from position 0 the mask is the plain causal one, which the fused kernels apply themselves and
            # skip the blocks above its diagonal (half the work; on CUDA it also lets FlashAttention run)
            from_start = pos == 0 and num_tokens > 1
            with self._sdpa_kernels():
                mask = None if from_start else self._causal_mask(pos, num_tokens)
                out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                                     attn_mask=mask, is_causal=from_start,
                                                     enable_gqa=heads != keys.shape[0])[0]  # [H, T, D]
        return out.transpose(0, 1).reshape(num_tokens, heads * head_dim)
