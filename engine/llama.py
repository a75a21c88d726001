"""A lean forward pass for Llama-family models (Llama, SmolLM, Mistral, Qwen2 with its QKV bias).

It reads the weights of a loaded transformers model once, fuses Q/K/V and gate/up into single matrices,
and writes keys and values into our own KVCache. One call runs T tokens at positions [pos, pos+T):
T = chunk length in prefill, T = 1 in decode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device)
                      for b, lin in zip(biases, linears)]).detach()


@dataclass(slots=True)
class _Layer:
    w_qkv: torch.Tensor  # [(H + 2*KV) * D, C]
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor  # [C, H * D]
    b_o: torch.Tensor | None
    w_gate_up: torch.Tensor  # [2 * I, C]
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # [C, I]
    b_down: torch.Tensor | None
    attn_norm: torch.Tensor  # [C]
    mlp_norm: torch.Tensor  # [C]


def _layer_from_hf(layer: torch.nn.Module) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(
        w_qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
        b_qkv=_cat_bias(attn.q_proj, attn.k_proj, attn.v_proj),
        w_o=attn.o_proj.weight.detach(),
        b_o=attn.o_proj.bias,
        w_gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
        b_gate_up=_cat_bias(mlp.gate_proj, mlp.up_proj),
        w_down=mlp.down_proj.weight.detach(),
        b_down=mlp.down_proj.bias,
        attn_norm=layer.input_layernorm.weight.detach(),
        mlp_norm=layer.post_attention_layernorm.weight.detach(),
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanLlama:
    """Llama-family forward over our KVCache. `forward` returns the last position's logits."""

    name = "lean-llama"

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        return getattr(model.config, "model_type", None) in SUPPORTED_MODEL_TYPES

    def __init__(self, model: torch.nn.Module, max_positions: int = 32768) -> None:
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.context_window = min(config.max_position_embeddings, max_positions)
        self.dtype = model.dtype
        self.device = model.device
        self.layers = [_layer_from_hf(layer) for layer in model.model.layers]
        self.embed = model.model.embed_tokens.weight.detach()
        self.final_norm = model.model.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.cos, self.sin = self._rope_tables(model, self.context_window)

    def _rope_tables(self, model: torch.nn.Module, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The model's own rotary module knows its rope type and scaling; tables are [positions, D].
        positions = torch.arange(num_positions, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(probe, positions)
        return cos[0], sin[0]

    def new_cache(self, capacity_tokens: int) -> KVCache:
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, capacity_tokens, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: int, cache: KVCache, need_logits: bool = True) -> torch.Tensor | None:
        """ids: [T] token ids at positions [pos, pos+T). Returns logits [vocab] of the last one."""
        num_tokens = ids.shape[0]
        x = F.embedding(ids, self.embed)  # [T, C]
        cos, sin = self.cos[pos:pos + num_tokens], self.sin[pos:pos + num_tokens]  # [T, D]
        mask = self._causal_mask(pos, num_tokens)
        for index, layer in enumerate(self.layers):
            x = x + self._attention(index, layer, F.rms_norm(x, x.shape[-1:], layer.attn_norm, self.eps),
                                    pos, cos, sin, cache, mask)
            x = x + self._mlp(layer, F.rms_norm(x, x.shape[-1:], layer.mlp_norm, self.eps))
        if not need_logits:
            return None
        last = F.rms_norm(x[-1], x.shape[-1:], self.final_norm, self.eps)
        return F.linear(last, self.lm_head)  # [vocab]

    def _causal_mask(self, pos: int, num_tokens: int) -> torch.Tensor | None:
        if num_tokens == 1:
            return None  # one query attends to every cached key
        # query i sits at position pos+i and may see keys 0..pos+i: [T, pos+T] boolean
        keys = torch.arange(pos + num_tokens, device=self.device)
        queries = torch.arange(pos, pos + num_tokens, device=self.device)
        return keys[None, :] <= queries[:, None]

    def _attention(self, index: int, layer: _Layer, h: torch.Tensor, pos: int, cos: torch.Tensor,
                   sin: torch.Tensor, cache: KVCache, mask: torch.Tensor | None) -> torch.Tensor:
        num_tokens = h.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(h, layer.w_qkv, layer.b_qkv)  # [T, (H + 2KV) * D]
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.view(num_tokens, heads, head_dim).transpose(0, 1)  # [H, T, D]
        k = k.view(num_tokens, kv_heads, head_dim).transpose(0, 1)  # [KV, T, D]
        v = v.view(num_tokens, kv_heads, head_dim).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = cache.update(index, pos, k, v)  # [KV, pos+T, D]
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                             enable_gqa=heads != kv_heads)  # [1, H, T, D]
        out = out[0].transpose(0, 1).reshape(num_tokens, heads * head_dim)
        return F.linear(out, layer.w_o, layer.b_o)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, layer.w_gate_up, layer.b_gate_up).chunk(2, dim=-1)  # [T, I] each
        return F.linear(F.silu(gate) * up, layer.w_down, layer.b_down)
