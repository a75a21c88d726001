"""Speculative decoding: prompt lookup, or a draft model.

Decode reads every weight to make one token; verifying several guessed tokens in one forward reads
them once for all of the guesses. Prompt-lookup decoding guesses by matching the sequence's last few
tokens against earlier text (the prompt and the reply so far): where the reply quotes, repeats or
edits the prompt, the tokens that followed the earlier occurrence are likely to follow again. A draft
model (DraftModel) guesses by running a smaller model with the same tokenizer.

The engine verifies a draft d_1..d_K by running the last token and the draft as K+1 rows of one
batched decode step (each row at its own position of the same sequence, so row i sees the keys of the
rows before it: exactly what K+1 plain steps would compute, bit for bit). It then samples row by row as
plain decoding would, keeping a draft token while it equals the sampled one. With greedy decoding the
output is plain greedy decoding's, token for token. With sampling, "sample from the model, keep the
draft token if they agree" is the standard rejection rule for a draft that proposes one token with
certainty (accept with p(d) / 1, else resample from p without d), so the output distribution is
unchanged, and with a seed the tokens are plain sampling's too: the same draws in the same order.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_NGRAM, MIN_NGRAM = 3, 2  # the n-grams matched, longest first; a single token matches too often


def prompt_lookup(tokens: Sequence[int], max_draft: int, max_ngram: int = MAX_NGRAM,
                  min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to max_draft tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram), else of the max_ngram tokens before the last one (which then
    replaced a token of the earlier text); [] when nothing matches."""
    tokens = list(tokens)
    size = len(tokens)
    if max_draft < 1 or size <= min_ngram:
        return []
    # an earlier n-gram equal to the last n tokens ends where the last token occurs earlier: only those
    # places are compared (list.index finds them at C speed; this runs every step of every request)
    ends = _occurrences(tokens, tokens[-1], size - 1)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        end = _latest_end(tokens, ends, tokens[-n:])
        if end is not None:
            return tokens[end + 1:end + 1 + max_draft]
    # The last token may have replaced one of the earlier text's, as a paraphrase does ("the entire" where
    # the prompt had "the whole"): when the max_ngram tokens before it match, what followed the replaced
    # token is likely to follow again. (A shorter context than max_ngram matches too often to be worth a
    # draft.)
    n = max_ngram
    if size > n + 2:
        end = _latest_end(tokens, _occurrences(tokens, tokens[-2], size - 2), tokens[-n - 1:-1])
        if end is not None:
            return tokens[end + 2:end + 2 + max_draft]  # past the replaced token
    return []


def _occurrences(tokens: list[int], value: int, stop: int) -> list[int]:
    """Where value occurs in tokens[:stop], in order."""
    found, at = [], -1
    while True:
        try:
            at = tokens.index(value, at + 1, stop)
        except ValueError:
            return found
        found.append(at)


def _latest_end(tokens: list[int], ends: list[int], gram: list[int]) -> int | None:
    """The latest of ends (where gram's last token occurs) at which gram occurs whole: the closest
    context; None if it occurs at none."""
    n = len(gram)
    return next((end for end in reversed(ends) if end >= n - 1 and tokens[end - n + 1:end + 1] == gram), None)


MAX_PAUSE = 16  # decode steps without drafting, at most, after drafts that were rejected whole


@dataclass
class DraftLength:
    """How many tokens to draft next. 2 more after a draft accepted whole (as Hugging Face's assisted
    generation does); after a rejection, one more than were accepted. Every rejected row of the forward
    cost time for nothing, so a draft rejected whole also pauses drafting for 1, 2, 4… steps (at most
    MAX_PAUSE) until a draft is accepted again: text that never repeats is decoded almost plainly."""

    most: int
    current: int = 0
    misses: int = 0  # drafts rejected whole in a row
    pause: int = 0  # steps left without drafting

    def __post_init__(self) -> None:
        self.current = self.current or self.most

    def next(self) -> int:
        """The length of the next draft; 0 while drafting pauses."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.current

    def update(self, drafted: int, accepted: int) -> None:
        self.current = min(self.most, self.current + 2) if accepted == drafted else accepted + 1
        self.misses = self.misses + 1 if accepted == 0 else 0
        self.pause = min(MAX_PAUSE, 2 ** self.misses // 2) if self.misses else 0


class DraftModel:
    """Speculative decoding with a draft model: a smaller model with the same tokenizer proposes the next
    tokens greedily, one cheap decode step each, from its own KV cache of the sequence. Greedy drafts are
    certain, so the engine's verification rule (sample, keep the draft token if it agrees) stays exact.

    Each request's draft cache follows the sequence: before drafting, it is cut back to where it still
    agrees with the tokens the target kept, and whatever it lacks is prefilled."""

    def __init__(self, runner, budget_bytes: int) -> None:
        self.runner = runner
        self.pool = runner.new_pool(budget_bytes, prefix_caching=False)
        self._caches: dict[str, tuple[object, list[int]]] = {}  # request id -> (its cache, the tokens in it)

    def propose(self, request, count: int) -> list[int]:
        tokens = request.prompt_ids + request.generated_ids
        cache, cached = self._caches.get(request.request_id, (None, []))
        if cache is None:
            cache = self.pool.allocate([], request.num_kv_tokens + count + 1)
            if cache is None:  # the draft pool is full: this step goes without a draft
                return []
        keep = 0
        for have, want in zip(cached, tokens[:-1]):  # where the draft's cache still agrees with the sequence
            if have != want:
                break
            keep += 1
        cache.truncate(keep)
        if keep < len(tokens) - 1:  # what the draft model has not seen: one prefill
            self.runner.forward(torch.tensor(tokens[keep:-1], device=self.runner.device), keep, cache,
                                need_logits=False)
        drafted, last = [], tokens[-1]
        for position in range(len(tokens) - 1, len(tokens) - 1 + count):
            last = int(self.runner.decode([last], [position], [cache])[0].argmax())
            drafted.append(last)
        self._caches[request.request_id] = (cache, tokens + drafted[:-1])
        return drafted

    def release(self, request) -> None:
        cache, _ = self._caches.pop(request.request_id, (None, None))
        if cache is not None:
            self.pool.free(cache)
