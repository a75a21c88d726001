"""Weight-only int8 quantization for the lean path: per-output-channel scales, activations
quantized on the fly (FBGEMM's dynamic linear, fast on AVX2 CPUs).

A handler makes the quantized weights once, at load, and is then called like F.linear.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


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


class Int8Linear:
    """int8 weights with one fp32 scale per output channel; x stays fp32 and is quantized per call.

    The same int8 weights are also kept as plain rows ([out, in]) for the native decode step, which
    quantizes activations per block of 64 instead of per tensor; FBGEMM's packed copy serves prefill."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        weight = weight.detach().float().cpu()
        scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensor constructors are deprecated, not yet replaced
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
        bias = None if bias is None else bias.detach().float().cpu().contiguous()
        self._packed = torch.ops.quantized.linear_prepack(quantized, bias)
        self._nbytes = weight.numel() + scales.numel() * 4 + (0 if bias is None else bias.numel() * 4)
        self.output_features, self.input_features = weight.shape
        self._native_layout = (quantized.int_repr().contiguous(), scales.float().contiguous(), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed)

    def native_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(int8 W [out, in], fp32 scales [out], bias) for the native decode step."""
        return self._native_layout

    @property
    def nbytes(self) -> int:
        return self._nbytes


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines


def linear_factory(precision: str, device: torch.device):
    """The handler that turns a (weight, bias) pair into a callable linear for this precision."""
    if precision == "int8":
        if device.type != "cpu" or not int8_available():
            raise ValueError("precision int8 needs a CPU with FBGEMM (x86 with AVX2); use fp32, fp16 or bf16 here")
        return Int8Linear
    return DenseLinear
