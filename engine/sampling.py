"""Choosing the next token from the logits: greedy, or temperature / top-k / top-p sampling,
with a repetition penalty, in the order transformers applies them."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .config import SamplingParams


@dataclass(frozen=True, slots=True)
class Sample:
    token_id: int
    prob: float  # the model's probability of the token (softmax of the raw logits)
    top_ids: list[int]
    top_probs: list[float]
    top_sample_probs: list[float]  # the same tokens under the rule that picked (greedy: 1 or 0)


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: Sequence[int], penalty: float) -> torch.Tensor:
    """CTRL-style: divide positive logits of seen tokens by the penalty, multiply negative ones."""
    if penalty == 1.0 or not seen_ids:
        return logits
    ids = torch.tensor(sorted(set(seen_ids)), dtype=torch.long)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - top_p
        remove[-1] = False  # always keep the most likely token
        logits = logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return logits


def top_logits(logits: torch.Tensor, k: int) -> tuple[list[int], list[float], float]:
    """The k largest logits (ids, values; largest first) and logsumexp(logits): together they give
    the top tokens' probabilities, exp(value - lse). (A runner may bring a faster one.)"""
    top = torch.topk(logits, min(k, logits.shape[-1]))
    return top.indices.tolist(), top.values.tolist(), float(torch.logsumexp(logits, -1))


def top_logits_batch(logits: torch.Tensor, k: int) -> list[tuple[list[int], list[float], float]]:
    """top_logits of each row of logits [B, vocab]: row by row on the CPU; on a GPU every row at once,
    with three small copies to the host instead of three per row."""
    if logits.device.type == "cpu":
        return [top_logits(row, k) for row in logits]
    logits = logits.float()
    top = torch.topk(logits, min(k, logits.shape[-1]))
    return list(zip(top.indices.tolist(), top.values.tolist(), torch.logsumexp(logits, -1).tolist()))


TopLogits = Callable[[torch.Tensor, int], tuple[list[int], list[float], float]]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           seen_ids: Sequence[int] = (), num_top: int = 5, top_fn: TopLogits = top_logits) -> Sample:
    """logits: [vocab] for one position; seen_ids: prompt and generated ids, for the penalty."""
    logits = logits.float()
    top_ids, top_values, lse = top_fn(logits, num_top)
    top_probs = [math.exp(v - lse) for v in top_values]
    if params.is_greedy and (params.repetition_penalty == 1.0 or not seen_ids):
        # the most likely token, read from the top alone: logits on a GPU are not copied over, row by row
        return Sample(top_ids[0], top_probs[0], top_ids, top_probs, [1.0 if i == top_ids[0] else 0.0 for i in top_ids])
    logits = logits.cpu()
    scores = apply_repetition_penalty(logits, seen_ids, params.repetition_penalty)
    if params.is_greedy:  # penalized (unpenalized greedy returned above)
        token_id = int(scores.argmax())
        sample_probs = [1.0 if i == token_id else 0.0 for i in top_ids]
    else:
        # float64: a tiny temperature (or penalty) would overflow float32 to inf, and softmax to NaN
        scaled = _filter_top_k_top_p(scores.double() / params.temperature, params.top_k, params.top_p)
        distribution = scaled.nan_to_num(nan=float("-inf")).softmax(-1)
        if torch.isfinite(distribution).all() and distribution.sum() > 0:
            token_id = int(torch.multinomial(distribution, 1, generator=generator))
        else:  # nothing left to sample from (every score overflowed): the most likely token, as greedy would
            token_id = int(scores.argmax())
            distribution = torch.zeros_like(distribution)
            distribution[token_id] = 1.0
        sample_probs = distribution[top_ids].tolist()
    logit = top_values[top_ids.index(token_id)] if token_id in top_ids else float(logits[token_id])
    return Sample(token_id, math.exp(logit - lse), top_ids, top_probs, sample_probs)
