"""A shared-memory link between the ranks of tensor parallelism on one machine (tensor_parallel.py):
their all-reduces and gathers as copies through one file in /dev/shm, where gloo sent them over TCP
loopback with threads of its own, on the cores the ranks compute on."""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import tempfile
from collections.abc import Callable

import torch

SLOT_BYTES = 2 << 20  # a prefill chunk of 512 tokens x 576 floats is 1.2 MB; longer ones go in pieces


class SharedMemoryLink:
    """One rank's end of the link.

    Each rank owns a slot (two, used in turns) and a counter. To share a tensor, a rank copies it into
    its slot and sets its counter to the exchange's number; once every counter has reached that number,
    every slot holds its rank's tensor, and each rank reads them all, in rank order, so that every rank's
    sum rounds alike. A rank can start exchange n + 1, which writes the slots n - 1 used, only once every
    rank has announced n, that is, has finished reading n - 1's. The protocol relies on x86's stores
    being seen in the order they were made; elsewhere the ranks use gloo."""

    HEADER = 4096  # the counters, 64 bytes apart (each on its own cache line)

    def __init__(self, path: str, rank: int, world: int, peers_alive: Callable[[], bool],
                 slot_bytes: int = SLOT_BYTES) -> None:
        """path: the file create() made. peers_alive: whether the other ranks still run, asked while a
        wait goes on (gloo would notice a closed connection; a counter in memory just stops moving)."""
        self.rank, self.world, self._peers_alive, self.slot_bytes = rank, world, peers_alive, slot_bytes
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), self.size(world, slot_bytes))
        self._counters = [ctypes.c_int64.from_buffer(self._map, 64 * r) for r in range(world)]
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=self.HEADER, count=2 * world * slot_bytes)
        self._slots = data.view(2, world, slot_bytes)
        self._count = 0

    @classmethod
    def size(cls, world: int, slot_bytes: int = SLOT_BYTES) -> int:
        return cls.HEADER + 2 * world * slot_bytes

    @classmethod
    def create(cls, world: int, slot_bytes: int = SLOT_BYTES) -> str | None:
        """A zeroed file in /dev/shm for `world` ranks (its path), or None where shared memory cannot be
        used here: not x86, no /dev/shm, or no room in it (reserved now, so that a full /dev/shm is found
        here and not as a crash at the first write)."""
        if platform.machine().lower() not in ("x86_64", "amd64") or not os.path.isdir("/dev/shm"):
            return None
        try:
            fd, path = tempfile.mkstemp(prefix="phasescope-tp-", dir="/dev/shm")
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, cls.size(world, slot_bytes))
        except OSError:
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        return path

    def all_reduce(self, x: torch.Tensor) -> None:
        """x (contiguous) becomes the sum of every rank's x, in place."""
        flat = x.view(-1)
        step = self.slot_bytes // x.element_size()
        for begin in range(0, flat.numel(), step):
            piece = flat[begin:begin + step]
            parts = self._exchange(piece)
            torch.add(parts[0], parts[1], out=piece)
            for part in parts[2:]:
                piece.add_(part)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (contiguous, the same shape on every rank), in rank order."""
        gathered = [torch.empty_like(x) for _ in range(self.world)]
        flat = x.view(-1)
        step = self.slot_bytes // x.element_size()
        for begin in range(0, flat.numel(), step):
            for whole, part in zip(gathered, self._exchange(flat[begin:begin + step])):
                whole.view(-1)[begin:begin + step].copy_(part)
        return gathered

    def _exchange(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's piece, as views of their slots: valid until this rank's next exchange."""
        self._count += 1
        slots = self._slots[self._count % 2]
        size = piece.numel() * piece.element_size()
        slots[self.rank, :size].view(piece.dtype).copy_(piece)
        self._counters[self.rank].value = self._count  # after the copy: what the others wait for
        for rank in range(self.world):
            if rank != self.rank:
                self._wait_for(rank)
        return [slots[rank, :size].view(piece.dtype) for rank in range(self.world)]

    def _wait_for(self, rank: int) -> None:
        counter, spins = self._counters[rank], 0
        while counter.value < self._count:
            spins += 1
            if spins > 100:  # a long wait leaves the core to whoever needs it, the other rank maybe
                os.sched_yield()
                if spins % 10_000 == 0 and not self._peers_alive():
                    raise RuntimeError("a tensor-parallel rank has stopped")
