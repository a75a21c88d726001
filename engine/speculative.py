"""Speculative decoding without a draft model: prompt lookup.

Decode reads every weight to make one token; verifying several guessed tokens in one forward reads
them once for all of the guesses. Prompt-lookup decoding guesses by matching the sequence's last few
tokens against earlier text (the prompt and the reply so far): where the reply quotes, repeats or
edits the prompt, the tokens that followed the earlier occurrence are likely to follow again.

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

import numpy as np

PROMPT_LOOKUP = "prompt-lookup"
METHODS = (PROMPT_LOOKUP,)
MAX_NGRAM, MIN_NGRAM = 3, 2  # the n-grams matched, longest first; a single token matches too often


def prompt_lookup(tokens: Sequence[int], max_draft: int, max_ngram: int = MAX_NGRAM,
                  min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to max_draft tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from max_ngram down to min_ngram); [] when nothing matches."""
    if max_draft < 1 or len(tokens) <= min_ngram:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every earlier n-gram but the last
        starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if starts.size:
            follow = starts[-1] + n  # the most recent occurrence: the closest context
            return ids[follow:follow + max_draft].tolist()
    return []


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


@dataclass(frozen=True, slots=True)
class Speculation:
    """What speculative decoding did for one request."""

    drafted: int  # draft tokens proposed
    accepted: int  # of those, kept
    forwards: int  # decode forwards the request took (with a draft or without)
    tokens: int  # tokens those forwards produced

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_forward(self) -> float | None:
        return self.tokens / self.forwards if self.forwards else None
