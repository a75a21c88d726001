"""Turning generated token ids into text pieces as they come.

A byte-level BPE token can end in the middle of a UTF-8 character (most CJK characters and emoji
take two or three tokens), so text is released only once it decodes without a replacement character.
Stop strings are matched on the text; any tail that could still begin a stop string is held back.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a window of recent ids and releases only the newly completed text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # ids up to here have been released as text
        # a transformers tokenizer over a Rust one, which it would only hand the ids to (no clean-up of the
        # text): the Rust one's decode, without the wrapper's 20 us a call (two calls a token)
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if getattr(tokenizer, "clean_up_tokenization_spaces", True) is False \
            and type(backend).__module__ == "tokenizers" else None

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix_offset:self._read_offset])
        after = self._decode(self.ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return after[len(before):]
        return ""


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of text that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class TextStream:
    """Token ids in, text pieces out, stopping at the first stop string (which is not shown)."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stops = stops
        self._pending = ""
        self.text = ""  # everything released so far
        self.is_stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text it releases (possibly empty)."""
        buffer = self._pending + self._detok.push(token_id)
        for stop in self._stops:
            found = buffer.find(stop)
            if found >= 0:
                self.is_stopped = True
                buffer, self._pending = buffer[:found], ""
                self.text += buffer
                return buffer
        keep = _held_back(buffer, self._stops)
        piece, self._pending = buffer[:len(buffer) - keep], buffer[len(buffer) - keep:]
        self.text += piece
        return piece

    def flush(self) -> str:
        """Release what was held back for a possible stop string, at the end of generation."""
        piece, self._pending = self._pending, ""
        self.text += piece
        return piece
