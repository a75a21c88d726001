"""User and model text as the Chatbot's Markdown: markup is shown as text, never run, and code as typed.

Outside code, `<` and `&` are escaped, so that "<b>" shows as "<b>" (the Chatbot's sanitizer would keep
it as markup, or drop a tag it does not allow, and the text would lose it) and "&copy;" as typed; `>` alone
starts no markup and is left as it is, so that a line starting with "> " stays a quote. Code (fenced blocks and
`spans`) is left as it is: the Markdown renderer shows code as text itself, and escaped there "a < b" would
show as "a &lt; b". static/markdown.js undoes the escaping by the same rules (unescapeOutsideCode) for the
edit box and for Copy message, and draws a streaming reply by them: keep the two in step.
"""
from __future__ import annotations

import re

# A fence opens a block of code: three or more backticks or tildes at the start of a line (indented at most
# three spaces), a language after it; the block ends at a line of the same character, at least as many,
# or at the end of the text (CommonMark; a backtick fence's language has no backtick)
_OPENING = re.compile(r"^ {0,3}(?:(`{3,})[^`\n]*|(~{3,})[^\n]*)$", re.M)
# A span of code: a run of backticks, then text (no blank line in it), then a run of as many
_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)


def _closing(fence: str) -> re.Pattern:
    return re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", re.M)


def pieces(text: str) -> tuple[list[tuple[str, bool]], str | None]:
    """text cut into (piece, is code) in order, and the fence of a block the text leaves open (a reply cut
    short inside one), else None."""
    out: list[tuple[str, bool]] = []
    at, open_fence = 0, None
    while opening := _OPENING.search(text, at):
        fence = opening.group(1) or opening.group(2)
        closing = _closing(fence).search(text, opening.end())
        end = closing.end() if closing else len(text)
        out += _spans(text[at:opening.start()])
        out.append((text[opening.start():end], True))
        at, open_fence = end, None if closing else fence
    out += _spans(text[at:])
    return [piece for piece in out if piece[0]], open_fence


def _spans(prose: str) -> list[tuple[str, bool]]:
    out, at = [], 0
    for span in _SPAN.finditer(prose):
        out += [(prose[at:span.start()], False), (span.group(0), True)]
        at = span.end()
    return out + [(prose[at:], False)]


def _escaped(prose: str) -> str:
    return prose.replace("&", "&amp;").replace("<", "&lt;")


def _shown(parts: list[tuple[str, bool]]) -> str:
    return "".join(piece if code else _escaped(piece) for piece, code in parts)


def as_text(text: str) -> str:
    """text for the Chatbot: escaped outside code, code as it is."""
    return _shown(pieces(text)[0])


def closed(text: str) -> str:
    """text for the Chatbot (as_text), with a block of code it leaves open closed: what the page adds after
    it (the reply's stats line) is then not drawn as code."""
    parts, fence = pieces(text)
    return _shown(parts) if fence is None else f"{_shown(parts)}\n{fence}"
