"""User and model text as the Chatbot's Markdown (app/ui/markdown.py): markup outside code shown as text,
code as typed, a block of code left open closed before the reply's stats line."""
from __future__ import annotations

import pytest

from app.ui.markdown import as_text, closed, pieces
from app.ui.session import ChatSession
from app.ui.trace import ReplyTrace
from engine import Finished, RequestMetrics


@pytest.mark.parametrize("text, shown", [
    ("a < b & <b>c</b>", "a &lt; b &amp; &lt;b>c&lt;/b>"),
    ("use `a<b && c>d` here <i>", "use `a<b && c>d` here &lt;i>"),
    ("``x`<y`` <", "``x`<y`` &lt;"),  # a span of two backticks holds one
    ("one ` tick <b>", "one ` tick &lt;b>"),  # a backtick alone opens nothing
    ("`a\n\nb<` <", "`a\n\nb&lt;` &lt;"),  # no span across a blank line
    ("<p>\n```python\nif a < b: x = '&amp;'\n```\n<q>", "&lt;p>\n```python\nif a < b: x = '&amp;'\n```\n&lt;q>"),
    ("~~~~\nx<1\n~~~\ny<2\n~~~~~\n<", "~~~~\nx<1\n~~~\ny<2\n~~~~~\n&lt;"),  # closed by one as long, or longer
    ("  ```\nx<1\n  ```\n<", "  ```\nx<1\n  ```\n&lt;"),
    ("a ```not a fence``` <", "a ```not a fence``` &lt;"),  # mid-line: a span of three backticks
    ("    <indented>", "    &lt;indented>"),
    ("> a quote &copy; -> b", "> a quote &amp;copy; -> b"),  # `>` starts no markup: a quote stays one
])
def test_markup_outside_code_is_escaped_and_code_is_as_typed(text, shown):
    assert shown == as_text(text)


def test_a_block_of_code_left_open_is_closed_with_its_own_fence():
    text = "Here:\n\n````python\nif n < 2:\n    return"
    assert pieces(text)[1] == "````"
    assert closed(text) == text + "\n````"
    assert closed("done\n```\nx\n```") == "done\n```\nx\n```"


def test_a_reply_cut_short_in_code_shows_its_stats_line_after_the_block():
    session = ChatSession()
    session.accept("Write a prime test.")
    trace = ReplyTrace(turn=1)
    text = "Sure:\n\n```python\ndef is_prime(n):\n    return n >= 2 and"
    metrics = RequestMetrics(num_prompt_tokens=5, num_cached_tokens=0, num_generated_tokens=1, ttft_ms=10.0,
                             tpot_ms=None, e2e_ms=10.0, prefill_ms=5.0, decode_ms=0.0, prefill_tokens_per_s=None,
                             decode_tokens_per_s=None, throughput_tokens_per_s=None, kv_tokens=10, kv_bytes=100)
    trace.add(Finished("r", 2.0, "length", text, metrics))
    session.show_reply(trace)
    content = session.display[-1]["content"]
    assert content.startswith("Sure:\n\n```python\ndef is_prime(n):\n    return n >= 2 and\n```\n\n<span class=\"ps-stats\">")
