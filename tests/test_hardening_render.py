"""Rendering: user text and model output holding HTML, scripts, javascript: links, images with onerror,
SVG, deeply nested Markdown and long unbroken lines are shown as text and laid out sanely, in the chat,
the history, the Explain tab and the Lab; a page-side flag proves that nothing ran."""
from __future__ import annotations

import pytest

from app.bench.browser import open_history, send, set_setting, wait_phase
from tests.test_browser import app_db, app_url, browser, page

FIXTURES = (app_db, app_url, browser, page)  # the browser tests' app, Chromium and page, found by name

pytestmark = [pytest.mark.browser, pytest.mark.model]

PAYLOADS = [
    '<img src=x onerror="window.__pwned=1">',
    "<script>window.__pwned=2</script>",
    "[click me](javascript:window.__pwned=3)",
    '<svg onload="window.__pwned=4"><circle r=5 /></svg>',
    '<a href="javascript:window.__pwned=5">link</a>',
    '<iframe srcdoc="<script>parent.__pwned=6</script>"></iframe>',
    "> " * 300 + "deep",
    "x" * 4000,
    '`<img src=x onerror="window.__pwned=7">`',  # code: as typed, drawn as text by the Markdown renderer
    "\n```html\n<script>window.__pwned=8</script>\n```\n",
]
MESSAGE = "Repeat: " + " ".join(PAYLOADS)


def nothing_ran_and_nothing_overflows(page) -> None:
    assert page.evaluate("() => window.__pwned === undefined")
    assert page.locator("#ps-chatbot img[src=x], svg[onload], iframe[srcdoc]").count() == 0
    width = page.evaluate("() => window.innerWidth")
    assert page.evaluate("() => document.documentElement.scrollWidth") <= width + 2  # no sideways scrolling


def test_payloads_are_text_in_chat_history_explain_and_lab(page):
    set_setting(page, "ps-max-new", 24)
    set_setting(page, "ps-temperature", 0)
    send(page, MESSAGE)
    assert wait_phase(page, "done", "error") == "done"
    page.wait_for_timeout(500)
    user_text = page.locator("#ps-chatbot [data-testid=user]").last.inner_text()
    assert PAYLOADS[0] in user_text and "<script>" in user_text  # shown, as typed
    nothing_ran_and_nothing_overflows(page)

    open_history(page)  # the session's title is the message's first line, payloads and all
    assert "Repeat: <img src=x" in page.inner_text("#ps-history-table")
    nothing_ran_and_nothing_overflows(page)

    page.get_by_role("tab", name="Explain").click()
    # the tab drawn first: a prompt filled at once after the click was once not the one Start read
    page.wait_for_selector("#ps-explain-tokens:has-text('5 tokens')")
    page.fill("#ps-explain-prompt textarea", PAYLOADS[0] + PAYLOADS[3])
    page.click("#ps-explain-start")
    page.wait_for_selector("#ps-explain-steps [data-explain=held]", timeout=60_000)
    tokens = page.inner_text("#ps-explain-steps")
    assert "img" in tokens and "error" in tokens and "svg" in tokens  # the payload's tokens, shown as text
    nothing_ran_and_nothing_overflows(page)
    page.click("#ps-explain-stop")

    page.get_by_role("tab", name="Lab").click()
    page.locator("#ps-lab-experiment input").click()
    page.get_by_role("option", name="Prefix cache", exact=True).click()
    page.locator("#ps-lab-quick input").check()
    page.fill("#ps-lab-prompt textarea", MESSAGE)
    page.click("#ps-lab-run")
    page.wait_for_function("() => document.querySelector('#ps-lab-status').innerText.includes('lab run')",
                           timeout=120_000)
    nothing_ran_and_nothing_overflows(page)
