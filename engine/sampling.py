"""Choosing the next token from the logits: greedy, or temperature / top-k / top-p sampling, after a
repetition penalty and OpenAI's frequency and presence penalties (in the order vLLM applies them), then
OpenAI's logit bias."""
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


class SeenTokens:
    """The distinct token ids of a prompt and its reply so far, as the tensor the repetition penalty
    indexes with, kept up to date as the reply grows: a token seen before costs a set lookup. (Built
    afresh at every step from the prompt and reply, it cost ~0.1 ms per 1,000 tokens of the chat.)"""

    def __init__(self, prompt_ids: Sequence[int]):
        self._known: set[int] = set()
        self._ids = torch.empty(0, dtype=torch.long)
        self._folded = 0  # the reply's tokens already in _ids
        self._add(prompt_ids)

    def _add(self, token_ids: Sequence[int]) -> None:
        new = [i for i in dict.fromkeys(token_ids) if i not in self._known]
        if new:
            self._known.update(new)
            self._ids = torch.cat([self._ids, torch.tensor(new, dtype=torch.long)])

    def ids(self, generated_ids: Sequence[int]) -> torch.Tensor:
        """The prompt's and generated_ids' distinct ids: generated_ids is the reply so far, which only grows."""
        self._add(generated_ids[self._folded:])
        self._folded = len(generated_ids)
        return self._ids


def apply_repetition_penalty(logits: torch.Tensor, seen_ids: Sequence[int] | torch.Tensor,
                             penalty: float) -> torch.Tensor:
    """CTRL-style: divide positive logits of seen tokens by the penalty, multiply negative ones. seen_ids:
    token ids (repeats allowed), or a tensor of distinct ids (SeenTokens)."""
    if penalty == 1.0 or len(seen_ids) == 0:
        return logits
    ids = seen_ids if isinstance(seen_ids, torch.Tensor) else torch.tensor(sorted(set(seen_ids)), dtype=torch.long)
    picked = logits.index_select(0, ids)
    return logits.clone().index_copy_(0, ids, torch.where(picked > 0, picked / penalty, picked * penalty))


def apply_reply_penalties(logits: torch.Tensor, generated_ids: Sequence[int], frequency: float,
                          presence: float) -> torch.Tensor:
    """OpenAI's: each token generated so far loses frequency × its count plus presence from its logit."""
    if not generated_ids or (frequency == 0.0 and presence == 0.0):
        return logits
    ids, counts = torch.tensor(generated_ids, dtype=torch.long).unique(return_counts=True)
    logits = logits.clone()
    logits[ids] -= frequency * counts.to(logits.dtype) + presence
    return logits


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """OpenAI's logit_bias: added to the named tokens' logits (-100 bans a token, 100 all but forces it)."""
    if not bias:
        return logits
    logits = logits.clone()
    for token_id, value in bias:
        logits[token_id] += value
    return logits


TopLogits = Callable[[torch.Tensor, int], tuple[list[int], list[float], float]]
TopTempered = Callable[[torch.Tensor, int, float], tuple[list[int], list[float], float]]
NucleusFn = Callable[[torch.Tensor, float, float], tuple[list[int], list[float]] | None]  # scores, scale, top_p
PenaltyFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # logits, SeenTokens' ids, penalty


NUCLEUS_FIRST = 64  # top-p looks for its tokens among this many of the most likely first (_nucleus), then more


def _kept(probs: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The tokens top-k and then top-p keep (ids, probabilities; most likely first), or None for all of
    them (or for NaN probabilities, which _draw refuses). Top-p keeps a token while the tokens above it
    hold less than top_p of what top-k kept (the fewest most likely tokens that reach top_p, as
    transformers' ascending rule does). Without sorting the whole vocabulary: the nucleus is looked for
    among the most likely tokens, more only when they hold less than top_p."""
    vocab = probs.shape[0]
    if 0 < top_k < vocab:
        values, ids = probs.topk(top_k)
        limit = top_p * float(values.sum())
    elif top_p < 1.0:
        limit, n = top_p * float(probs.sum()), NUCLEUS_FIRST
        if not math.isfinite(limit):  # NaN probabilities: nothing to draw from (see sample)
            return None
        while True:
            values, ids = probs.topk(min(n, vocab))
            if n >= vocab or float(values.sum()) >= limit:  # a token past these has >= limit above it: dropped
                break
            n *= 16
    else:
        return None
    if top_p < 1.0:
        above = torch.cat([values.new_zeros(1), values.cumsum(0)[:-1]])  # what the tokens above each hold
        kept = max(1, int((above < limit).sum()))  # a prefix: `above` only grows; the most likely always stays
        values, ids = values[:kept], ids[:kept]
    return ids, values


def _ranked(scores: torch.Tensor, temperature: float, k: int, rank_fn: TopTempered
            ) -> tuple[list[int], list[float], float, float] | None:
    """The k most likely tokens under the temperature (ids, probabilities; most likely first), the largest
    score and the log-normalizer of the scores shifted below it and scaled, from one ranking pass (rank_fn:
    top_tempered, natively where the runner brings it): token i's probability is exp((score_i - largest) /
    temperature - lse), every exponent <= 0, so that no temperature overflows. None where float32 cannot:
    NaN scores, or a temperature too small to divide by."""
    inverse = 1.0 / temperature
    if not inverse < 1e38:
        return None
    ids, values, lse = rank_fn(scores, k, inverse)
    most = values[0]
    if not (math.isfinite(most) and math.isfinite(lse)):  # NaN scores (their sum is NaN), or every one -inf
        return None
    probs = [math.exp((value - most) * inverse - lse) for value in values]
    return (ids, probs, most, lse) if probs[0] > 0 else None


def _nucleus(scores: torch.Tensor, params: SamplingParams, rank_fn: TopTempered, nucleus_fn: NucleusFn | None = None
             ) -> tuple[list[int], list[float]] | None:
    """What _kept finds, from the NUCLEUS_FIRST most likely tokens alone (_ranked): the tokens top-k and
    then top-p keep and their probabilities under the temperature (most likely first), as Python lists,
    where a float64 softmax over the vocabulary, a topk and tensors around a handful of tokens took 0.3-0.5
    ms of a 5-ms step. Where those tokens hold less than top_p (a flat distribution), nucleus_fn looks over
    the whole vocabulary (a runner's native one; _kept took 0.9 ms there). None where it cannot say: top-k
    asks for more, _ranked or nucleus_fn cannot, or there is no nucleus_fn: _kept then looks further."""
    top_k = params.top_k if 0 < params.top_k < scores.shape[0] else 0
    if not top_k and params.top_p >= 1.0:  # nothing to cut
        return None
    ranked = _ranked(scores, params.temperature, top_k or NUCLEUS_FIRST, rank_fn) if top_k <= NUCLEUS_FIRST else None
    if ranked is None:
        return None
    ids, probs, _, _ = ranked
    if params.top_p >= 1.0:  # top-k alone, less what it cannot draw (a native ranking's -1 ids have none)
        kept = sum(1 for p in probs if p > 0)
        return ids[:kept], probs[:kept]
    limit = params.top_p * (sum(probs) if top_k else 1.0)  # top-p within what top-k kept
    if not top_k and sum(probs) < limit:
        return nucleus_fn(scores, 1.0 / params.temperature, params.top_p) if nucleus_fn else None
    kept, above = 0, 0.0
    while kept < len(probs) and (kept == 0 or above < limit):  # a prefix: the most likely always stays
        above += probs[kept]
        kept += 1
    return ids[:kept], probs[:kept]


def _tempered(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator, rank_fn: TopTempered
              ) -> tuple[int, Callable[[int], float]] | None:
    """A draw from the whole softmax(scores / temperature), mostly without computing it: one uniform
    number against the NUCLEUS_FIRST most likely (_ranked) in turn, and only past their share (1.5 % of
    the bundled model's draws at temperature 0.7, 10 % at 1.0) the rest's probabilities, drawn from with a
    second number: each token keeps its chance. Returns the token and each token's probability, or None
    where _ranked cannot."""
    ranked = _ranked(scores, params.temperature, NUCLEUS_FIRST, rank_fn)
    if ranked is None:
        return None
    ids, probs, most, lse = ranked
    found, inverse = dict(zip(ids, probs)), 1.0 / params.temperature

    def chance(token_id: int) -> float:
        return found[token_id] if token_id in found else math.exp((float(scores[token_id]) - most) * inverse - lse)

    index = _first_past(probs, float(torch.rand((), generator=generator, dtype=torch.float64)))
    if index is not None:
        return ids[index], chance
    rest = ((scores.double() - most) * inverse - lse).exp()
    rest[[i for i in ids if i >= 0]] = 0.0
    drawn = _draw(rest, generator)
    return (drawn[0] if drawn is not None else ids[0]), chance


def _draw(weights: torch.Tensor, generator: torch.Generator) -> tuple[int, float] | None:
    """An index drawn with probability proportional to weights (>= 0), and their sum; None where there
    is nothing to draw from (a sum of 0, or NaN where any weight is). One uniform number against the
    cumulative sum. (torch.multinomial draws an exponential number per entry: 1.3 ms for a 49,152-token
    vocabulary, against a 5-ms int8 decode step.) A zero weight is never drawn: its cumulative sum equals
    the previous one, which searchsorted(right=True) passes."""
    cumulative = weights.cumsum(0)
    total = float(cumulative[-1])
    if not (math.isfinite(total) and total > 0):
        return None
    u = torch.rand((), generator=generator, dtype=cumulative.dtype)
    index = min(int(torch.searchsorted(cumulative, u * total, right=True)), len(weights) - 1)
    if weights[index] <= 0:  # u * total rounded up to the total: the last token with a chance
        index = int(weights.nonzero().max())
    return index, total


def _first_past(weights: list[float], point: float) -> int | None:
    """The first index where the weights' running sum passes point; None where their sum does not."""
    cumulative = 0.0
    for index, weight in enumerate(weights):
        cumulative += weight
        if cumulative > point:
            return index
    return None


def _draw_listed(weights: list[float], generator: torch.Generator) -> tuple[int, float]:
    """_draw over a few weights (> 0 first) as a Python list: the same rule, without tensors."""
    total = sum(weights)
    index = _first_past(weights, float(torch.rand((), generator=generator, dtype=torch.float64)) * total)
    if index is None:  # point rounded up to the total
        index = max(i for i, weight in enumerate(weights) if weight > 0)
    return index, total


def top_logits(logits: torch.Tensor, k: int) -> tuple[list[int], list[float], float]:
    """The k largest logits (ids, values; largest first) and logsumexp(logits): together they give
    the top tokens' probabilities, exp(value - lse). (A runner may bring a faster one.)"""
    top = torch.topk(logits, min(k, logits.shape[-1]))
    return top.indices.tolist(), top.values.tolist(), float(torch.logsumexp(logits, -1))


def top_tempered(scores: torch.Tensor, k: int, scale: float) -> tuple[list[int], list[float], float]:
    """The k largest scores (ids, values as they are; largest first), the most likely tokens under any
    temperature, and log(sum(exp((scores - top) * scale))) with top the largest: under temperature 1 /
    scale, token i's probability is exp((score_i - top) * scale - that). (A runner may bring a faster one,
    which makes no scaled copy of the scores.)"""
    top = torch.topk(scores, min(k, scores.shape[-1]))
    ids, values = top.indices.tolist(), top.values.tolist()
    return ids, values, float(torch.logsumexp((scores - values[0]) * scale, -1))


def top_logits_batch(logits: torch.Tensor, k: int) -> list[tuple[list[int], list[float], float]]:
    """top_logits of each row of logits [B, vocab]: row by row on the CPU; on a GPU every row at once,
    with three small copies to the host instead of three per row."""
    if logits.device.type == "cpu":
        return [top_logits(row, k) for row in logits]
    logits = logits.float()
    top = torch.topk(logits, min(k, logits.shape[-1]))
    return list(zip(top.indices.tolist(), top.values.tolist(), torch.logsumexp(logits, -1).tolist()))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           seen_ids: Sequence[int] | torch.Tensor = (), num_top: int = 5, top_fn: TopLogits = top_logits,
           generated_ids: Sequence[int] = (), rank_fn: TopTempered = top_tempered,
           nucleus_fn: NucleusFn | None = None, penalty_fn: PenaltyFn | None = None) -> Sample:
    """logits: [vocab] for one position; seen_ids: prompt and generated ids (or SeenTokens' tensor of them),
    for the repetition penalty; generated_ids: the reply's, for the frequency and presence penalties.
    top_fn: the logits' num_top most likely tokens (the batch's, when already found); rank_fn:
    top_tempered of any scores (a runner's native one), for the temperature, top-k and top-p; nucleus_fn:
    a runner's top-p over the whole vocabulary, for flat distributions (_nucleus); penalty_fn: a runner's
    apply_repetition_penalty for a tensor of distinct ids (SeenTokens'), its result held until its next call."""
    logits = logits.float()
    top_ids, top_values, lse = top_fn(logits, num_top)
    top_probs = [math.exp(v - lse) for v in top_values]
    adjusted = ((params.repetition_penalty != 1.0 and len(seen_ids)) or (params.penalizes_reply and generated_ids)
                or params.logit_bias)
    if params.is_greedy and not adjusted:
        # the most likely token, read from the top alone: logits on a GPU are not copied over, row by row
        return Sample(top_ids[0], top_probs[0], top_ids, top_probs, [1.0 if i == top_ids[0] else 0.0 for i in top_ids])
    logits = logits.cpu()
    penalize = penalty_fn if penalty_fn is not None and isinstance(seen_ids, torch.Tensor) else apply_repetition_penalty
    scores = penalize(logits, seen_ids, params.repetition_penalty)
    scores = apply_reply_penalties(scores, generated_ids, params.frequency_penalty, params.presence_penalty)
    scores = apply_logit_bias(scores, params.logit_bias)
    cuts = params.top_p < 1.0 or 0 < params.top_k < scores.shape[0]  # top-k or top-p leave tokens out
    if params.is_greedy:  # adjusted (plain greedy returned above)
        token_id = int(scores.argmax())
        sample_probs = [1.0 if i == token_id else 0.0 for i in top_ids]
    elif cuts and (cut := _nucleus(scores, params, rank_fn, nucleus_fn)) is not None:
        ids, weights = cut
        index, total = _draw_listed(weights, generator)
        token_id = ids[index]
        chances = dict(zip(ids, weights))
        sample_probs = [chances.get(i, 0.0) / total for i in top_ids]
    elif not cuts and (drawn := _tempered(scores, params, generator, rank_fn)) is not None:
        token_id, chance = drawn
        sample_probs = [chance(i) for i in top_ids]
    else:
        # float64: a tiny temperature (or penalty) would overflow float32 to inf, and softmax to NaN
        probs = (scores.double() / params.temperature).nan_to_num(nan=float("-inf")).softmax(-1)
        kept = _kept(probs, params.top_k, params.top_p)
        ids, weights = kept if kept is not None else (None, probs)
        drawn = _draw(weights, generator)
        if drawn is not None:
            index, total = drawn
            token_id = index if ids is None else int(ids[index])
            kept_ids = None if ids is None else set(ids.tolist())  # the rule's cut: usually a few dozen
            chances = (probs[torch.tensor(top_ids)] / total).tolist()  # each top token's chance under the rule
            sample_probs = [p if kept_ids is None or i in kept_ids else 0.0 for i, p in zip(top_ids, chances)]
        else:  # nothing left to sample from (every score overflowed): the most likely token, as greedy would
            token_id = int(scores.argmax())
            sample_probs = [1.0 if i == token_id else 0.0 for i in top_ids]
    logit = top_values[top_ids.index(token_id)] if token_id in top_ids else float(logits[token_id])
    return Sample(token_id, math.exp(logit - lse), top_ids, top_probs, sample_probs)
