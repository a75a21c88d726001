"""Weight-only int8 quantization for the lean path: per-output-channel scales, activations
quantized on the fly (FBGEMM's dynamic linear, fast on AVX2 CPUs).

A handler makes the quantized weights once, at load, and is then called like F.linear.
"""
from __future__ import annotations

import functools
import logging
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from .loader import remove_leftovers, stage, write_atomically

log = logging.getLogger(__name__)


class DenseLinear:
    """y = x W^T + b, in the weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.output_features, self.input_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def native_layout(self) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        """(W [out, in], no scales, bias) for the native decode step."""
        return self.weight.contiguous(), None, self.bias

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)


def packed_numel(out: int, inputs: int, row_group: int) -> int:
    """Bytes of an [out, inputs] int8 matrix packed row_group rows at a time (the last group padded)."""
    return -(-out // row_group) * row_group * inputs


class Int8Linear:
    """int8 weights with one fp32 scale per output channel; x stays fp32 and is quantized per call.

    The weights are kept as plain rows ([out, in]) for the native library, which quantizes activations
    per block of 64 (the decode step, and prefill through use_kernel); a library built for AVX-512 has
    them packed 16 rows at a time instead (use_packed_rows), in place of the plain rows. Where the
    library is not built, FBGEMM runs prefill on its own packed copy of the rows (made at the first
    call), with one activation scale per tensor: less accurate, and the weights twice in memory."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.detach().float().cpu()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensor constructors are deprecated, not yet replaced
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
        self._setup(quantized.int_repr(), scales.float(), bias)

    @classmethod
    def from_rows(cls, rows: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """The linear of already quantized weights: int8 rows [out, in] and their fp32 scales [out]."""
        linear = cls.__new__(cls)
        linear._setup(rows, scales.float(), bias)
        return linear

    @classmethod
    def from_packed(cls, packed: torch.Tensor, row_group: int, input_features: int, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> Int8Linear:
        """The linear of rows already packed row_group at a time (as use_packed_rows holds them)."""
        linear = cls.__new__(cls)
        linear._setup(packed, scales.float(), bias, row_group, input_features)
        return linear

    def _setup(self, rows: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, row_group: int = 0,
               input_features: int = 0) -> None:
        bias = None if bias is None else bias.detach().float().cpu().contiguous()
        self._packed, self._kernel = None, None
        self._row_group = row_group  # 0: the native layout's rows are [out, in]; 16: packed (use_packed_rows)
        self.output_features, self.input_features = (scales.numel(), input_features) if row_group else rows.shape
        self._nbytes = self.output_features * self.input_features + scales.numel() * 4 + (
            0 if bias is None else bias.numel() * 4)
        self._native_layout = (rows.contiguous(), scales.contiguous(), bias)

    def use_packed_rows(self, packed: torch.Tensor, row_group: int) -> None:
        """Hold the rows in the layout the native library reads (FusedDecode packs them) instead of
        [out, in]: one copy of the weights, as before."""
        _, scales, bias = self._native_layout
        self._native_layout, self._row_group = (packed, scales, bias), row_group

    @property
    def row_group(self) -> int:
        """How the rows are held: 0 as [out, in], else packed that many rows at a time."""
        return self._row_group

    def use_plain_rows(self) -> None:
        """Hold the rows as [out, in] again (a library that reads them so, or none)."""
        if self._row_group:
            _, scales, bias = self._native_layout
            self._native_layout, self._row_group = (self.rows().contiguous(), scales, bias), 0

    def rows(self) -> torch.Tensor:
        """The int8 rows [out, in], unpacked if they are held packed (a copy, then)."""
        weights = self._native_layout[0]
        if not self._row_group:
            return weights
        group, (out, inputs) = self._row_group, (self.output_features, self.input_features)
        # packed: [row groups][inputs / 4][group rows][4] bytes, each w + 128
        unpacked = weights.view(-1, inputs // 4, group, 4).permute(0, 2, 1, 3).reshape(-1, inputs)[:out]
        return (unpacked.to(torch.int16) - 128).to(torch.int8)

    def use_kernel(self, kernel, keep_copy: bool = False) -> None:
        """Run through the native library's int8 matmul (FusedDecode.linear_int8) from now on; None: FBGEMM.
        FBGEMM's copy of the weights is let go while the native kernel runs, unless keep_copy."""
        self._kernel = kernel
        if kernel is not None and not keep_copy:
            self._packed = None

    @property
    def runs_on(self) -> str:
        return "native" if self._kernel is not None else "FBGEMM"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel(x, self)
        if self._packed is None:  # FBGEMM's layout, a second copy of the weights, made when first needed
            (_, scales, bias), rows = self._native_layout, self.rows()
            zero_points = torch.zeros(rows.shape[0], dtype=torch.long)
            with warnings.catch_warnings():  # quantized tensor constructors are deprecated, not yet replaced
                warnings.simplefilter("ignore")
                quantized = torch._make_per_channel_quantized_tensor(rows, scales.double(), zero_points, 0)
            self._packed = torch.ops.quantized.linear_prepack(quantized, bias)
        return torch.ops.quantized.linear_dynamic(x, self._packed, reduce_range=fbgemm_reduces_range())

    def native_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(int8 W [out, in] or its packed form (use_packed_rows), fp32 scales [out], bias) for the native
        decode step."""
        return self._native_layout

    @property
    def nbytes(self) -> int:
        return self._nbytes


@functools.cache
def fbgemm_reduces_range() -> bool:
    """Whether FBGEMM must quantize activations to 7 bits. Without AVX-512 VNNI it multiplies them with
    vpmaddubsw, whose 16-bit sums of two products saturate on full-range activations: its results were
    noise on a Zen 3 (top-1 agreement with fp32 8 %). PyTorch's own dynamic-quantized Linear always
    reduces; with VNNI the full range is safe and keeps a bit of precision."""
    try:
        return "avx512_vnni" not in Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the safe choice
        return True


class Int8Cache:
    """Makes Int8Linears as the class does, but keeps their int8 rows and scales in a safetensors file
    on the first load and reads them back on later loads of the same weights: quantizing took ~0.5 s of
    a cold start. The rows are kept as the native library last held them (packed 16 at a time on
    AVX-512 builds: packing took 0.05-0.08 s of a cold start), with the row group beside them, so that a
    file written on another machine is still read (FusedDecode packs or unpacks what does not fit).
    Linears are matched by the order they are made in (LeanLlama makes them in a fixed order); from the
    first that does not match (another layout, a damaged file) on, they are quantized again and the file
    is written anew."""

    def __init__(self, path: Path, weights: str = "") -> None:
        """weights: what the rows are made from (the weights files, their sizes and times), kept in the file:
        rows made from other weights (the file rewritten since) are made again, in the same file."""
        self.path, self.weights = path, weights
        remove_leftovers(path.parent)  # rows a start killed while writing them left (7 GB for a 7 B model)
        self._saved: dict[str, torch.Tensor] = {}
        self._made: list[Int8Linear] = []
        self._read_groups: list[int] = []  # the row group each linear read from the file had
        try:
            from safetensors import safe_open

            if path.exists():
                with safe_open(str(path), framework="pt") as f:
                    if (f.metadata() or {}).get("weights", "") == weights:
                        self._saved = {name: f.get_tensor(name) for name in f.keys()}
        except Exception:  # a damaged or foreign file: quantize again, and replace it
            self._saved = {}

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        linear = self.cached(weight.shape, bias)
        if linear is None:
            if len(self._made) == len(self._read_groups):  # the first linear made now, not read from the file
                log.info("quantizing the weights to int8 once (a second for the bundled model, a minute or two "
                         "for a 7 B one, on two cores); later starts read them from %s", self.path,
                         extra=stage("quantize"))
            linear = Int8Linear(weight, bias)
            self._made.append(linear)
        return linear

    def cached(self, shape: tuple[int, int], bias: torch.Tensor | None = None) -> Int8Linear | None:
        """The next linear read from the file, if the file holds one of this [out, in] shape (then its
        float weight need not be built); else None, and the next call makes it."""
        i, (out, inputs) = len(self._made), shape
        rows, scales, group = self._saved.get(f"w{i}"), self._saved.get(f"s{i}"), self._saved.get(f"g{i}")
        group = int(group.item()) if group is not None and group.numel() == 1 else 0
        if len(self._read_groups) != i or rows is None or scales is None or scales.shape != (out,):
            return None
        if not group and rows.dtype == torch.int8 and rows.shape == (out, inputs):
            linear = Int8Linear.from_rows(rows, scales, bias)
        elif group > 0 and rows.dtype == torch.uint8 and rows.shape == (packed_numel(out, inputs, group),) \
                and inputs % 4 == 0:
            linear = Int8Linear.from_packed(rows, group, inputs, scales, bias)
        else:
            return None
        self._made.append(linear)
        self._read_groups.append(group)
        return linear

    def save(self) -> None:
        """Write the file if any linear was quantized now, or is held in another layout than the file's;
        a cache that cannot be written is skipped."""
        groups = [linear.row_group for linear in self._made]
        in_file = sum(1 for name in self._saved if name.startswith("w"))
        if groups == self._read_groups and in_file == len(self._made):
            return
        from safetensors.torch import save_file

        tensors = {}
        for i, linear in enumerate(self._made):
            tensors[f"w{i}"], tensors[f"s{i}"], _ = linear.native_layout()
            if linear.row_group:
                tensors[f"g{i}"] = torch.tensor([linear.row_group])
        metadata = {"weights": self.weights}
        write_atomically(self.path, lambda scratch: save_file(tensors, str(scratch), metadata=metadata))
        _remove_unnamed(self.path.parent)


def _remove_unnamed(folder: Path) -> None:
    """Remove the int8 files written before each said what it was made from (named by the weights' sizes
    and times then: none is read again, and a file rewritten left one behind, 7 GB for a 7 B model)."""
    from safetensors import safe_open

    for old in folder.glob("*.safetensors"):
        if not re.fullmatch(r"[0-9a-f]{20}\.safetensors", old.name):  # not one LeanLlama named
            continue
        try:
            with safe_open(str(old), framework="pt") as f:
                unnamed = "weights" not in (f.metadata() or {})
            if unnamed:
                old.unlink()
        except Exception:  # another process's, being replaced; a damaged one: left as it is
            continue


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines


def linear_factory(precision: str, device: torch.device):
    """The handler that turns a (weight, bias) pair into a callable linear for this precision."""
    if precision == "int8":
        if device.type != "cpu" or not int8_available():
            raise ValueError("precision int8 needs a CPU with FBGEMM (x86 with AVX2); use fp32, fp16 or bf16 here")
        return Int8Linear
    return DenseLinear
