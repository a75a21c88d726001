"""A Llama-family model straight from its folder, for the lean forward: config.json and memory-mapped
safetensors, without building the transformers model.

The lean path only reads weights, and building transformers' model object (importing its modeling code,
initializing every module) took ~1.3 s of a ~4 s cold start. FolderModel holds the same tensors under
the same attribute names (model.layers[i].self_attn.q_proj.weight, ...), so LeanLlama builds the same
forward from either. Other architectures, RoPE scalings other than the default, and the bench's
transformers baseline load through loader.load_model.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch

from ..errors import ModelError, missing_weight
from .llama import SUPPORTED_MODEL_TYPES
from .model_defaults import generation_config



def _rope(config: dict) -> tuple[str, float]:
    """(rope type, theta), from transformers 5's rope_parameters or the older rope_theta/rope_scaling."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return rope_type, float(parameters.get("rope_theta") or config.get("rope_theta") or 10000.0)


SHARD_INDEX = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors weights: model.safetensors, or the shards its index names (a model of more
    than a few GB comes in several files); none where neither is there."""
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    try:
        shards = json.loads((folder / SHARD_INDEX).read_text())["weight_map"].values()
    except (OSError, ValueError, KeyError, AttributeError):
        return []
    return [folder / name for name in sorted(set(shards))]


def parameters(folder: Path) -> int:
    """How many numbers the folder's weights files hold, read from their headers."""
    from safetensors import safe_open

    total = 0
    for weights in weight_files(folder):
        with safe_open(str(weights), framework="pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def supports(folder: Path) -> bool:
    """A folder this loader reads: a Llama-family config with the default RoPE, and safetensors weights."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (config.get("model_type") in SUPPORTED_MODEL_TYPES and _rope(config)[0] == "default"
            and config.get("hidden_act", "silu") == "silu" and bool(weight_files(folder)))


class _Linear:
    """A linear's weight and bias, read from the model's file in its dtype each time they are taken."""

    def __init__(self, model: FolderModel, name: str) -> None:
        if f"{name}.weight" not in model._tensors:
            raise KeyError(f"{name}.weight")
        self._model, self._name = model, name

    @property
    def weight(self) -> torch.Tensor:
        return self._model._read(f"{self._name}.weight")

    @property
    def weight_shape(self) -> torch.Size:
        """[out, in], without converting the weight (int8 rows from their cache need no more)."""
        return self._model._tensors[f"{self._name}.weight"].shape

    @property
    def bias(self) -> torch.Tensor | None:
        has_bias = f"{self._name}.bias" in self._model._tensors
        return self._model._read(f"{self._name}.bias") if has_bias else None


class FolderModel:
    """The weights and config of a Llama-family model, named as transformers names them.

    It holds the file's tensors as they are, memory-mapped, and gives a linear's weight converted to the
    model's dtype where it is taken (LeanLlama fuses, quantizes or slices it, and keeps only that): a
    bf16 file run in fp32 or int8 is not held a second time, converted, beside what the forward keeps,
    and int8 rows read from their cache never make the float weights at all. The embedding (which a tied
    head shares) and the norms are converted once."""

    def __init__(self, config: SimpleNamespace, tensors: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, cache_key: str | None = None, cache_name: str | None = None) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.cache_key = cache_key  # these weights (the files, their sizes and times): what a cache derives from
        # where such a cache is kept: one per folder and dtype, so that rows made again (the weights' files
        # rewritten) take the place of the old ones instead of adding gigabytes beside them
        self.cache_name = cache_name
        # where generation ends, as transformers reads it: generation_config.json's eos_token_id (often a
        # list: an instruct model's end of turn and end of text), else config.json's
        self.generation_config = SimpleNamespace(eos_token_id=config.generation_eos_token_id)
        self._tensors = tensors

        def norm(name: str) -> SimpleNamespace:
            return SimpleNamespace(weight=self._read(f"{name}.weight"))

        layers = [SimpleNamespace(
            self_attn=SimpleNamespace(**{p: _Linear(self, f"model.layers.{i}.self_attn.{p}")
                                         for p in ("q_proj", "k_proj", "v_proj", "o_proj")}),
            mlp=SimpleNamespace(**{p: _Linear(self, f"model.layers.{i}.mlp.{p}")
                                   for p in ("gate_proj", "up_proj", "down_proj")}),
            input_layernorm=norm(f"model.layers.{i}.input_layernorm"),
            post_attention_layernorm=norm(f"model.layers.{i}.post_attention_layernorm"),
        ) for i in range(config.num_hidden_layers)]
        # tied embedding and head: safetensors keeps one tensor, under either name
        embed = self._read("model.embed_tokens.weight" if "model.embed_tokens.weight" in tensors else "lm_head.weight")
        self.model = SimpleNamespace(layers=layers, embed_tokens=SimpleNamespace(weight=embed),
                                     norm=norm("model.norm"), rotary_emb=self.rotary)
        self.lm_head = _Linear(self, "lm_head") if "lm_head.weight" in tensors else SimpleNamespace(weight=embed)

    def _read(self, name: str) -> torch.Tensor:
        """A tensor in the model's dtype and on its device: the file's own where they match (no copy)."""
        return self._tensors[name].to(device=self.device, dtype=self.dtype)

    def rotary(self, probe: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' default RoPE: (cos, sin) of positions [1, P], each [1, P, head_dim]."""
        dim = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        freqs = positions[0].float()[:, None] * inv_freq.to(positions.device)[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos()[None].to(probe.dtype), angles.sin()[None].to(probe.dtype)

    def to(self, dtype: torch.dtype) -> FolderModel:
        """The same weights in another dtype (half-precision modes), converted from the file's where taken."""
        return FolderModel(self.config, self._tensors, self.device, dtype, f"{self.cache_key}|{dtype}",
                           f"{self.cache_name}|{dtype}")


def _config(raw: dict) -> SimpleNamespace:
    """config.json's sizes, under transformers' names (a KeyError for one it lacks)."""
    heads = raw["num_attention_heads"]
    return SimpleNamespace(
        model_type=raw["model_type"], num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads, hidden_size=raw["hidden_size"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, rms_norm_eps=raw["rms_norm_eps"],
        max_position_embeddings=raw["max_position_embeddings"], vocab_size=raw["vocab_size"],
        intermediate_size=raw["intermediate_size"],
        rope_theta=_rope(raw)[1], eos_token_id=raw.get("eos_token_id"),
        sliding_window=raw.get("sliding_window"), use_sliding_window=raw.get("use_sliding_window", False),
        hidden_act=raw.get("hidden_act", "silu"))


def load_folder_model(folder: Path, device: torch.device, dtype: torch.dtype) -> FolderModel:
    from safetensors import safe_open

    raw = json.loads((folder / "config.json").read_text())
    try:
        config = _config(raw)
    except KeyError as exc:
        raise ModelError(f"{folder / 'config.json'} lacks {exc.args[0]}, which a {raw['model_type']} model "
                         "needs") from exc
    config.generation_eos_token_id = generation_config(folder).get("eos_token_id") or config.eos_token_id
    tensors, where, key = {}, "", ""
    for weights in weight_files(folder):
        if not weights.exists():
            raise ModelError(f"{folder} lacks {weights.name}, one of the weights' files {SHARD_INDEX} names")
        with safe_open(str(weights), framework="pt", device="cpu") as f:  # memory-mapped, as the file holds them
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
        stat = weights.stat()  # a file rewritten in place gets a new size or time, so a new key
        where += f"{weights.resolve()}|"
        key += f"{weights.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|"
    try:
        return FolderModel(config, tensors, device, dtype, key + str(dtype), where + str(dtype))
    except KeyError as exc:  # a tensor it names
        raise missing_weight(folder, exc.args[0]) from exc
