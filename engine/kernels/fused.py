"""The decode step as one native call (engine/kernels/csrc/decode_step.cpp), for the lean path on CPU; and
prefill's attention, which reads the cached keys where they lie in the paged pool.

A decode step reads every weight once for a batch of tokens (one per running sequence), so it should
run at memory bandwidth; in eager PyTorch most of it went to ~25 small ops per layer. The C++ file has
no torch headers: it is built once per machine with the system's C++ compiler (8 s on two cores, while the
model loads: Engine.from_config begins it), cached beside the converted weights, and called through ctypes
with the addresses of the tensors LeanLlama already holds. Where it cannot be built (no compiler, not
x86/ARM Linux or macOS), or PHASESCOPE_FUSED_DECODE=0, decode runs the PyTorch ops instead, with the same
results.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch

from ..events import FORWARD_STAGES, WAKE
from ..kv_pool import SequenceKV
from ..models.loader import remove_leftovers, resolve_device, scratch_prefix, stage
from ..models.quantize import packed_numel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_step.cpp"
STAGES = (*FORWARD_STAGES, WAKE)  # the native step's Stage enum: its stages, then its threads' waking
# -ffp-contract=fast: a * b + c is one FMA everywhere, so every path rounds alike. -fno-trapping-math:
# without it a comparison may not be computed ahead of its branch, and no loop with one is vectorized:
# every fast_exp (its clamp) ran one float at a time (prefill attention 1.3-1.5x slower; the exp-and-sum
# loops of decode attention and of the logits' logsumexp, and SiLU, stayed scalar too).
FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-shared",
         "-fPIC"]


def _arch_flags() -> list[str]:
    """-march=native, or what PHASESCOPE_NATIVE_ARCH says (e.g. "-march=x86-64-v3" to build and test
    the AVX2 path on a CPU that has VNNI)."""
    return os.environ.get("PHASESCOPE_NATIVE_ARCH", "-march=native").split()


class KernelUnavailable(RuntimeError):
    """The native decode step could not be built or loaded here; the PyTorch ops are used instead."""


def _cpu_signature() -> str:
    try:  # -march=native: a library built here is only valid on a CPU with the same features
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = [line for line in lines if line.startswith(("flags", "Features"))]
        return flags[0] if flags else platform.processor()
    except OSError:
        return platform.processor()


def build_library(cache_dir: Path) -> Path:
    """Compile the decode step once per source, compiler and CPU; return the shared library's path. A
    compile start_early began is waited for."""
    target, command = _library(cache_dir)
    if target.exists():
        return target
    building = _building(target, command)
    if not building.done():
        log.info("compiling the native decode step once with %s (about 8 s on two cores); later starts read %s",
                 command[0], target, extra=stage("compile"))
    return building.result()


def start_early(cache_dir: Path, device: str, precision: str, tensor_parallel: int = 1) -> None:
    """Begin the compile before the model loads (a first start converts it meanwhile: 6 s), where the native
    step is to decode it: on CPU (device as --device gives it), in fp32 or int8 (auto: int8), in one
    process. Nothing where it cannot be built: load_fused_decode says why."""
    on_cpu = device == "cpu" or (device == "auto" and resolve_device(device).type == "cpu")
    if (os.environ.get("PHASESCOPE_FUSED_DECODE", "1") == "0" or not on_cpu
            or precision not in ("auto", "fp32", "int8") or tensor_parallel > 1):
        return
    try:
        target, command = _library(cache_dir)
    except KernelUnavailable:
        return
    if not target.exists():
        _building(target, command)


_BUILDS: dict[Path, Future] = {}  # by target: the compiles under way
_BUILDS_LOCK = threading.Lock()


def _building(target: Path, command: list[str]) -> Future:
    """The compile of target, begun now in a thread unless one is under way."""
    with _BUILDS_LOCK:
        if target in _BUILDS:
            return _BUILDS[target]
        building = _BUILDS[target] = Future()

    def build() -> None:
        try:
            building.set_result(_compile(target, command))
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            building.set_exception(exc)
        finally:  # a later start finds the library, or tries again
            with _BUILDS_LOCK:
                del _BUILDS[target]

    threading.Thread(target=build, name="compile-decode-step", daemon=True).start()
    return building


def _library(cache_dir: Path) -> tuple[Path, list[str]]:
    """Where the library for this source, compiler and CPU lies in cache_dir, and the command that builds it
    (its output path last)."""
    compiler = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"no C++ compiler ({compiler}): {exc}") from None
    flags = FLAGS + _arch_flags()
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(flags), version, _cpu_signature()]).encode())
    target = cache_dir / "kernels" / f"decode_step-{key.hexdigest()[:16]}.so"
    return target, [compiler, *flags, str(SOURCE), "-o"]


def _compile(target: Path, command: list[str]) -> Path:
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=scratch_prefix()) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([*command, str(built)], capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise KernelUnavailable(f"{command[0]} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: a concurrent process sees the whole file or none
    return target


def _int64s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class FusedDecode:
    """Runs LeanLlama's T = 1 forward in one call, on the weights LeanLlama holds (each linear's
    `native_layout()`: fp32 input-major [in, out], or int8 output-major [out, in] with per-row scales,
    whose rows a library built for AVX-512 has packed 16 at a time, in place, when it loads)."""

    def __init__(self, lean, library: Path) -> None:
        native = ctypes.CDLL(str(library))
        self._fn = native.ps_decode_batch
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        self._top = native.ps_top_logits
        self._top.restype = ctypes.c_float
        self._top.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        self._top_tempered = native.ps_top_tempered
        self._top_tempered.restype = ctypes.c_float
        self._top_tempered.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                                       ctypes.c_void_p]
        self._nucleus = native.ps_nucleus
        self._nucleus.restype = ctypes.c_int64
        self._nucleus.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_void_p]
        self._nucleus_out = (ctypes.c_int64 * self.NUCLEUS_CAP)(), (ctypes.c_float * self.NUCLEUS_CAP)()
        self._penalized = native.ps_penalized
        self._penalized.restype = None
        self._penalized.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                    ctypes.c_void_p]
        self._penalized_out = torch.empty(0)
        self._top_out: dict[tuple[int, int], tuple] = {}  # top_logits_batch's, by rows and k
        self._top_batch = native.ps_top_logits_batch
        self._top_batch.restype = None
        self._top_batch.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._wake = native.ps_wake_threads
        self._wake.restype = ctypes.c_double
        self._wake.argtypes = [ctypes.c_int64]
        self._bind = native.ps_bind_threads
        self._bind.restype = ctypes.c_int64
        self._bind.argtypes = [ctypes.c_int64, ctypes.c_int64]
        self._bound: tuple | None = None  # (thread, team size) of the team bound a CPU per thread
        self.kv_formats = native.ps_kv_formats()  # bit 0: fp32 KV cache, bit 1: fp16, bit 2: int8
        self._attend = native.ps_prefill_attention
        self._attend.restype = ctypes.c_int
        self._attend.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.has_prefill_attention = lean.head_dim in (64, 128)
        self._linear_int8 = native.ps_linear_int8
        self._linear_int8.restype = None
        self._linear_int8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        self._pack_int8 = native.ps_pack_int8
        self._pack_int8.restype = None
        self._pack_int8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self.int8_row_group = native.ps_int8_row_group()  # 16: int8 rows packed 16 at a time (AVX-512); 0: as they are
        self._heads, self._kv_heads = lean.num_heads, lean.num_kv_heads
        self._eps = lean.eps
        self.is_int8 = lean.precision == "int8"
        hidden, intermediate = lean.embed.shape[1], lean.layers[0].down.input_features
        if self.is_int8 and (hidden % 64 or intermediate % 64 or lean.num_heads * lean.head_dim % 64):
            raise KernelUnavailable("int8 decode needs layer widths divisible by 64 (its activation blocks)")
        if self.is_int8:  # the rows as this build reads them (the int8 cache may hold them so already)
            for linear in lean._linears():
                if self.int8_row_group and linear.row_group != self.int8_row_group:
                    self.pack(linear)
                elif not self.int8_row_group:
                    linear.use_plain_rows()
        self._keep: list[torch.Tensor] = []  # every tensor whose address the kernel holds
        self._layer_ptrs = torch.tensor([self._layer_row(layer) for layer in lean.layers], dtype=torch.int64)
        half = lean.head_dim // 2  # rotations: cos + i sin per position and pair
        cos = lean.rotations.real.reshape(-1, half).contiguous()
        sin = lean.rotations.imag.reshape(-1, half).contiguous()
        self._model_ptrs = torch.tensor([self._ptr(lean.embed.contiguous()), self._ptr(lean.final_norm),
                                         *self._linear_ptrs(lean.lm_head), self._ptr(cos), self._ptr(sin)],
                                        dtype=torch.int64)
        self._dims = [lean.num_layers, lean.num_heads, lean.num_kv_heads, lean.head_dim, hidden, intermediate,
                      lean.lm_head.output_features]
        self.num_positions = cos.shape[0]
        self.split_kv = True  # Flash Decoding: long sequences' attention cut into chunks across the threads

    def pack(self, linear) -> None:
        """An Int8Linear's rows in the layout this build's int8 matmuls read (see ps_pack_int8)."""
        rows, group = linear.rows(), self.int8_row_group
        out, inputs = rows.shape
        packed = torch.empty(packed_numel(out, inputs, group), dtype=torch.uint8)
        self._pack_int8(rows.contiguous().data_ptr(), out, inputs, torch.get_num_threads(), packed.data_ptr())
        linear.use_packed_rows(packed, group)

    def _layer_row(self, layer) -> list[int]:
        """14 addresses, in the kernel's order: (weight, scale, bias) of qkv, o, gate_up, down; 2 norms."""
        linears = [self._linear_ptrs(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(linears, []) + [self._ptr(layer.attn_norm), self._ptr(layer.mlp_norm)]

    def _ptr(self, t: torch.Tensor | None) -> int:
        if t is not None:
            assert t.is_contiguous() and t.device.type == "cpu"
            self._keep.append(t)
        return _address(t)

    def _linear_ptrs(self, linear) -> list[int]:
        weight, scale, bias = linear.native_layout()
        expected = (torch.uint8 if self.int8_row_group else torch.int8) if self.is_int8 else torch.float32
        assert weight.dtype == expected, (weight.dtype, expected)
        return [self._ptr(weight), self._ptr(scale), self._ptr(None if bias is None else bias.float().contiguous())]

    def prefill_attention(self, qkv: torch.Tensor, layer: int, pos: int, sequence: SequenceKV) -> torch.Tensor:
        """Causal attention of a prefill chunk, T tokens at positions [pos, pos+T): qkv [T, (H + 2KV) * D]
        with q and k rotated -> [T, H * D]. Writes the chunk's keys and values into the sequence's slots of
        the pool, then reads every key through the block table, without gathering them into one tensor."""
        pool, (num_tokens, width) = sequence.pool, qkv.shape
        assert qkv.is_contiguous() and qkv.dtype == torch.float32 and pool.kv.is_contiguous()
        end = sequence.reserve(pos, num_tokens)
        head_dim = pool.head_dim
        out = torch.empty((num_tokens, self._heads * head_dim), dtype=torch.float32)
        dims = torch.tensor([self._heads, self._kv_heads, head_dim, pool.kv.shape[3], pool.block_size,
                             torch.get_num_threads(), _kv_format(pool)], dtype=torch.int64)
        status = self._attend(dims.data_ptr(), qkv.data_ptr(), width, pool.kv[layer, 0].data_ptr(),
                              pool.kv[layer, 1].data_ptr(), sequence.block_table.data_ptr(), pos, num_tokens,
                              out.data_ptr())
        assert status == 0, "has_prefill_attention said this head dimension has a kernel"
        if layer == pool.num_layers - 1:
            sequence.mark_written(end)
        return out

    def linear_int8(self, x: torch.Tensor, linear) -> torch.Tensor:
        """A prefill's int8 linear over x [T, in] -> [T, out], from the same int8 rows and per-row scales
        the decode step reads, x quantized per block of 64 as there (see Int8Linear.use_kernel)."""
        weight, scale, bias = linear.native_layout()
        x = x.float().contiguous()
        y = torch.empty((x.shape[0], linear.output_features), dtype=torch.float32)
        self._linear_int8(x.data_ptr(), x.shape[0], linear.input_features, linear.output_features, weight.data_ptr(),
                          scale.data_ptr(), _address(bias), torch.get_num_threads(), y.data_ptr())
        return y

    def wake_threads(self) -> float:
        """Wakes the calling thread's OpenMP team, asleep since its last work; returns the ms that took
        (see ps_wake_threads)."""
        return self._wake(torch.get_num_threads())

    def bind_threads(self, on: bool) -> None:
        """Each thread of the calling thread's OpenMP team on a CPU of its own (on), or free to run on any
        (see ps_bind_threads). Called before every step: it acts where that changes the team's binding, or
        where another thread or team size steps the forward now."""
        team = (threading.get_ident(), torch.get_num_threads())
        wanted = team if on else None
        if self._bound == wanted:
            return
        if self._bind(team[1], int(on)) < 0:
            raise OSError("could not bind the forward's threads to CPUs (sched_setaffinity refused)")
        self._bound = wanted

    def top_logits(self, logits: torch.Tensor, k: int) -> tuple[list[int], list[float], float]:
        """sampling.top_logits, natively: the k largest logits' ids and values, and logsumexp."""
        logits = logits.float().contiguous()
        k = min(k, logits.shape[-1])
        ids, values = (ctypes.c_int64 * k)(), (ctypes.c_float * k)()
        lse = self._top(logits.data_ptr(), logits.shape[-1], k, ids, values)
        if ids[0] < 0:
            raise ValueError("the model produced no finite logits")
        return list(ids), list(values), lse

    def top_tempered(self, scores: torch.Tensor, k: int, scale: float) -> tuple[list[int], list[float], float]:
        """sampling.top_tempered, natively: no scores / temperature made over the vocabulary first."""
        scores = scores.float().contiguous()
        k = min(k, scores.shape[-1])
        ids, values = (ctypes.c_int64 * k)(), (ctypes.c_float * k)()
        lse = self._top_tempered(scores.data_ptr(), scores.shape[-1], k, scale, ids, values)
        return list(ids), list(values), lse

    NUCLEUS_CAP = 8192  # tokens a nucleus may hold (the bundled model's at temperature 1.0, top-p 0.9: 8,475 at most)

    def nucleus(self, scores: torch.Tensor, scale: float, top_p: float) -> tuple[list[int], list[float]] | None:
        """The tokens top-p keeps under temperature 1 / scale, most likely first, and their probabilities,
        from the whole vocabulary without sorting it; None where it cannot say (sampling's _kept then does)."""
        scores = scores.float().contiguous()
        ids, probs = self._nucleus_out  # one engine thread samples: the same two arrays every time
        count = self._nucleus(scores.data_ptr(), scores.shape[-1], scale, top_p, self.NUCLEUS_CAP, ids, probs)
        return (ids[:count], probs[:count]) if count > 0 else None

    def penalized(self, logits: torch.Tensor, seen_ids: torch.Tensor, penalty: float) -> torch.Tensor:
        """sampling.apply_repetition_penalty with seen_ids a tensor of distinct ids (SeenTokens'), natively,
        into a buffer of its own: the result holds until the next call (one engine thread samples, a row at
        a time). As there, logits themselves where nothing is penalized."""
        if penalty == 1.0 or len(seen_ids) == 0:
            return logits
        logits = logits.float().contiguous()
        ids = seen_ids.contiguous()
        if self._penalized_out.shape != logits.shape:
            self._penalized_out = torch.empty_like(logits)
        out = self._penalized_out
        self._penalized(logits.data_ptr(), logits.shape[-1], ids.data_ptr(), ids.shape[0], penalty, out.data_ptr())
        return out

    def top_logits_batch(self, logits: torch.Tensor, k: int) -> list[tuple[list[int], list[float], float]]:
        """top_logits of each row of logits [B, vocab], the rows spread over the threads."""
        if logits.dtype != torch.float32 or not logits.is_contiguous():
            logits = logits.float().contiguous()
        rows, vocab = logits.shape
        k = min(k, vocab)
        # ctypes arrays, not torch tensors: each torch op pays microseconds of dispatch, and this runs every
        # step; made once for each size (one engine thread decodes)
        if (rows, k) not in self._top_out:
            self._top_out[rows, k] = ((ctypes.c_int64 * (rows * k))(), (ctypes.c_float * (rows * k))(),
                                      (ctypes.c_float * rows)())
        ids, values, lse = self._top_out[rows, k]
        self._top_batch(logits.data_ptr(), rows, vocab, k, torch.get_num_threads(), ids, values, lse)
        ids, values, lse = ids[:], values[:], lse[:]
        if any(ids[b * k] < 0 for b in range(rows)):
            raise ValueError("the model produced no finite logits")
        return [(ids[b * k:(b + 1) * k], values[b * k:(b + 1) * k], lse[b]) for b in range(rows)]

    def __call__(self, tokens: list[int], positions: list[int], sequences: list[SequenceKV],
                 capture: int | None = None, stages: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """Logits [B, vocab] after tokens[b] at positions[b] of sequences[b] (all in one pool); their keys
        and values land in the pool. capture: a sequence's index in the batch, whose attention weights
        [layers, heads, positions + 1] are returned beside the logits, with the step's time per stage
        ({stage: ms}, STAGES: its stages and its threads' waking); stages: that time alone, (logits, None,
        {stage: ms}). A sequence whose sliding window dropped tokens (SequenceKV.num_dropped) has its tokens
        rotated at their positions in the text, not their places in the cache."""
        ends = [seq.reserve(pos, 1) for seq, pos in zip(sequences, positions)]
        pool = sequences[0].pool
        assert pool.kv.is_contiguous()
        assert all(seq.pool is pool for seq in sequences), "one batch, one pool"
        width = max(len(seq.block_ids) for seq in sequences)
        # int64 arrays as ctypes arrays, not torch tensors: each torch.tensor costs microseconds, every step
        tables = _int64s([block for seq in sequences  # [B, width], padded with a valid block never read
                          for block in seq.block_ids + [0] * (width - len(seq.block_ids))])
        dims = _int64s(self._dims + [pool.kv.shape[3], pool.block_size, int(self.is_int8), torch.get_num_threads(),
                                     int(self.split_kv), _kv_format(pool)])
        token_ids, where = _int64s(tokens), _int64s(positions)
        rope = None
        if any(seq.num_dropped for seq in sequences):
            rope = _int64s([p + seq.num_dropped for p, seq in zip(positions, sequences)])
        logits = torch.empty((len(tokens), self._dims[-1]), dtype=torch.float32)
        weights = stage_ms = None
        if capture is not None:  # [layers, heads, positions + 1]
            weights = torch.empty((self._dims[0], self._dims[1], positions[capture] + 1), dtype=torch.float32)
        if capture is not None or stages:
            stage_ms = torch.zeros(len(STAGES), dtype=torch.float64)
        status = self._fn(dims, self._eps, self._layer_ptrs.data_ptr(), self._model_ptrs.data_ptr(),
                          pool.kv.data_ptr(), len(tokens), token_ids, where, tables, width, logits.data_ptr(),
                          _address(weights), -1 if capture is None else capture, _address(stage_ms), rope)
        if status != 0:
            raise ValueError(f"decode step refused tokens {tokens} at positions {positions}")
        for seq, end in zip(sequences, ends):
            seq.mark_written(end)
        if stage_ms is None:
            return logits
        return logits, weights, dict(zip(STAGES, stage_ms.tolist()))


KV_FORMATS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # decode_step.cpp's KvFormat


def _kv_format(pool) -> int:
    return KV_FORMATS[pool.kv.dtype]


def load_fused_decode(lean, cache_dir: Path) -> FusedDecode | None:
    """The native decode step for this model, or None (with a warning saying why) to use PyTorch ops."""
    if os.environ.get("PHASESCOPE_FUSED_DECODE", "1") == "0":
        return None
    try:
        return FusedDecode(lean, build_library(cache_dir))
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as exc:  # incl. a read-only cache, a timeout
        warnings.warn(f"decode runs PyTorch ops: the native decode step is unavailable ({exc})", stacklevel=2)
        return None
