"""Tensor parallelism, Megatron-style, over torch.distributed (NCCL on CUDA; on CPU gloo, with the
all-reduces and gathers through shared memory where it can be used: shared_memory.py).

N processes ("ranks") each hold a slice of every layer. Attention is split by whole KV-head groups: a
rank holds its KV heads' key and value rows, the rows of the query heads that share them, and the
matching columns of the output projection. The MLP is split by columns: a rank holds some rows of gate
and up and the same columns of down. Each rank's attention and MLP output is then a part of the layer's
output, and one all-reduce after attention and one after the MLP, in every layer, add the parts up.
lm_head is split by vocabulary and the logits gathered. The KV cache is split by KV head: each rank keeps
its own heads' keys and values, at the same block ids as rank 0's pool.

Rank 0 is the engine's own process: it schedules as on one rank, and before every forward broadcasts
what to run (the token ids, each sequence's block table and position). Ranks 1..N-1 are worker
processes it spawns; each runs its slice of that forward and waits for the next.
"""
from __future__ import annotations

import atexit
import copy
import itertools
import multiprocessing
import os
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import DEFAULT_BLOCK_TOKENS
from .kv_pool import KVPool, SequenceKV, blocks_for, kv_bytes_formula, row_elements
from .models.llama import LeanLlama, StageClock
from .shared_memory import SharedMemoryLink

MIN_HALF_TOKENS = 64  # a prefill of at least twice this runs as two halves, taken in turns (_forward_halves)
START_TIMEOUT = timedelta(seconds=90)  # for every rank to start and join
IDLE_TIMEOUT = timedelta(days=30)  # a worker waits this long for the next forward (the app may sit idle)


def even_ranges(total: int, world: int) -> list[range]:
    """total split into world consecutive ranges, as even as whole units allow, the last ones longer: rank 0
    is also the engine (it broadcasts every forward, and schedules and samples between them), so it takes
    a shorter share where the shares cannot be equal."""
    sizes = [total // world + (rank >= world - total % world) for rank in range(world)]
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [range(bounds[r], bounds[r + 1]) for r in range(world)]


def split_plan(config, world: int) -> list[tuple[range, range, range]]:
    """Each rank's (query heads, KV heads, MLP columns). Query heads and columns are shared out as evenly
    as whole ones allow, since every all-reduce waits for the slowest rank. A rank holds the KV heads its
    query heads read; a KV head whose query heads fall on two ranks is held by both (as vLLM does when
    ranks outnumber KV heads): SmolLM2's 9 query heads on 2 ranks are 4 and 5, and of its 3 KV heads
    each rank holds 2. (5 on rank 0 and 4 on rank 1 made TP=2's pp512 2-4 % slower, as slow as with
    a head left out altogether: rank 0's own work made it the slower rank already.)"""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if not 1 <= world <= heads:
        raise ValueError(f"tensor parallelism splits the attention heads across ranks: this model has {heads}, "
                         f"so 1 to {heads} ranks, not {world}")
    group = heads // kv_heads
    return [(q, range(q.start // group, (q.stop - 1) // group + 1), columns)
            for q, columns in zip(even_ranges(heads, world), even_ranges(config.intermediate_size, world))]


def vocab_slice(vocab_size: int, rank: int, world: int) -> range:
    """Rank's rows of lm_head: equal parts (the last one shorter), so that the gather is of equal sizes."""
    part = -(-vocab_size // world)
    return range(min(vocab_size, rank * part), min(vocab_size, (rank + 1) * part))


class Rotary:
    """The model's rotary tables computed once, answering as the model's rotary module does (a slice
    travels to a worker without the module, which may belong to the whole model)."""

    def __init__(self, model, num_positions: int) -> None:
        probe = torch.zeros(1, dtype=model.dtype, device=model.device)
        with torch.no_grad():
            self.cos, self.sin = model.model.rotary_emb(probe, torch.arange(num_positions, device=model.device)[None])

    def __call__(self, probe: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:, positions[0]], self.sin[:, positions[0]]


def shard_model(model, rank: int, world: int, max_positions: int = 32768) -> SimpleNamespace:
    """Rank's slice of a Llama-family model, with the attribute names LeanLlama reads (a transformers
    model's), copied out of the whole so that it can travel to a worker process alone."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q_range, kv_range, columns = split_plan(config, world)[rank]
    group = heads // kv_heads
    q_rows = slice(q_range.start * head_dim, q_range.stop * head_dim)
    kv_rows = slice(kv_range.start * head_dim, kv_range.stop * head_dim)
    mlp_rows = slice(columns.start, columns.stop)

    def rows(linear, part: slice) -> SimpleNamespace:  # column-parallel: its share of the outputs
        bias = None if linear.bias is None else linear.bias.detach()[part].clone()
        return SimpleNamespace(weight=linear.weight.detach()[part].clone(), bias=bias)

    def columns_of(linear, part: slice) -> SimpleNamespace:  # row-parallel: its share of the inputs
        bias = linear.bias.detach().clone() if linear.bias is not None and rank == 0 else None  # added once
        return SimpleNamespace(weight=linear.weight.detach()[:, part].clone(), bias=bias)

    def norm(module) -> SimpleNamespace:
        return SimpleNamespace(weight=module.weight.detach().clone())

    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(SimpleNamespace(
            self_attn=SimpleNamespace(q_proj=rows(attn.q_proj, q_rows), k_proj=rows(attn.k_proj, kv_rows),
                                      v_proj=rows(attn.v_proj, kv_rows), o_proj=columns_of(attn.o_proj, q_rows)),
            mlp=SimpleNamespace(gate_proj=rows(mlp.gate_proj, mlp_rows), up_proj=rows(mlp.up_proj, mlp_rows),
                                down_proj=columns_of(mlp.down_proj, mlp_rows)),
            input_layernorm=norm(layer.input_layernorm), post_attention_layernorm=norm(layer.post_attention_layernorm)))
    vocab = vocab_slice(config.vocab_size, rank, world)
    sliced = SimpleNamespace(**{name: getattr(config, name) for name in (
        "model_type", "num_hidden_layers", "hidden_size", "rms_norm_eps", "max_position_embeddings", "vocab_size")})
    sliced.num_attention_heads, sliced.num_key_value_heads = len(q_range), len(kv_range)
    sliced.head_dim, sliced.intermediate_size = head_dim, len(columns)
    sliced.kv_head_of = [h // group - kv_range.start for h in q_range]  # may be uneven: [0, 0, 0, 1, 1]
    rotary = Rotary(model, min(config.max_position_embeddings, max_positions))
    return SimpleNamespace(
        config=sliced, device=model.device, dtype=model.dtype, cache_key=None,
        model=SimpleNamespace(layers=layers, embed_tokens=norm(model.model.embed_tokens), norm=norm(model.model.norm),
                              rotary_emb=rotary),
        lm_head=SimpleNamespace(weight=model.lm_head.weight.detach()[vocab.start:vocab.stop].clone()))


class Group:
    """One rank's end of the group: the collectives, and the time spent in them. On CPU the all-reduces
    and gathers go through shared memory (link) where it can be used, and through gloo otherwise."""

    def __init__(self, rank: int, world: int, process_group: dist.ProcessGroup | None = None,
                 link: SharedMemoryLink | None = None) -> None:
        self.rank, self.world, self.process_group, self.link = rank, world, process_group, link
        self.comm_ns = 0  # in all-reduces and gathers since the start

    @property
    def backend(self) -> str:
        if self.world == 1:
            return "one rank"
        return "shared memory" if self.link is not None else dist.get_backend(self.process_group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            begin = time.perf_counter_ns()
            if self.link is not None:
                self.link.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.process_group)
            self.comm_ns += time.perf_counter_ns() - begin
        return x

    def start_all_reduce(self, x: torch.Tensor) -> object:
        """all_reduce of x in the background (gloo's own thread): finish(x, handle) waits for it. Through
        shared memory it is done here and now."""
        if self.link is not None:
            self.all_reduce(x)
            return None
        return dist.all_reduce(x, group=self.process_group, async_op=True) if self.world > 1 else None

    def finish(self, x: torch.Tensor, handle: object) -> torch.Tensor:
        """x once its all-reduce is done; only the time waiting here counts as time in collectives."""
        if handle is not None:
            begin = time.perf_counter_ns()
            handle.wait()
            self.comm_ns += time.perf_counter_ns() - begin
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's x [rows, part] side by side, cut to width columns (the last part is shorter)."""
        if self.world == 1:
            return x
        part = -(-width // self.world)
        padded = torch.nn.functional.pad(x, (0, part - x.shape[-1])).contiguous()
        begin = time.perf_counter_ns()
        if self.link is not None:
            parts = self.link.all_gather(padded)
        else:
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded, group=self.process_group)
        self.comm_ns += time.perf_counter_ns() - begin
        return torch.cat(parts, dim=-1)[:, :width]

    def broadcast(self, command: object = None) -> object:
        """Rank 0's command to every rank (rank 0 passes it, the others receive it)."""
        box = [command]
        dist.broadcast_object_list(box, src=0, group=self.process_group)
        return box[0]


class ShardedLlama(LeanLlama):
    """One rank's slice of the lean forward. On rank 0 it is the engine's runner: it tells the workers
    what each forward runs, and its pools stand for the whole cache."""

    native = False  # the native decode step runs a whole model; a slice runs PyTorch ops between all-reduces
    explains = False  # the workers' stages would go untimed

    def __init__(self, model, precision: str, group: Group, total_kv_heads: int = 0,
                 cache_dir: str | None = None) -> None:
        """total_kv_heads: the KV heads all ranks hold together (rank 0's pools report the whole cache)."""
        super().__init__(model, precision, cache_dir=cache_dir)
        self.group, self.total_kv_heads = group, total_kv_heads
        self.vocab_size = model.config.vocab_size
        self.workers: list[multiprocessing.Process] = []
        self._pool_keys = itertools.count()
        self._dropped: list[int] = []  # pools rank 0 no longer holds: the workers drop theirs too

    @property
    def decode_path(self) -> str:
        return f"PyTorch ops, tensor parallel x{self.group.world} ({self.group.backend})"

    @property
    def comm_ms(self) -> float:
        """Time spent in the collectives since the start (ms): a forward's share is the difference."""
        return self.group.comm_ns / 1e6

    def _join(self, partial: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(partial)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.group.gather_columns(self.lm_head(h), self.vocab_size)

    def _forward_rows(self, ids, segments, need_logits, clock=None, every_row=False):
        if self.group.rank == 0 and self.group.world > 1:
            shared = [(cache.pool.tp_key, cache.block_ids, cache.num_dropped, pos, num_tokens)
                      for cache, pos, num_tokens in segments]
            with _uninterrupted():
                self.group.broadcast(("forward", self._take_dropped(), ids.cpu(), shared, need_logits, every_row,
                                      self.attention))
                return self._run_rows(ids, segments, need_logits, clock, every_row)
        return self._run_rows(ids, segments, need_logits, clock, every_row)

    def _run_rows(self, ids, segments, need_logits, clock, every_row):
        # every rank makes the same choice from what rank 0 broadcast, so the collectives come in one order
        # (no stages are timed here: explains is False)
        if (self.group.world > 1 and len(segments) == 1 and segments[0][2] >= 2 * MIN_HALF_TOKENS
                and not every_row):  # (the halves give their last row's logits only)
            return self._forward_halves(ids, segments[0], need_logits)
        return super()._forward_rows(ids, segments, need_logits, clock, every_row)

    def _forward_halves(self, ids: torch.Tensor, segment: tuple[SequenceKV, int, int],
                        need_logits: bool) -> torch.Tensor | None:
        """A prefill as two halves of its tokens, taken in turns through each layer, so that one half's
        all-reduce travels while the other half computes (on one machine the ranks' all-reduces over gloo's
        loopback took 15-21 % of a prefill, waited for in full). Through shared memory an all-reduce is
        done at once, and halves still measured faster: pp512 in 1,200 ms against 1,361 in one pass
        (median of 4 rounds, AMD EPYC, 2 cores). The second half attends to the first's keys, written
        just before: the same causal attention as one pass, as chunked prefill does."""
        cache, pos, num_tokens = segment
        cut = num_tokens // 2
        halves = [[(cache, pos, cut)], [(cache, pos + cut, num_tokens - cut)]]  # each half's one segment
        xs = [F.embedding(ids[:cut], self.embed), F.embedding(ids[cut:], self.embed)]
        untimed = StageClock(None, self.device)
        sent: list[tuple[torch.Tensor, object] | None] = [None, None]  # each half's partial sum in flight

        def settle(i: int) -> torch.Tensor:  # half i's input, with its last all-reduced part added
            if sent[i] is not None:
                partial, handle = sent[i]
                xs[i] = xs[i] + self.group.finish(partial, handle)
                sent[i] = None
            return xs[i]

        for index, layer in enumerate(self.layers):
            for i in range(2):  # attention
                partial = self._attention_block(index, layer, settle(i), halves[i], untimed)
                sent[i] = (partial, self.group.start_all_reduce(partial))
            for i in range(2):  # MLP
                partial = self._mlp_block(layer, settle(i), untimed)
                sent[i] = (partial, self.group.start_all_reduce(partial))
        last = settle(1)[-1:]
        settle(0)
        if not need_logits:
            return None
        return self._logits(F.rms_norm(last, last.shape[-1:], self.final_norm, self.eps))

    # --- the KV cache, split by KV head ----------------------------------------------------------

    def new_pool(self, budget_bytes: int, block_size: int = DEFAULT_BLOCK_TOKENS, prefix_caching: bool = True,
                 kv_dtype: torch.dtype | None = None) -> KVPool:
        """The budget is the whole cache's, across ranks: each rank holds the same blocks of its heads."""
        kv_dtype = kv_dtype or self.dtype
        element = torch.tensor([], dtype=kv_dtype).element_size()
        row = row_elements(kv_dtype, self.head_dim)
        per_block = kv_bytes_formula(self.num_layers, self.total_kv_heads, row, element, block_size)
        return self._pool(max(1, budget_bytes // per_block), block_size, kv_dtype, prefix_caching)

    def new_cache(self, capacity_tokens: int) -> SequenceKV:
        pool = self._pool(blocks_for(capacity_tokens, DEFAULT_BLOCK_TOKENS), DEFAULT_BLOCK_TOKENS, self.dtype, False)
        return pool.allocate([], capacity_tokens)

    def _pool(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, prefix_caching: bool) -> KVPool:
        pool = KVPool(self.num_layers, self.num_kv_heads, self.head_dim, num_blocks, block_size, kv_dtype,
                      self.device, prefix_caching)
        # what the engine shows is the whole cache's size, every rank's heads
        element = pool.kv.element_size()
        pool.bytes_per_token = kv_bytes_formula(self.num_layers, self.total_kv_heads,
                                                row_elements(kv_dtype, self.head_dim), element, 1)
        pool.tp_key = next(self._pool_keys)
        pool.reuse_partial_blocks = False  # a row copy in rank 0's pool would not reach the workers' pools
        if self.group.world > 1:
            self.group.broadcast(("pool", self._take_dropped(), pool.tp_key, num_blocks, block_size, kv_dtype))
            weakref.finalize(pool, self._dropped.append, pool.tp_key)  # only noted: told with the next command
        return pool

    def _take_dropped(self) -> list[int]:
        dropped, self._dropped[:] = list(self._dropped), []
        return dropped

    # --- the workers' lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self.workers and dist.is_initialized():
            try:
                self.group.broadcast(None)
            finally:
                for worker in self.workers:
                    worker.join(timeout=10)
                    if worker.is_alive():
                        worker.kill()
                        worker.join()
                dist.destroy_process_group()
        self.workers = []


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ctrl-C lands after the forward instead of inside it: a rank that left a forward half-way would
    leave the others waiting in an all-reduce it never joins."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda *_: received.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, address: str, device: torch.device) -> dist.ProcessGroup:
    """Join the group; returns the process group the forwards use, whose collectives may wait as long
    as the app sits idle (joining itself gives up after START_TIMEOUT)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world, timeout=START_TIMEOUT)
    return dist.new_group(list(range(world)), timeout=IDLE_TIMEOUT, backend=backend)


def _join_group(rank: int, world: int, address: str, device: torch.device, link_path: str | None,
                peers_alive: Callable[[], bool]) -> Group:
    """This rank's end of the group, with the shared-memory link where rank 0 made one (every rank maps
    the file before rank 0 removes its name)."""
    process_group = _init(rank, world, address, device)
    link = None
    if link_path:  # the same on every rank: rank 0 handed its path to all
        link = SharedMemoryLink(link_path, rank, world, peers_alive)
        dist.barrier(group=process_group)
    return Group(rank, world, process_group, link)


def start(model, precision: str, world: int, threads: int | None = None, cache_dir: str | None = None) -> ShardedLlama:
    """Rank 0's runner for a model split over `world` ranks: spawns ranks 1..world-1 (each with a slice
    copied out here) and joins them in a process group. threads: torch threads per rank (default: the
    cores shared out); rank 0's is set on this process. On CUDA rank r uses cuda:r and NCCL."""
    if dist.is_initialized():
        raise ValueError("this process already runs a tensor-parallel engine: close it first (one per process)")
    total_kv_heads = sum(len(kv) for _, kv, _ in split_plan(model.config, world))  # shared ones count twice
    if world == 1:  # the same code on one rank: the baseline the speed-up is measured against
        if threads:
            torch.set_num_threads(threads)
        return ShardedLlama(shard_model(model, 0, 1), precision, Group(0, 1), total_kv_heads, cache_dir)
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    address = f"tcp://127.0.0.1:{_free_port()}"
    shared = model.device.type == "cpu" and os.environ.get("PHASESCOPE_TP_SHARED_MEMORY", "1") != "0"
    link_path = SharedMemoryLink.create(world) if shared else None
    spawn = multiprocessing.get_context("spawn")
    workers = []
    try:
        for rank in range(1, world):
            shard = shard_model(model, rank, world)
            if model.device.type == "cuda":  # each rank its own device
                shard = _to_device(shard, torch.device(f"cuda:{rank}"))
            worker = spawn.Process(target=_serve, args=(rank, world, address, link_path, shard, precision, threads),
                                   name=f"phasescope-tp{rank}", daemon=True)
            worker.start()
            workers.append(worker)
            del shard
        group = _join_group(0, world, address, model.device, link_path,
                            peers_alive=lambda: all(worker.is_alive() for worker in workers))
        torch.set_num_threads(threads)
        runner = ShardedLlama(shard_model(model, 0, world), precision, group, total_kv_heads, cache_dir)
    except BaseException:
        for worker in workers:
            worker.kill()
        raise
    finally:
        if link_path:  # every rank has it mapped (or has failed): the name can go
            os.unlink(link_path)
    runner.workers = workers
    atexit.register(runner.close)  # before multiprocessing's own exit handler kills the workers
    return runner


def _to_device(shard: SimpleNamespace, device: torch.device) -> SimpleNamespace:
    moved = copy.copy(shard)
    moved.device = device

    def move(node):
        if isinstance(node, torch.Tensor):
            return node.to(device)
        if isinstance(node, SimpleNamespace):
            return SimpleNamespace(**{k: move(v) for k, v in vars(node).items()})
        if isinstance(node, list):
            return [move(item) for item in node]
        return node

    moved.model, moved.lm_head = move(shard.model), move(shard.lm_head)
    return moved


def _serve(rank: int, world: int, address: str, link_path: str | None, shard: SimpleNamespace, precision: str,
           threads: int) -> None:
    """A worker rank: build the slice's forward, then run every forward rank 0 broadcasts, until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is for rank 0, which stops us
    torch.set_num_threads(threads)
    parent = os.getppid()
    group = _join_group(rank, world, address, shard.device, link_path, peers_alive=lambda: os.getppid() == parent)
    runner = ShardedLlama(shard, precision, group)
    del shard
    pools: dict[int, KVPool] = {}
    try:
        while (command := group.broadcast()) is not None:
            kind, dropped, *rest = command
            for key in dropped:
                pools.pop(key, None)
            if kind == "pool":
                key, num_blocks, block_size, kv_dtype = rest
                pools[key] = KVPool(runner.num_layers, runner.num_kv_heads, runner.head_dim, num_blocks, block_size,
                                    kv_dtype, runner.device, prefix_caching=False)
            elif kind == "forward":
                ids, shared, need_logits, every_row, runner.attention = rest
                segments = []
                for key, block_ids, num_dropped, pos, num_tokens in shared:
                    cache = SequenceKV(pools[key], block_ids)
                    cache.num_dropped = num_dropped
                    segments.append((cache, pos, num_tokens))
                try:
                    runner._forward_rows(ids.to(runner.device), segments, need_logits, None, every_row)
                except Exception:  # rank 0 meets the same error at the same place, and reports it
                    pass
    finally:
        dist.destroy_process_group()
