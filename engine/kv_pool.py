"""The KV cache: one pool of fixed-size blocks that every running sequence shares (paged, as in vLLM).

The pool is one tensor kv: [layers, 2, kv_heads, num_blocks * block_size, head_dim]. A sequence owns a
block table; its position p lives in slot table[p // block_size] * block_size + p % block_size. So
sequences of any length share the pool without fragmentation, and a block of prompt tokens that two
requests have in common can be held by both: prefix caching.

Prefix caching (vLLM's automatic prefix caching): a full block is named by a hash of its tokens and of
the hash of the block before it, so equal names mean equal prefixes. A new request takes the longest
run of its prompt's full blocks that the pool already holds, and prefills only the rest. Blocks that no
request holds any more keep their contents and their name, and are evicted least-recently-used when
the pool needs room.

Reuse goes to the token, not only to the block: after the run of whole blocks, a prompt that continues
a named block only part of the way (a chat's next turn ends the reply with other tokens than were
generated, or starts mid-block) gets a fresh block with the matching rows copied in (copy on write: it
goes on writing into that block). A finished sequence's last block, filled only in part, is kept and
named for this too (after the block before it). So a turn prefills from where the cache stops
matching, not from the last block boundary before it (llama.cpp's slots reuse a prompt to the token,
vLLM's blocks only to the block).
"""
from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .errors import KVPoolTooSmall
from .info import PoolUsage


def kv_bytes_formula(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int, num_tokens: int) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element x tokens."""
    return 2 * num_layers * num_kv_heads * head_dim * element_size * num_tokens


def row_elements(dtype: torch.dtype, head_dim: int) -> int:
    """Elements one stored row (a head's keys or values at one position) takes: head_dim, and for an
    int8 cache 4 more that hold the row's fp32 scale (as the native step stores it)."""
    return head_dim + 4 if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] floats -> [..., D + 4] int8: each row divided by its largest magnitude / 127, rounded to
    nearest (even), then that scale's 4 bytes. The same arithmetic as the native step's store_row."""
    x = x.float()
    top = x.abs().amax(-1, keepdim=True)
    values = torch.where(top > 0, x * (127.0 / top), 0.0).round().to(torch.int8)
    return torch.cat([values, (top / 127.0).contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    return rows[..., :head_dim].float() * rows[..., head_dim:].contiguous().view(torch.float32)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + b"|" + ",".join(map(str, tokens)).encode(), digest_size=16).digest()


class SequenceKV:
    """One sequence's part of the pool: its block table and how many positions are written."""

    def __init__(self, pool: KVPool, block_ids: list[int], num_cached_tokens: int = 0) -> None:
        self.pool = pool
        self.block_ids = block_ids
        self.num_tokens = num_cached_tokens  # positions [0, num_tokens) hold keys and values
        self.num_dropped = 0  # tokens a sliding window dropped: position p >= the sinks is token p + this
        self.num_hashed_blocks = num_cached_tokens // pool.block_size  # leading blocks with a name
        self.last_hash = b""  # the name of the last named block (the parent of the next)
        self._table: torch.Tensor | None = None
        self._device_table: torch.Tensor | None = None
        self._is_consecutive = block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids))) if block_ids \
            else True

    @property
    def capacity_tokens(self) -> int:
        return len(self.block_ids) * self.pool.block_size

    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

    @property
    def bytes_used(self) -> int:
        return self.bytes_per_token * self.num_tokens

    @property
    def bytes_allocated(self) -> int:
        return self.bytes_per_token * self.capacity_tokens

    @property
    def block_table(self) -> torch.Tensor:
        """The block ids as an int64 CPU tensor (for the native step)."""
        if self._table is None:
            self._table = torch.tensor(self.block_ids, dtype=torch.int64)
        return self._table

    def _slot_ids(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Pool slots of positions [start, end), from the block table on the device it is on."""
        positions, size = torch.arange(start, end, device=table.device), self.pool.block_size
        return table[positions // size] * size + positions % size

    @property
    def has_unnamed_full_block(self) -> bool:
        """A block is full of written positions but has no name yet (prefix caching names it)."""
        return (self.num_hashed_blocks + 1) * self.pool.block_size <= self.num_tokens

    def reserve(self, pos: int, num_tokens: int) -> int:
        """The end of positions [pos, pos + num_tokens), checked to fit in the sequence's blocks."""
        end = pos + num_tokens
        if end > self.capacity_tokens:
            raise ValueError(f"KV cache full: {end} tokens do not fit in {self.capacity_tokens}")
        return end

    def _slots(self, start: int, end: int) -> torch.Tensor | slice:
        """Pool slots of positions [start, end): a slice where the blocks are consecutive, else indices."""
        size = self.pool.block_size
        if self._is_consecutive:  # a fresh pool hands blocks out in order: a view, no copy
            first = self.block_ids[0] * size
            return slice(first + start, first + end)
        if self._device_table is None:
            self._device_table = self.block_table.to(self.pool.kv.device)
        return self._slot_ids(self._device_table, start, end)

    def write_kv(self, layer: int, pos: int, kv: torch.Tensor) -> None:
        """Write kv ([2, kv_heads, T, head_dim]) at positions [pos, pos+T) of one layer."""
        end = self.reserve(pos, kv.shape[2])
        if self.pool.kv.dtype == torch.int8:
            kv = quantize_rows(kv)
        # in the pool's format (half-precision activations, an fp32 or fp16 cache): a slice converts as it
        # writes, but indices (blocks not in a row) must be given the same dtype
        self.pool.kv[layer][:, :, self._slots(pos, end)] = kv.to(self.pool.kv.dtype)  # [2, KV, slots, D]
        if layer == self.pool.num_layers - 1:
            self.num_tokens = max(self.num_tokens, end)

    def layer_kv(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of positions [0, end), [kv_heads, end, head_dim] each: views of
        the pool where the blocks are consecutive, else copies."""
        both = self.pool.kv[layer][:, :, self._slots(0, end)]
        if both.dtype == torch.int8:
            both = dequantize_rows(both, self.pool.head_dim)
        return both[0], both[1]

    def update_kv(self, layer: int, pos: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """write_kv, then that layer's keys and values for positions [0, pos+T)."""
        self.write_kv(layer, pos, kv)
        return self.layer_kv(layer, pos + kv.shape[2])

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same with keys and values apart, [kv_heads, T, head_dim] each."""
        return self.update_kv(layer, pos, torch.stack([k, v]))

    def mark_written(self, end: int) -> None:
        """Positions [0, end) are now filled in every layer (by a kernel writing the pool directly)."""
        self.num_tokens = max(self.num_tokens, end)

    def slide(self, sink_blocks: int) -> None:
        """A sliding window with attention sinks (StreamingLLM): forget the oldest block after the first
        sink_blocks, and reuse it for what comes next. The cache stops growing; the kept tokens move one
        block down in the cache but keep their keys, rotated where they stand in the text."""
        size = self.pool.block_size
        assert self.num_tokens == self.capacity_tokens and len(self.block_ids) > sink_blocks + 1
        assert self.num_hashed_blocks == 0, "a windowed sequence shares no blocks"
        self.block_ids.append(self.block_ids.pop(sink_blocks))
        self.num_tokens -= size
        self.num_dropped += size
        self._table = self._device_table = None
        self._is_consecutive = False

    def truncate(self, end: int) -> None:
        """Forget positions [end, num_tokens) (speculative decoding's rejected drafts); the next write
        there overwrites them. Named blocks are never cut into."""
        assert self.num_hashed_blocks * self.pool.block_size <= end <= self.num_tokens
        self.num_tokens = end


class KVPool:
    """Fixed-size blocks of keys and values, shared by every sequence, with prefix reuse."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV pool needs at least one block of one token, got {num_blocks} x {block_size}")
        self.num_layers, self.block_size, self.num_blocks = num_layers, block_size, num_blocks
        self.prefix_caching, self.head_dim = prefix_caching, head_dim
        # empty, not zeros: pages are committed as blocks are first written, not all at start
        row = row_elements(dtype, head_dim)
        self.kv = torch.empty((num_layers, 2, num_kv_heads, num_blocks * block_size, row), dtype=dtype,
                              device=device)
        self.bytes_per_token = kv_bytes_formula(num_layers, num_kv_heads, row, self.kv.element_size(), 1)
        self._free = list(range(num_blocks))  # a heap: lowest ids first, so fresh tables are consecutive
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its name
        self._block_of: dict[bytes, int] = {}  # name -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named, unreferenced; oldest first
        # what a named block holds and follows, so that a prompt can take part of one (see _partial_block);
        # a finished sequence's part-filled last block is named b"part" + the name of the block before it
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # block -> the tokens whose rows it holds
        self._parent_of: dict[int, bytes] = {}  # block -> the name of the block before it
        self._children: dict[bytes, set[int]] = {}  # a name -> the named blocks that follow it
        self.reuse_partial_blocks = True  # off where a copy in this pool would not reach others (tensor parallel)

    @classmethod
    def with_budget(cls, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype, device: torch.device | str = "cpu", prefix_caching: bool = True) -> KVPool:
        element = torch.tensor([], dtype=dtype).element_size()
        per_block = kv_bytes_formula(num_layers, num_kv_heads, row_elements(dtype, head_dim), element, block_size)
        return cls(num_layers, num_kv_heads, head_dim, max(1, budget_bytes // per_block), block_size, dtype, device,
                   prefix_caching)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> PoolUsage:
        num_cached = len(self._evictable)
        return PoolUsage(self.num_blocks, self.block_size, self.bytes_per_token * self.block_size,
                         self.num_blocks - len(self._free) - num_cached, num_cached)

    def take_scratch_block(self) -> int | None:
        """Set the pool's last block aside, out of every sequence's reach, and return its id (CUDA graphs
        pad a batch with rows that write and read there only); None when that block is in use. Zeroed,
        so that nothing there is ever a NaN."""
        last = self.num_blocks - 1
        if last < 1 or last not in self._free:
            return None
        self._free.remove(last)
        heapq.heapify(self._free)
        self.num_blocks = last
        self.kv[:, :, :, last * self.block_size:(last + 1) * self.block_size] = 0
        return last

    def check_fits(self, num_tokens: int) -> None:
        """Refuse a sequence that could never fit, even in an empty pool."""
        if blocks_for(num_tokens, self.block_size) > self.num_blocks:
            mb = self.num_blocks * self.block_size * self.bytes_per_token / 1e6
            raise KVPoolTooSmall(f"the request needs KV cache for {num_tokens:,} tokens, but the pool holds "
                                 f"{self.capacity_tokens:,} tokens ({mb:,.0f} MB): lower max new tokens, "
                                 "shorten the conversation, or raise --kv-cache-mb")

    def _prefix_blocks(self, prompt_ids: Sequence[int]) -> tuple[list[int], bytes]:
        """The pool's blocks holding the longest run of the prompt's full blocks, and the last name.
        The prompt's last token is always computed (its logits give the first token)."""
        found, parent = [], b""
        if not self.prefix_caching:
            return found, parent
        size = self.block_size
        for start in range(0, len(prompt_ids) - 1 - (len(prompt_ids) - 1) % size, size):
            name = block_hash(parent, prompt_ids[start:start + size])
            block = self._block_of.get(name)
            if block is None:
                break
            found.append(block)
            parent = name
        return found, parent

    def allocate(self, prompt_ids: Sequence[int], num_tokens: int, reuse: bool = True) -> SequenceKV | None:
        """Blocks for a sequence of num_tokens positions, reusing cached prompt blocks (unless not reuse:
        every prompt token is then computed); None if the pool has no room now (the request waits)."""
        self.check_fits(num_tokens)
        prompt_ids = prompt_ids if reuse else []
        reused, parent = self._prefix_blocks(prompt_ids)
        num_new = blocks_for(num_tokens, self.block_size) - len(reused)
        partial, num_rows = self._partial_block(prompt_ids, len(reused) * self.block_size, parent)
        room = len(self._free) + len(self._evictable) - sum(1 for b in reused if b in self._evictable)
        if partial in self._evictable:  # held while its rows are copied, it is one block less to take
            if num_new >= room:  # which the fresh blocks need: prefill those rows instead
                partial, num_rows = None, 0
            else:
                room -= 1
        if num_new > room:
            return None
        held = reused + ([partial] if partial is not None else [])
        for block in held:  # the partial block only while its rows are copied (not evicted for a fresh one)
            self._hold(block)
        fresh = [self._take() for _ in range(num_new)]
        sequence = SequenceKV(self, reused + fresh, len(reused) * self.block_size)
        sequence.last_hash = parent
        if partial is not None:
            self._copy_rows(partial, fresh[0], num_rows)
            sequence.num_tokens += num_rows
            self._release(partial)
        return sequence

    def _partial_block(self, prompt_ids: Sequence[int], start: int, parent: bytes) -> tuple[int | None, int]:
        """Of the named blocks that follow the reused ones (whose last is named parent), the one whose
        tokens the prompt continues furthest from position start, and for how many rows (never to the
        prompt's last token, which is always computed); (None, 0) if none."""
        wanted = prompt_ids[start:len(prompt_ids) - 1]
        best, most = None, 0
        if not (self.prefix_caching and self.reuse_partial_blocks and wanted):
            return best, most
        for block in self._children.get(parent, ()):
            tokens, count = self._tokens_of[block], 0
            while count < min(len(tokens), len(wanted)) and tokens[count] == wanted[count]:
                count += 1
            if count > most:
                best, most = block, count
        return best, most

    def _copy_rows(self, source: int, target: int, count: int) -> None:
        """Rows [0, count) of block source into block target, every layer, keys and values."""
        size = self.block_size
        self.kv[:, :, :, target * size:target * size + count] = self.kv[:, :, :, source * size:source * size + count]

    def _hold(self, block: int) -> None:
        self._evictable.pop(block, None)
        self._refs[block] += 1

    def _take(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
        else:  # evict the least recently released named block
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        self._refs[block] = 1
        return block

    def _name(self, block: int, name: bytes, parent: bytes, tokens: Sequence[int]) -> None:
        self._block_of[name], self._hash_of[block] = block, name
        self._tokens_of[block], self._parent_of[block] = tuple(tokens), parent
        self._children.setdefault(parent, set()).add(block)

    def _forget(self, block: int) -> None:
        """The block's name goes: its rows are about to be overwritten."""
        del self._block_of[self._hash_of.pop(block)]
        del self._tokens_of[block]
        parent = self._parent_of.pop(block)
        self._children[parent].discard(block)
        if not self._children[parent]:
            del self._children[parent]

    def _release(self, block: int) -> None:
        """One holder fewer: unreferenced, a named block stays cached (most recent last), others free."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)

    def name_full_blocks(self, sequence: SequenceKV, token_ids: Sequence[int]) -> None:
        """Give every newly filled block of the sequence its name, so later requests can reuse it.
        token_ids: the sequence's tokens so far (prompt, then generated)."""
        if not self.prefix_caching:
            return
        size = self.block_size
        while sequence.has_unnamed_full_block:
            index = sequence.num_hashed_blocks
            tokens = token_ids[index * size:(index + 1) * size]
            name = block_hash(sequence.last_hash, tokens)
            block = sequence.block_ids[index]
            if name not in self._block_of and block not in self._hash_of:
                self._name(block, name, sequence.last_hash, tokens)
            sequence.last_hash, sequence.num_hashed_blocks = name, index + 1

    def free(self, sequence: SequenceKV, token_ids: Sequence[int] | None = None) -> None:
        """Release a finished sequence's blocks: named ones stay cached (most recent last), others free.
        token_ids: the sequence's tokens (prompt, then generated), to keep its part-filled last block."""
        if token_ids is not None:
            self._name_part_block(sequence, token_ids)
        for block in reversed(sequence.block_ids):  # a prefix's tail is evicted before its head
            self._release(block)
        sequence.block_ids = []

    def drop_cached(self) -> None:
        """Forget every cached prefix that no sequence holds (the engine's warm-up leaves none behind)."""
        while self._evictable:
            block, _ = self._evictable.popitem()
            self._forget(block)
            heapq.heappush(self._free, block)

    def _name_part_block(self, sequence: SequenceKV, token_ids: Sequence[int]) -> None:
        """Name the sequence's block after its named ones, if rows of it are written, by its parent's name,
        remembering its tokens; it replaces a part-filled block of that name kept before."""
        size, index = self.block_size, sequence.num_hashed_blocks
        count = min(sequence.num_tokens, len(token_ids)) - index * size
        if not (self.prefix_caching and self.reuse_partial_blocks and 0 < count < size) or sequence.num_dropped:
            return
        block, name = sequence.block_ids[index], b"part" + sequence.last_hash
        if block in self._hash_of:
            return
        previous = self._block_of.get(name)
        if previous is not None and self._refs[previous]:
            return  # (a part-filled block is only held while a new sequence copies from it)
        if previous is not None:  # the older one of that name goes
            del self._evictable[previous]
            self._forget(previous)
            heapq.heappush(self._free, previous)
        self._name(block, name, sequence.last_hash, token_ids[index * size:index * size + count])
