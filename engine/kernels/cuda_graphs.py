"""The decode step in static shapes, replayed as CUDA graphs on a GPU.

On a GPU a decode step of a small model is bound by launching kernels, not by memory: ~30 layers x
~15 ops, each launched from Python, take ~9 ms where the weights take ~0.06 ms to read. A CUDA graph
records the step's kernels once and replays them with one launch. A graph replays fixed shapes and
fixed addresses, so the step here is written for that (as vLLM's and gpt-fast's are):

- inputs live in one static buffer (`StaticInputs`), refilled by one host-to-device copy before each
  replay: token ids, positions, rotary positions, the pool slot each new key and value go to, and each
  row's block table; the step derives from them, on the device, the pool slots of each row's first L
  positions and the mask of those it may see;
- batches are padded up to a bucket of sizes (1, 2, 4, 8, ...) and contexts to a bucket of lengths (256,
  512, 1,024, ... tokens), one graph per (batch, context) bucket, captured on first use; a padding row
  writes its key and value into a slot of its own of a scratch block that no sequence owns, and reads
  only that;
- attention gathers each row's L keys and values from the pool and masks the positions past its own,
  which read its own new slot (finite values: a masked NaN would still poison the sum).

Measured on an H200 (scripts/gpu_check.py, README): 472 tok/s at batch 1 where the eager ops made 14;
with compile=True (`--compile-decode`) torch.compile fuses the step's small kernels first: 718.

`StaticDecode.run` is plain PyTorch and runs on any device: on the CPU the tests check it against the
eager decode; on CUDA `GraphDecode` captures it. Where a graph cannot serve a step (a batch or a context
beyond the largest bucket, an int8 cache, uneven KV groups), the eager PyTorch ops run it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kv_pool import KVPool, SequenceKV, blocks_for

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
FIRST_CONTEXT_BUCKET = 256  # tokens; then doubled up to the context window


@torch.library.custom_op("phasescope::write_kv", mutates_args=("kv",))
def write_kv(kv: torch.Tensor, layer: int, slot: torch.Tensor, new: torch.Tensor) -> None:
    """Layer's new keys and values, new [B, 2 * KV, D] (keys, then values), into the pool kv [layers, 2,
    KV, slots, D] at slots [B], in one copy (one kernel, where keys and values apart took two).
    One op that says what it writes, so that torch.compile writes the pool in place: traced as plain
    index_copy_ on a view of it, the compiled step copied the whole pool on every step."""
    kv[layer].flatten(0, 1).index_copy_(1, slot, new.transpose(0, 1).to(kv.dtype))


def bucket(size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds size, or None when size exceeds the largest."""
    return next((b for b in buckets if b >= size), None)


def context_buckets(context_window: int, block_size: int) -> tuple[int, ...]:
    """Context lengths in tokens: 256, 512, ... doubling, the last one the window (each a whole number of
    blocks, so that a row's slots are its blocks spelled out)."""
    sizes, size = [], FIRST_CONTEXT_BUCKET
    while size < context_window:
        sizes.append(size)
        size *= 2
    return tuple(sorted({blocks_for(tokens, block_size) * block_size for tokens in sizes + [context_window]}))


def why_not(model, pool: KVPool, capture: bool = True) -> str | None:
    """Why decode steps over this pool cannot run as graphs (capture: recorded ones), or None when they can."""
    if capture and model.device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if not pool.kv.is_floating_point():
        return "an int8 KV cache is dequantized by ops a graph does not hold"
    if model.kv_head_of is not None:
        return "uneven KV head groups (a tensor-parallel slice)"
    return None


class StaticInputs:
    """One bucket's inputs, [batch] or [batch, blocks], as views of one device buffer whose address never
    changes, so that a step's inputs go over in one host-to-device copy: token ids, positions in the
    cache, rotary positions (position in the text), the pool slot each new key and value go to, and each
    row's block table (its first `context` positions' blocks)."""

    def __init__(self, batch: int, context: int, block_size: int, device: torch.device) -> None:
        self.batch, self.context, self.block_size = batch, context, block_size
        self.num_blocks = context // block_size
        self.packed = torch.zeros(batch * (4 + self.num_blocks), dtype=torch.long, device=device)
        self.ids, self.positions, self.rope, self.slot = self.packed[:4 * batch].view(4, batch)
        self.block_table = self.packed[4 * batch:].view(batch, self.num_blocks)
        offsets = torch.arange(context, device=device)  # a row's positions 0 .. context - 1
        self._offsets, self._block_of, self._within = offsets, offsets // block_size, offsets % block_size

    def fill(self, tokens: list[int], positions: list[int], sequences: list[SequenceKV], scratch_slot: int) -> None:
        """Copy a batch's step into the buffer (one host-to-device copy); rows past the batch pad it: token
        0 at position 0, each in a slot of its own of the scratch block (a bucket pads fewer rows than a
        block holds), which it writes and reads alone."""
        size, num_blocks, pad = self.block_size, self.num_blocks, self.batch - len(tokens)
        scratch_block = scratch_slot // size
        slots, tables = [], []
        for pos, seq in zip(positions, sequences):
            slots.append(seq.block_ids[pos // size] * size + pos % size)
            table = seq.block_ids[:num_blocks]
            tables += table + [scratch_block] * (num_blocks - len(table))
        values = (tokens + [0] * pad + positions + [0] * pad + [p + s.num_dropped for p, s in zip(positions, sequences)]
                  + [0] * pad + slots + [scratch_slot + row for row in range(pad)] + tables
                  + [scratch_block] * (pad * num_blocks))
        self.packed.copy_(torch.tensor(values), non_blocking=True)

    def key_slots(self) -> torch.Tensor:
        """[batch, context] the pool slot of each position a row reads: those before its own from its block
        table; its own, and those it may not see, its new slot (written this step, so finite: a masked
        position weighs 0, but 0 times a NaN that unwritten memory may hold would still be NaN)."""
        table = self.block_table[:, self._block_of] * self.block_size + self._within
        return torch.where(self._offsets < self.positions[:, None], table, self.slot[:, None])

    def visible(self) -> torch.Tensor:
        """[batch, 1, 1, context] bool: positions 0 .. the row's own."""
        return (self._offsets <= self.positions[:, None])[:, None, None, :]


class StaticDecode:
    """A LeanLlama's decode step over one pool, in the shapes of one (batch, context) bucket: `run` reads
    `inputs` and writes `logits`, allocating nothing it keeps, so that a CUDA graph can record it."""

    def __init__(self, model, pool: KVPool, batch: int, context: int) -> None:
        from ..models.llama import StageClock  # (llama.py imports this module)

        self.model, self.kv = model, pool.kv  # the tensor, not the pool: GraphDecode.pools holds pools weakly
        self.untimed = StageClock(None, model.device)
        self.inputs = StaticInputs(batch, context, pool.block_size, pool.kv.device)
        self.logits = torch.zeros(batch, model.lm_head.output_features, dtype=model.dtype, device=pool.kv.device)

        self.forward = self._forward  # torch.compile may replace it (GraphDecode's compile)

    def run(self) -> None:
        with torch.inference_mode():
            self.forward()

    def _forward(self) -> None:
        m, inputs = self.model, self.inputs
        key_slots, visible = inputs.key_slots(), inputs.visible()  # once per step, for every layer
        x = F.embedding(inputs.ids, m.embed)  # [B, C]
        for index, layer in enumerate(m.layers):
            h = F.rms_norm(x, x.shape[-1:], layer.attn_norm, m.eps)
            x = x + layer.o(self._attention(index, layer.qkv(h), key_slots, visible))
            x = x + m._mlp_block(layer, x, self.untimed)  # the eager forward's own MLP: nothing in it varies
        self.logits.copy_(m.lm_head(F.rms_norm(x, x.shape[-1:], m.final_norm, m.eps)))

    def _attention(self, index: int, qkv: torch.Tensor, key_slots: torch.Tensor, visible: torch.Tensor
                   ) -> torch.Tensor:
        """qkv [B, (H + 2KV) * D] -> attention output [B, H * D]; the new keys and values go into the pool."""
        m = self.model
        batch, heads, kv_heads, head_dim = qkv.shape[0], m.num_heads, m.num_kv_heads, m.head_dim
        q, keys, values = self._queries_and_pool(index, qkv, key_slots)
        # the query heads that share a KV head (h = kv * G + g) as G query rows of it: every SDPA
        # backend takes that shape with a mask, and each KV head's keys are read once for its G heads
        out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, heads // kv_heads, head_dim), keys, values,
                                             attn_mask=visible)  # [B, KV, G, D]
        return out.reshape(batch, heads * head_dim)

    def _queries_and_pool(self, index: int, qkv: torch.Tensor, key_slots: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's rotated queries [B, H, D], its new keys and values written into the pool, and the
        keys and values each row reads from it [B, KV, L, D] (key_slots [B, L])."""
        m, inputs = self.model, self.inputs
        batch, heads, kv_heads, head_dim = qkv.shape[0], m.num_heads, m.num_kv_heads, m.head_dim
        qk = m._rotate(qkv[:, :(heads + kv_heads) * head_dim].view(batch, heads + kv_heads, head_dim), inputs.rope)
        q, k = qk.split([heads, kv_heads], dim=1)  # [B, H, D], [B, KV, D]
        v = qkv[:, (heads + kv_heads) * head_dim:].view(batch, kv_heads, head_dim)
        # keys and values in one tensor for one write (compiled, Inductor may fill it in the rotary kernel)
        write_kv(self.kv, index, inputs.slot, torch.cat([k, v], dim=1))
        cache = self.kv[index]  # [2, KV, slots, D]
        keys = cache[0][:, key_slots].transpose(0, 1).to(qkv.dtype)  # [B, KV, L, D]
        values = cache[1][:, key_slots].transpose(0, 1).to(qkv.dtype)
        return q, keys, values


@dataclass
class _PoolGraphs:
    """The graphs of one pool (they hold its address): its scratch slot and context buckets, and the
    static steps and graphs made so far, by (batch, context) bucket."""
    scratch_slot: int
    context_buckets: tuple[int, ...]
    steps: dict[tuple[int, int], StaticDecode] = field(default_factory=dict)
    graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = field(default_factory=dict)


class GraphDecode:
    """Decode steps of one LeanLlama as replayed CUDA graphs, one per (batch, context) bucket and pool
    (an engine's variants share the model with pools of their own), captured on first use;
    capture=False runs the same static step without graphs (the CPU, and the tests). compile=True has
    torch.compile fuse each step's small kernels (norms, rotary, SiLU, residuals) before it is captured:
    fewer kernels per replay, for a compilation of tens of seconds per bucket."""

    def __init__(self, model, capture: bool = True, compile: bool = False) -> None:
        self.model, self.capture, self.compile = model, capture, compile
        self.compile_options: dict = {}  # torch.compile's, beside dynamic=False (scripts/gpu_variants.py tries some)
        self.pools: weakref.WeakKeyDictionary[KVPool, _PoolGraphs] = weakref.WeakKeyDictionary()
        self._memory = None  # the graphs share one memory pool (vLLM's graph_pool_handle)

    def _for_pool(self, pool: KVPool) -> _PoolGraphs | None:
        """The pool's graphs; None when its steps cannot run as graphs (why_not), or when it has no block
        to set aside for padding rows."""
        found = self.pools.get(pool)
        if found is None and why_not(self.model, pool, self.capture) is None:
            scratch = pool.take_scratch_block()
            if scratch is not None:
                found = self.pools[pool] = _PoolGraphs(scratch * pool.block_size,
                                                       context_buckets(self.model.context_window, pool.block_size))
        return found

    def shape_for(self, positions: list[int], sequences: list[SequenceKV], buckets: tuple[int, ...]
                  ) -> tuple[int, int] | None:
        """The (batch, context) bucket of a step, or None when none holds it."""
        batch, context = bucket(len(positions), BATCH_BUCKETS), bucket(max(positions) + 1, buckets)
        if batch is None or context is None or any(p + s.num_dropped >= len(self.model.cos)
                                                  for p, s in zip(positions, sequences)):
            return None
        return batch, context

    def __call__(self, tokens: list[int], positions: list[int], sequences: list[SequenceKV]) -> torch.Tensor | None:
        """Logits [B, vocab] of the step, or None when it needs the eager ops."""
        pool = sequences[0].pool
        state = self._for_pool(pool)
        if state is None:
            return None
        shape = self.shape_for(positions, sequences, state.context_buckets)
        if shape is None:
            return None
        for seq, pos in zip(sequences, positions):
            seq.reserve(pos, 1)
        step = state.steps.get(shape) or self._build(state, pool, shape)
        step.inputs.fill(tokens, positions, sequences, state.scratch_slot)
        if shape in state.graphs:
            state.graphs[shape].replay()
        else:
            step.run()
        for seq, pos in zip(sequences, positions):
            seq.mark_written(pos + 1)
        return step.logits[:len(tokens)].clone()

    def _build(self, state: _PoolGraphs, pool: KVPool, shape: tuple[int, int]) -> StaticDecode:
        step = state.steps[shape] = StaticDecode(self.model, pool, *shape)
        if self.compile:  # compiled by the first run below (one graph of the whole step, its shapes fixed)
            # each bucket is a recompilation of the same code: past dynamo's limit (8) it would run uncompiled
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            step.forward = torch.compile(step._forward, dynamic=False, **self.compile_options)
        if self.capture:
            step.inputs.fill([], [], [], state.scratch_slot)  # every row a padding row
            side = torch.cuda.Stream()  # warm-up off the default stream, as torch.cuda.graph asks
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # lazy initialisations (cuBLAS workspaces) happen here, not in the capture
                    step.run()
            torch.cuda.current_stream().wait_stream(side)
            self._memory = self._memory or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory):
                step.run()
            state.graphs[shape] = graph
        return step

