"""The fixed texts the bench and the Lab measure on (plain data: the app lists the Lab's prompts before torch
has loaded)."""
from __future__ import annotations

from pathlib import Path

LONG_TEXT = Path(__file__).with_name("data") / "long_text.txt"  # a fixed story of ~2,000 words, for quality

# a paragraph the bundled 135M model repeats faithfully when asked (in fp32 and int8)
PARAGRAPH = ("The quick brown fox jumps over the lazy dog. Prefill reads the whole prompt in one pass and fills the "
             "KV cache; decode then makes one token per forward pass, reading every weight once for each token. ")
SPECULATION_PROMPTS = {
    "repeat": "Repeat the following paragraph exactly, word for word:\n\n" + PARAGRAPH * 2,
    "no repeats": "Write a short story about a lighthouse keeper who finds a strange map in a bottle.",
}
