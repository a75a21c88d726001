"""The app in a real browser: Debian's Chromium driven by Playwright against `phasescope ui`."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from app.bench.browser import (CHROMIUM, ROOT, kpi, kpi_note, launch_browser, open_chat, plot_traces, send,
                               set_setting, start_app, wait_phase)
from engine import CHAT_REPETITION_PENALTY

pytestmark = [pytest.mark.browser, pytest.mark.model]

if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def app_db(tmp_path_factory):
    return tmp_path_factory.mktemp("db") / "history.db"


@pytest.fixture(scope="module")
def app_url(app_db):
    process, url = start_app("--db", str(app_db))
    yield url
    process.terminate()
    process.wait(timeout=30)
    said = "".join(process.output)
    # every test's page ran against this app: none of its handlers may have raised or been wired wrong
    assert "Traceback" not in said and "Warning" not in said, said[-3000:]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch_browser(playwright)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, app_url):
    page = open_chat(browser, app_url)
    yield page
    page.close()


def test_chat_reply_with_live_panel(page, tmp_path):
    assert "Send a message and watch the two phases" in page.inner_text("#ps-chatbot .placeholder")  # empty chat
    set_setting(page, "ps-temperature", 0)
    set_setting(page, "ps-max-new", 48)
    send(page, "What is a KV cache? Answer in two sentences.")
    wait_phase(page, "prefill", "decode", "done")  # the live phase indicator moves
    page.wait_for_function("() => document.activeElement === document.querySelector('#ps-message textarea')")
    assert "done" == wait_phase(page, "done")
    page.wait_for_timeout(500)  # the last figure update
    assert page.evaluate("() => document.activeElement === document.querySelector('#ps-message textarea')")
    reply = page.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
    generated = int(kpi(page, "generated_tokens"))
    assert reply.strip() and 1 <= generated <= 48
    stats = rf"\d+ prompt tok · cached \d+ · TTFT \d[\d,]* ms · decode [\d.]+ tok/s · {generated} tok"
    assert re.search(stats, reply)
    traces = plot_traces(page, "ps-latency")
    assert (1, generated) == (traces["prefill"], traces["decode"])  # one point per generated token
    for key in ("ttft", "prefill_tps", "prompt_tokens", "kv"):
        assert re.search(r"\d", kpi(page, key)), key
    if generated >= 2:
        assert re.fullmatch(r"[\d.,]+ ms", kpi(page, "tpot"))
        assert re.fullmatch(r"[\d.,]+ tok/s", kpi(page, "decode_tps"))
    kv_points = plot_traces(page, "ps-kv")["turn 1"]
    assert kv_points == 1 + 1 + generated  # the empty cache, the prefill jump, one point per token
    assert "46,080 B/token (formula: 46,080)" in page.inner_text("#ps-kv-check")
    assert "decode: fused C++" in page.inner_text("#ps-model-line")  # the native decode step runs in the app
    assert re.search(r"KV pool [\d.]+% in use", page.inner_text("#ps-pool"))
    assert 0 == page.locator("#ps-chatbot .placeholder").count()  # the welcome goes with the first message
    assert re.fullmatch(r"cached \d+ / [\d,]+", kpi_note(page, "prompt_tokens"))
    page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
    if os.environ.get("PHASESCOPE_UPDATE_SCREENSHOT"):
        shutil.copy(tmp_path / "chat.png", ROOT / "docs" / "screenshot.png")


def test_a_long_reply_streams_in_place_and_ends_equal_to_the_engines_events(page, app_db):
    from app.history.store import Store

    set_setting(page, "ps-temperature", 0)
    set_setting(page, "ps-repetition-penalty", 1)  # off: greedy runs long on this prompt
    set_setting(page, "ps-max-new", 600)
    send(page, "Write a long story about a lighthouse keeper, with many chapters.")
    wait_phase(page, "decode")
    # while it decodes, the text grows in the reply's live span and points are added to the open figure
    page.wait_for_function("() => { const s = document.querySelector('#ps-chatbot .ps-live'); "
                           "return s && s.textContent.length > 40; }", timeout=60_000)
    # text of it selected stays selected (the reply is not drawn again under it), then the text goes on
    selected = page.evaluate("() => { const s = document.querySelector('#ps-chatbot .ps-live'); "
                             "window.getSelection().selectAllChildren(s.firstElementChild); "
                             "return [window.getSelection().toString(), s.textContent.length]; }")
    page.wait_for_timeout(800)  # three updates
    assert selected == page.evaluate("() => [window.getSelection().toString(), "
                                     "document.querySelector('#ps-chatbot .ps-live').textContent.length]")
    page.evaluate("() => window.getSelection().removeAllRanges()")
    page.wait_for_function(f"() => document.querySelector('#ps-chatbot .ps-live').textContent.length > {selected[1]}",
                           polling=100, timeout=10_000)
    # the figure follows at its own pace (static/phasescope.js: every 1-1.5 s, a redraw taking at most 3 % of
    # the time)
    page.wait_for_function("() => { const p = document.querySelector('#ps-latency .js-plotly-plot'); "
                           "return p && p.data.some(t => t.name === 'decode' && (t.x || []).length > 0); }",
                           polling=100, timeout=60_000)
    streaming = plot_traces(page, "ps-latency").get("decode", 0)
    # plotly.js 3's "Share chart..." (an upload to Plotly Cloud) is not among the figure's buttons
    assert not page.evaluate("() => document.querySelector('#ps-latency .js-plotly-plot')._context.showSendToCloud")
    # new points join the drawn figure; its x axis runs ahead of them, so that the next ones only move the
    # trace (no replot)
    plot = "document.querySelector('#ps-latency .js-plotly-plot')"
    decode_trace = f"{plot}.data.find(t => t.name === 'decode')"
    page.wait_for_function(f"() => {decode_trace}.x.length > {streaming}", polling=100, timeout=60_000)
    last_x, axis_end = page.evaluate(f"() => [Math.max(...{decode_trace}.x), {plot}._fullLayout.xaxis.range[1]]")
    ended = "done" == page.get_attribute("#ps-phase [data-phase]", "data-phase")  # then the figure is fitted
    if not ended and last_x + 8 > axis_end:  # the reply's last figure (fitted) may come just before its phase line
        assert "done" == wait_phase(page, "done")
        ended = last_x == page.evaluate(f"() => Math.max(...{decode_trace}.x)")  # no point came after it
    assert last_x + 8 <= axis_end or ended
    # the KV chart's allocated line follows the turn's points (it stopped where the reply began, at ~30)
    kv = "document.querySelector('#ps-kv .js-plotly-plot')"
    page.wait_for_function(f"() => {kv}?.data?.some(t => t.name === 'allocated')")
    turn_end, allocated_end = page.evaluate(f"() => [Math.max(...{kv}.data.find(t => t.name === 'turn 1').x), "
                                            f"{kv}.data.find(t => t.name === 'allocated').x[1]]")
    assert turn_end <= allocated_end, (turn_end, allocated_end)
    assert "done" == wait_phase(page, "done")
    page.wait_for_timeout(500)
    generated = int(kpi(page, "generated_tokens"))
    assert 0 < streaming < generated  # drawn while streaming, not only at the end
    assert 0 == page.locator("#ps-chatbot .ps-live").count()  # the final reply replaced the live span
    store = Store.open(app_db)
    session = store.sessions()[0]
    reply = store.messages(session["id"])[-1]
    decode_steps = [row for row in store.steps(reply["id"]) if row["phase"] == "decode"]
    shown = page.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
    assert " ".join(shown.split()).startswith(" ".join(reply["content"].split()))  # Markdown reflows lines
    assert generated == len(decode_steps) == reply["generated_tokens"]
    assert (1, generated) == (plot_traces(page, "ps-latency")["prefill"], plot_traces(page, "ps-latency")["decode"])
    assert generated + 2 == plot_traces(page, "ps-kv")["turn 1"]


def test_second_turn_reuses_the_first_turns_kv(page):
    set_setting(page, "ps-temperature", 0)
    set_setting(page, "ps-max-new", 8)
    send(page, "Name a fruit.")
    wait_phase(page, "done")
    page.wait_for_selector("#ps-chatbot [data-testid=bot] .ps-stats")
    first_text = page.locator("#ps-chatbot [data-testid=bot]").first.inner_text().split("\n\n")[0]
    # what the second reply's live span shows before its first text comes: nothing (it once showed the
    # first reply's text until then, for as long as the reply was queued or prefilling)
    page.evaluate("""() => { window.psLiveSeen = []; new MutationObserver(() => {
        for (const span of document.querySelectorAll('#ps-chatbot .ps-live'))
            if (span.innerText) window.psLiveSeen.push(span.innerText); })
        .observe(document.querySelector('#ps-chatbot'), {childList: true, subtree: true}); }""")
    send(page, "Name another one.")
    page.wait_for_selector("#ps-chatbot [data-testid=user] >> nth=1")
    wait_phase(page, "done")
    assert first_text not in page.evaluate("() => window.psLiveSeen")
    page.wait_for_timeout(500)
    traces = plot_traces(page, "ps-kv")
    assert {"turn 1", "turn 2", "kept from cache"} <= set(traces)
    assert 2 == page.locator("#ps-chatbot [data-testid=bot]").count()
    cached, prompt = map(int, re.fullmatch(r"cached (\d+) / (\d+)", kpi_note(page, "prompt_tokens")).groups())
    reply = page.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
    assert f"{prompt} prompt tok · cached {cached} ·" in reply
    first = page.locator("#ps-chatbot [data-testid=bot]").first.inner_text()
    first_prompt, first_reply = map(int, re.search(r"(\d+) prompt tok · .* · (\d+) tok", first).groups())
    # the first turn was not prefilled again, its reply included: every token but the last, which no forward
    # took in (the reply comes back as the tokens it was generated as: engine.render_prompt)
    assert cached == first_prompt + first_reply - 1 < prompt


def test_a_reload_shows_the_chat_again_and_a_new_tab_starts_a_new_one(page, browser, app_url, app_db):
    """A reload (F5, or the browser restoring its tabs) showed an empty chat: the chat is in the History, but
    it was gone from the tab. The tab keeps the chat's id (sessionStorage): the reload shows it as it was,
    its reply, tiles and figures, and its Settings as its reply was asked with them (its system prompt: the
    start of every prompt), and the next message continues it from the cache; a new tab, or New chat, starts
    a new one."""
    from app.history.store import Store

    set_setting(page, "ps-temperature", 0)
    set_setting(page, "ps-max-new", 8)
    page.fill("#ps-system textarea", "Answer in one word.")
    send(page, "Name a river.")
    wait_phase(page, "done")
    page.wait_for_selector("#ps-chatbot [data-testid=bot] .ps-stats")
    reply = page.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
    page.reload()
    page.wait_for_selector("#ps-chatbot [data-testid=bot] .ps-stats")
    assert reply == page.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
    first_prompt, first_reply = map(int, re.search(r"(\d+) prompt tok · .* · (\d+) tok", reply).groups())
    assert "done" == wait_phase(page, "done") and kpi(page, "generated_tokens") == str(first_reply)
    assert 1 == plot_traces(page, "ps-latency")["prefill"]
    page.click("#ps-settings button")
    assert ("Answer in one word.", "0", "8") == (page.input_value("#ps-system textarea"),
                                                 page.input_value("#ps-temperature input[type=number]"),
                                                 page.input_value("#ps-max-new input[type=number]"))
    other = open_chat(browser, app_url)
    assert 0 == other.locator("#ps-chatbot [data-testid=bot]").count()  # a new tab: a new chat
    other.close()
    send(page, "Name another one.")
    page.wait_for_selector("#ps-chatbot [data-testid=user] >> nth=1")
    wait_phase(page, "done")
    cached, prompt = map(int, re.fullmatch(r"cached (\d+) / (\d+)", kpi_note(page, "prompt_tokens")).groups())
    assert cached == first_prompt + first_reply - 1 < prompt  # the first turn, its system prompt included
    session = next(s for s in Store.open(app_db).sessions() if s["title"] == "Name a river.")
    assert 2 == session["turns"]  # the same session, continued
    page.click("#ps-new")
    page.wait_for_selector("#ps-chatbot .placeholder")
    page.reload()
    page.wait_for_selector("#ps-chatbot .placeholder")
    page.wait_for_timeout(500)
    assert 0 == page.locator("#ps-chatbot [data-testid=bot]").count()


def test_retry_replaces_the_last_reply_with_its_prompt_from_the_cache(page, app_db):
    from app.history.store import Store

    set_setting(page, "ps-temperature", 0)
    set_setting(page, "ps-max-new", 8)
    send(page, "Describe the sea in one long sentence.")
    wait_phase(page, "done")
    set_setting(page, "ps-max-new", 3)  # the retry takes the settings as they are now
    page.fill("#ps-message textarea", "a draft")
    page.click("#ps-chatbot button[aria-label=Retry]")
    page.wait_for_function("() => /· 3 tok$/.test([...document.querySelectorAll('#ps-chatbot [data-testid=bot]')]"
                           ".pop().innerText.trim())", timeout=120_000)
    assert (1, 1) == (page.locator("#ps-chatbot [data-testid=user]").count(),
                      page.locator("#ps-chatbot [data-testid=bot]").count())
    assert "a draft" == page.input_value("#ps-message textarea")  # the box keeps what was being typed
    cached, prompt = map(int, re.fullmatch(r"cached (\d+) / (\d+)", kpi_note(page, "prompt_tokens")).groups())
    assert 0 < cached < prompt  # the same prompt again: prefilled from the cache
    store = Store.open(app_db)
    session = store.sessions()[0]
    user, replaced, retried = store.messages(session["id"])
    assert ("Describe the sea in one long sentence.", 8, 3) == (
        user["content"], replaced["generated_tokens"], retried["generated_tokens"])
    assert (retried["id"], None, 1) == (replaced["replaced_by"], retried["replaced_by"], session["turns"])
    assert CHAT_REPETITION_PENALTY == json.loads(session["settings"])["repetition_penalty"]  # the page's default


def test_editing_a_message_goes_back_to_it_and_answers_the_new_text(page, app_db):
    """The pencil under the first of two messages: the chat goes back to it and answers the edited text
    (markup in it shown as text), its prompt's start from the prefix cache; the history keeps the
    replaced turns, marked."""
    from app.history.store import Store

    set_setting(page, "ps-temperature", 0)
    set_setting(page, "ps-max-new", 4)
    first = "Name a fruit & a <i>tree</i>, not `a<b && c &amp; d`."  # markup as text, code as typed
    for n, text in enumerate((first, "Name a colour.")):
        send(page, text)
        page.wait_for_selector(f"#ps-chatbot [data-testid=user] >> nth={n}")
        wait_phase(page, "done")
    edited = "Name a vegetable & a <b>tool</b>."
    page.locator("#ps-chatbot [data-testid=user]").first.hover()
    page.locator("#ps-chatbot button[aria-label=Edit]").first.click()
    assert first == page.input_value("#ps-chatbot textarea")  # the text, not the markup that shows it as text
    page.fill("#ps-chatbot textarea", edited)
    page.locator("#ps-chatbot button[aria-label=Submit]").click()
    page.wait_for_function("() => document.querySelectorAll('#ps-chatbot [data-testid=user]').length === 1",
                           timeout=60_000)
    wait_phase(page, "done")
    page.wait_for_function("() => /· \\d+ tok$/.test(document.querySelector('#ps-chatbot [data-testid=bot]')"
                           ".innerText.trim())", timeout=60_000)
    assert [edited] == [t.strip() for t in page.locator("#ps-chatbot [data-testid=user]").all_inner_texts()]
    assert 1 == page.locator("#ps-chatbot [data-testid=bot]").count()
    cached, prompt = map(int, re.fullmatch(r"cached (\d+) / (\d+)", kpi_note(page, "prompt_tokens")).groups())
    assert 0 < cached < prompt  # the chat template's start, from the cache
    page.locator("#ps-chatbot [data-testid=user]").first.hover()
    assert 1 == page.locator("#ps-chatbot button[aria-label=Edit]").count()  # editable again once it ended
    store = Store.open(app_db)
    session = store.sessions()[0]
    rows = store.messages(session["id"])
    new_reply = max(m["id"] for m in rows)
    assert [(1, first, new_reply), (1, edited, None), (2, "Name a colour.", new_reply)] == [
        (m["turn"], m["content"], m["replaced_by"]) for m in rows if m["role"] == "user"]
    assert 1 == session["turns"]


# The contrast of an element's text (its color, or an SVG text's fill) against what lies behind it: its own
# background and its ancestors', each composited over the next (semi-transparent tints included)
CONTRAST = r"""(selector) => {
  const element = document.querySelector(selector);
  const parse = (c) => { const v = (c.match(/[\d.]+/g) || []).map(Number);
    const scale = c.startsWith('color(') ? 255 : 1;
    return [v[0] * scale, v[1] * scale, v[2] * scale, v.length > 3 ? v[3] : 1]; };
  const layers = [];
  for (let e = element; e; e = e.parentElement) layers.unshift(parse(getComputedStyle(e).backgroundColor));
  let behind = [255, 255, 255];
  for (const [r, g, b, a] of layers) behind = [r * a + behind[0] * (1 - a), g * a + behind[1] * (1 - a),
                                               b * a + behind[2] * (1 - a)];
  const style = getComputedStyle(element), text = parse(element instanceof SVGElement ? style.fill : style.color);
  const luminance = (rgb) => rgb.slice(0, 3).map((x) => { x /= 255;
    return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4; })
    .reduce((sum, x, i) => sum + x * [0.2126, 0.7152, 0.0722][i], 0);
  const [light, dark] = [luminance(text), luminance(behind)].sort((x, y) => y - x);
  return (light + 0.05) / (dark + 0.05);
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_panel_and_charts_read_in_a_light_and_a_dark_browser(browser, app_url, scheme):
    """A browser that prefers dark gets Gradio's dark theme: the app's own panel, token chips and the charts'
    axes (drawn from figures made for a light page) keep a readable contrast (WCAG's 4.5 for text)."""
    page = open_chat(browser, app_url, color_scheme=scheme)
    try:
        set_setting(page, "ps-max-new", 8)
        send(page, "Hello")
        assert "done" == wait_phase(page, "done")
        page.wait_for_selector("#ps-latency .xtick text")
        for selector in ("#ps-phase .ps-phase", "#ps-kpis .ps-value", "#ps-latency .xtick text",
                         "#ps-kv .g-ytitle text"):
            assert page.evaluate(CONTRAST, selector) >= 4.5, (scheme, selector)
        page.get_by_role("tab").nth(1).click()
        page.wait_for_selector("#ps-explain-tokens .ps-tok")
        assert page.evaluate(CONTRAST, "#ps-explain-tokens .ps-tok") >= 4.5, (scheme, "token chip")
    finally:
        page.close()


def words_broken_in_cells(page, selector: str) -> list[str]:
    """The cells under selector whose longest word is wider than the cell: drawn broken across lines."""
    return page.evaluate("""(selector) => { const c = document.createElement('canvas').getContext('2d');
        return [...document.querySelectorAll(selector)].filter(cell => {
          const s = getComputedStyle(cell); c.font = `${s.fontWeight} ${s.fontSize} ${s.fontFamily}`;
          const longest = Math.max(...cell.innerText.split(/\\s+/).map(word => c.measureText(word).width));
          return longest > cell.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight) + 1;
        }).map(cell => cell.innerText); }""", selector)


def test_a_phones_width_stacks_the_header_and_keeps_the_tiles_whole(browser, app_url):
    page = open_chat(browser, app_url)
    try:
        one_line = "() => { const box = document.querySelector('#ps-message textarea'); " \
                   "return box.scrollHeight <= box.clientHeight; }"  # the hint's "(Enter to send)" under its edge
        for width in (1024, 390):
            page.set_viewport_size({"width": width, "height": 900})
            page.wait_for_function(one_line, timeout=5_000)
        send_box, stop_box = page.locator("#ps-send").bounding_box(), page.locator("#ps-stop").bounding_box()
        assert send_box["y"] == stop_box["y"]  # side by side under the box (Stop took a row of its own)
        page.set_viewport_size({"width": 420, "height": 900})
        set_setting(page, "ps-max-new", 8)
        send(page, "Hello")
        assert "done" == wait_phase(page, "done")
        title, switch = page.locator(".ps-header").bounding_box(), page.locator("#ps-language").bounding_box()
        assert title["y"] + title["height"] <= switch["y"] and title["width"] > 300  # one above the other
        overflowing = page.evaluate("() => [...document.querySelectorAll('#ps-kpis .ps-tile')]"
                                    ".filter(t => t.scrollWidth > t.clientWidth).length")
        assert 0 == overflowing and 0 < page.locator("#ps-kpis .ps-tile").count()
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 420  # nothing scrolls sideways
        # each chart's title on a line of its own, clear of the legend ("KV 缓存大小" ran under "已分配")
        # (the reply's last figure may come just after its phase line)
        apart = """() => ['latency', 'kv'].every(name => {
            const plot = document.querySelector(`#ps-${name} .js-plotly-plot`);
            const [title, legend] = ['.gtitle', '.legend'].map(s => plot?.querySelector(s)?.getBoundingClientRect());
            return title && legend && title.bottom <= legend.top; })"""
        page.wait_for_function(apart, timeout=10_000)
        page.get_by_text("简体中文", exact=True).click()
        page.wait_for_function("() => document.querySelector('#ps-kv .gtitle')?.textContent.includes('缓存')")
        page.wait_for_function(apart, timeout=10_000)
        page.get_by_role("tab").nth(1).click()  # the Explain tab's "Demos:" on a line, not a letter per line
        assert page.locator("#ps-demos > :first-child").bounding_box()["width"] > 300
        candidates, grid = (page.locator(f"#ps-explain-{name}").bounding_box() for name in ("candidates", "kv"))
        assert candidates["y"] + candidates["height"] <= grid["y"] and grid["width"] > 300  # charts stacked
        assert page.evaluate("() => document.documentElement.scrollWidth") <= 420  # the pipeline scrolls alone
        page.set_viewport_size({"width": 1024, "height": 768})  # a class's projector: the buttons on one row
        tops = "() => ['start', 'next', 'run', 'pause', 'stop'].map(name => " \
               "document.querySelector(`#ps-explain-${name}`).getBoundingClientRect().top)"
        page.wait_for_function(f"() => new Set(({tops})()).size === 1", timeout=5_000)  # Stop went onto a row alone
        page.locator("#ps-presenter input").check()  # the sampling and the demos put away: the steps in view
        page.wait_for_selector("#ps-explain-sampling", state="hidden")
        assert not page.is_visible("#ps-demos")
        page.locator("#ps-presenter input").uncheck()
        page.wait_for_selector("#ps-explain-sampling", state="visible")
    finally:
        page.close()


ORDER_JS = """window.psOrder = [];
new MutationObserver(() => {
  if (!psOrder.includes('message box') && document.querySelector('#ps-message textarea')) psOrder.push('message box');
}).observe(document, {childList: true, subtree: true});
Object.defineProperty(window, 'Plotly', {configurable: true, get: () => undefined, set: (value) => {
  Object.defineProperty(window, 'Plotly', {value, writable: true, configurable: true});
  psOrder.push('plotly.js');
}});"""


def test_the_page_shows_its_controls_before_it_loads_plotly(browser, app_url):
    """plotly.js (4.5 MB) evaluated among Gradio's scripts held the page's controls back by a second: it is
    loaded once they show, with the first figure, and the figures then drawn."""
    page = open_chat(browser, app_url, script=ORDER_JS)
    assert {"prefill", "decode"} <= set(plot_traces(page, "ps-latency"))  # the empty chat's figure, drawn
    assert ["message box", "plotly.js"] == page.evaluate("() => psOrder")
    page.close()


def test_charts_drawn_again_while_their_tab_is_hidden_fit_their_column_when_it_shows(page):
    """The language switched on another tab draws the Chat's and Explain's charts again in hidden tabs:
    plotly.js measured no width there and kept its default, 700 px, over the column's edge (the chat's laid
    out for a phone's width too)."""
    set_setting(page, "ps-max-new", 8)
    send(page, "Hello")
    assert "done" == wait_phase(page, "done")
    page.get_by_role("tab", name="Explain").click()
    page.click("#ps-explain-start")
    page.wait_for_selector("#ps-explain-candidates .js-plotly-plot")
    page.get_by_role("tab", name="History").click()
    page.get_by_text("简体中文", exact=True).click()
    page.get_by_role("tab", name="讲解").wait_for()
    fit = """(selector) => [...document.querySelectorAll(selector)].every(box => {
        const svg = box.querySelector('.main-svg'), title = box.querySelector('.gtitle');
        const legend = box.querySelector('.legend');  // the chat's: beside the title, as on a wide page
        const beside = title && (!legend || title.getBoundingClientRect().bottom > legend.getBoundingClientRect().top);
        return svg && beside && Math.abs(svg.getBoundingClientRect().width - box.clientWidth) < 1
            && /[\u4e00-\u9fff]/.test(title.textContent);
    })"""
    page.get_by_role("tab", name="对话").click()
    page.wait_for_function(fit, arg="#ps-latency .ps-plot, #ps-kv .ps-plot", timeout=10_000)
    page.get_by_role("tab", name="讲解").click()
    page.wait_for_function(fit, arg="#ps-explain-candidates .js-plotly-plot", timeout=10_000)
    page.get_by_text("English", exact=True).click()  # the next test's page starts in this one's language
    page.get_by_role("tab", name="Explain").wait_for()


def test_stop_keeps_the_partial_reply(page):
    set_setting(page, "ps-max-new", 600)
    set_setting(page, "ps-repetition-penalty", 1)  # as the test was written: a long reply to stop
    send(page, "Write a very long story about a lighthouse keeper, with many chapters.")
    page.wait_for_function("() => { const t = document.querySelector('#ps-kpis [data-kpi=generated_tokens] "
                           ".ps-value'); return t && parseInt(t.innerText) >= 5; }", timeout=120_000)
    page.click("#ps-stop")
    assert "stopped" == wait_phase(page, "stopped", "done", timeout_ms=30_000)
    # the reply's closing line can land an update after the phase line
    page.wait_for_function("() => { const bots = document.querySelectorAll('#ps-chatbot [data-testid=bot]'); "
                           "return bots.length && / tok · stopped/.test(bots[bots.length - 1].innerText); }",
                           timeout=10_000)
    reply = page.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
    kept = int(re.search(r"(\d+) tok · stopped", reply).group(1))
    assert 5 <= kept < 300  # cancelled soon after the click (int8 makes ~100 tokens in 0.3 s), far from 1,000
    assert len(reply.split("\n")[0]) > 0


def test_a_message_sent_while_a_reply_streams_stays_in_the_box(page, app_db):
    """Enter while the chat's reply streams: the chat answers one message at a time (Send shows so), so the
    message stays in the box, and the running reply's message is not sent again (the turned-down send's queued step once
    ran it a second time beside the first: two replies saved, one shown)."""
    from app.history.store import Store

    set_setting(page, "ps-temperature", 0)
    set_setting(page, "ps-max-new", 200)
    send(page, "Tell me a long story about a dragon.")
    wait_phase(page, "decode")
    replying = "() => ['#ps-send', '#ps-stop'].map(s => getComputedStyle(document.querySelector(s)).opacity)"
    # Send shown as unavailable while the reply runs, Stop not (once the buttons' fade has ended: the first
    # token, which shows the decode phase, is sent to the page when it comes)
    page.wait_for_function(f"() => ({replying})().join() === '0.5,1'", timeout=2000)
    page.fill("#ps-message textarea", "A second question?")
    page.press("#ps-message textarea", "Enter")
    wait_phase(page, "done")
    page.wait_for_timeout(1500)
    assert "done" == page.get_attribute("#ps-phase [data-phase]", "data-phase")
    assert ["1", "0.5"] == page.evaluate(replying)
    assert 1 == page.locator("#ps-chatbot [data-testid=bot]").count()
    assert "A second question?" == page.input_value("#ps-message textarea")
    store = Store.open(app_db)
    assert ["user", "assistant"] == [m["role"] for m in store.messages(store.sessions()[0]["id"])]


def test_markup_is_shown_as_text_and_never_run(page):
    set_setting(page, "ps-max-new", 4)
    code = 'if a < b && c > d:\n    s = "&amp;<img src=y onerror=window.__pwned=3>"'
    send(page, 'Repeat: <b>bold</b> <img src=x onerror="window.__pwned=1"> <script>window.__pwned=2</script> '
               f"`x<y && z>0`\n```python\n{code}\n```")
    wait_phase(page, "done")
    user_text = page.locator("#ps-chatbot [data-testid=user]").last.inner_text()
    assert '<b>bold</b> <img src=x onerror="window.__pwned=1">' in user_text
    assert page.evaluate("() => window.__pwned === undefined")
    assert 0 == page.locator("#ps-chatbot [data-testid=user] img, #ps-chatbot [data-testid=user] b").count()
    codes = page.locator("#ps-chatbot [data-testid=user]").last.locator("code").all_inner_texts()
    assert ["x<y && z>0", code] == [c.strip() for c in codes]  # code as typed, not "x&lt;y"


# Markdown as a streaming reply is drawn (static/markdown.js) and as Gradio draws the message once it ends:
# the same elements for the same text, highlighting and copy buttons aside
MARKDOWN = [
    "Intro line\nsecond line",
    "```python\nx = 1 < 2 and '&amp;'\n```",
    "- a\n- b **bold** and `co<de>`\n  continued",
    "1. one\n2. two\n   - nested a\n   - nested b\n3. three",
    "4) four\n5) five",
    "- loose\n\n- list",
    "# Head ##\n> quote **x**\n> more\nlazy",
    "para *it* _u_ ~~s~~ snake_case_name, *a **b** c*, **use `x` now**, 2*3*4",
    "| a | b | c |\n|---|:-:|--:|\n| 1 | `|` | 3 |\n| 4 |",
    "Setext\n======\n\nSub\n---",
    "text\n\n    indented code\n    more",
    "Use:\n~~~bash\npip install x\n~~~\nThen [the site](https://example.com/a?b=1&c=2).",
    "- [ ] todo\n- [x] done\n\nSee https://example.com/a_b?c=1&d=2. (https://x.io/page) \"https://q.r\"",
    "&copy; & <b>x</b> <img src=x onerror=\"window.__pwned=1\"> 5 > 3",
    "A hash in a line: `" + "0f" * 60 + "`, and a long line in a block:\n```\nprint('" + "a" * 200 + "')\n```",
    "Here:\n\n```python\ndef open_block():\n    return",  # a block the text leaves open runs to its end
]
# the elements drawn past the right edge of the message they are in (a code block's own lines scroll inside it)
PAST_THE_EDGE = """(selector) => [...document.querySelectorAll(selector)].flatMap((message) => {
  const edge = message.getBoundingClientRect().right + 1;
  return [...message.querySelectorAll('*')].filter((e) => !e.closest('pre') || e.tagName === 'PRE')
    .filter((e) => e.getBoundingClientRect().right > edge).map((e) => e.outerHTML.slice(0, 80));
})"""
NORMALIZED = """(root) => {
  const normalized = (node) => {
    const copy = node.cloneNode(true);
    copy.querySelectorAll('.copy_code_button').forEach((button) => button.remove());
    copy.querySelectorAll('code').forEach((code) => { code.textContent = code.textContent; });  // highlighting
    copy.querySelectorAll('*').forEach((element) => {
      for (const {name} of [...element.attributes]) {
        const kept = ['align', 'start', 'href'].includes(name)
          || (name === 'class' && /^(CODE|DIV)$/.test(element.tagName));
        if (!kept) element.removeAttribute(name);
      }
    });
    return copy.innerHTML.replace(/>\\s+</g, '><').trim();
  };
  const drawn = document.createElement('div');
  drawn.innerHTML = window.phasescopeMarkdown.render(root.dataset.text);
  return [normalized(root), normalized(drawn)];
}"""


def test_a_streaming_reply_is_drawn_as_markdown_as_it_will_be_when_it_ends(page):
    set_setting(page, "ps-max-new", 1)
    for text in ["\n\n***\n\n".join(MARKDOWN[:-1]), MARKDOWN[-1]]:
        send(page, text)  # a message of yours: drawn by the same Markdown as a reply's
        wait_phase(page, "done")
        page.wait_for_timeout(300)
        gradio = page.locator("#ps-chatbot [data-testid=user] .message-content > .md").last
        gradio.evaluate("(root, text) => { root.dataset.text = text; }", text)
        by_gradio, by_page = gradio.evaluate(NORMALIZED)
        assert by_gradio == by_page
    assert page.evaluate("() => window.__pwned === undefined")
    assert [] == page.evaluate(PAST_THE_EDGE, "#ps-chatbot [data-testid=user]")  # a long hash breaks in its line
    # a closed block has Gradio's copy button (Gradio's action on the message copies its code); an open one none
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    gradio.evaluate("(root) => { const drawn = document.createElement('div'); drawn.id = 'ps-test-drawn'; "
                    "drawn.innerHTML = window.phasescopeMarkdown.render('Code:\\n```\\nx = 1 < 2\\n```\\n"
                    "```\\nstill coming'); root.appendChild(drawn); }")
    assert 1 == page.locator("#ps-test-drawn .copy_code_button").count()
    page.click("#ps-test-drawn .copy_code_button", force=True)  # shown on hover
    page.wait_for_timeout(300)
    assert "x = 1 < 2" == page.evaluate("() => navigator.clipboard.readText()")
    # replies a small model may loop into: drawn, no deeper than the page's stack allows
    for run in ["> ", "- ", "1. ", "> - ", "**a ", "~~a ", "` ", "| a "]:
        assert page.evaluate("(text) => window.phasescopeMarkdown.render(text).length", run * 8000) > 0
    # while a reply streams, its live span holds the text so far drawn so
    set_setting(page, "ps-max-new", 200)
    set_setting(page, "ps-temperature", 0)
    send(page, "Write a short poem about the sea, in three stanzas.")
    page.wait_for_function("() => { const s = document.querySelector('#ps-chatbot .ps-live p'); "
                           "return s && s.textContent.length > 20; }", polling=100, timeout=60_000)


def test_copy_message_copies_the_message_as_written(page, app_db):
    """Copy message, under a message: the text as written, not the markup that shows it (escaped outside
    code; the reply's stats line); a code block's own copy button: its code."""
    from app.history.store import Store

    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    set_setting(page, "ps-temperature", 0)  # greedy: the story below is long every time (a sampled reply
    set_setting(page, "ps-max-new", 6)  # once ended within a few tokens, its decode phase never seen)
    message = "Repeat: 3 < 5 & 7 > 2, `x<y`\n```\na<b && c\n```"
    send(page, message)
    wait_phase(page, "done")
    page.wait_for_selector("#ps-chatbot [data-testid=bot] .ps-stats")

    def copied(button) -> str:
        button.click(force=True)  # the buttons show on hover
        page.wait_for_timeout(300)
        return page.evaluate("() => navigator.clipboard.readText()")

    # each message's Copy, found by place: its label reads "Copied message" for two seconds after a click
    under_messages = page.locator("#ps-chatbot .message-buttons .icon-button-wrapper > button:first-of-type")
    assert message == copied(under_messages.nth(0))
    store = Store.open(app_db)

    def last_reply() -> str:
        return [m for m in store.messages(store.sessions()[0]["id"]) if m["role"] == "assistant"][-1]["content"]

    reply = last_reply()
    assert "Copy message" == under_messages.nth(1).get_attribute("aria-label")
    assert reply == copied(under_messages.nth(1))
    assert "a<b && c" == copied(page.locator("#ps-chatbot [data-testid=user] .copy_code_button").first).strip()
    set_setting(page, "ps-max-new", 400)
    send(page, "Tell me a long story about a lighthouse.")
    wait_phase(page, "decode")
    page.wait_for_timeout(300)
    so_far = copied(under_messages.nth(3))  # the reply streaming: its text so far, not its live span's markup
    shown = page.evaluate("""() => {  // while it streams (read at once, before it may end): no Retry under it
        const live = document.querySelector("#ps-chatbot .ps-live");
        const retry = document.querySelector("#ps-chatbot button[aria-label=Retry]");
        return live ? getComputedStyle(retry).display : null; }""")
    assert shown in (None, "none")
    wait_phase(page, "done")
    reply = last_reply()
    assert so_far and reply.startswith(so_far)
    store.close()
    page.locator("#ps-chatbot [data-testid=bot]").last.hover()
    assert page.locator("#ps-chatbot button[aria-label=Retry]").is_visible()  # the reply done: Retry back


def test_the_edit_box_undoes_the_escaping_by_the_same_rules(page):
    """static/markdown.js's unescapeOutsideCode gives back exactly the text app/ui/markdown.py's
    as_text was given, for random mixes of fences, backticks, markup and entities."""
    import random

    from app.ui.markdown import as_text

    rng = random.Random(3)
    parts = ["`", "``", "```", "~~~", "<", ">", "&", "&amp;", "&lt;", "&gt;", "> ", "\n", "\n\n", " ", "    ", "a",
             "py"]
    texts = ["".join(rng.choice(parts) for _ in range(rng.randint(0, 25))) for _ in range(2000)]
    back = page.evaluate("(shown) => shown.map(window.phasescopeMarkdown.unescapeOutsideCode)",
                         [as_text(t) for t in texts])
    assert texts == back


def test_empty_and_too_long_messages(page):
    page.click("#ps-send")  # empty: nothing happens
    page.wait_for_timeout(800)
    assert 0 == page.locator("#ps-chatbot [data-testid=user]").count()
    send(page, "word " * 9000)
    page.wait_for_function("() => { const bots = document.querySelectorAll('#ps-chatbot [data-testid=bot]'); "
                           "return bots.length && bots[bots.length - 1].innerText.includes('context window'); }")
    error = page.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
    assert re.search(r"conversation is [\d,]+ tokens, but the model's context window is 8,192 tokens", error)
    set_setting(page, "ps-max-new", 4)
    send(page, "Hello")  # the app keeps working
    assert "done" == wait_phase(page, "done")


def test_every_control_has_a_name_a_screen_reader_can_say_in_each_tab_and_language(page):
    """Gradio names a control given no label after its class: a screen reader said 'Textbox' for the message
    box and the History tab's search and title, 'Dataframe' for its table."""
    gradio_default = re.compile(r'- (\w+) "(Textbox|Dataframe|Radio|Dropdown|Checkbox|Slider|Number|Button|Plot)"')
    for language, tabs in [("English", ["Chat", "Explain", "History", "Lab"]), ("简体中文", ["对话", "讲解", "历史", "实验室"])]:
        page.get_by_text(language, exact=True).click()
        for tab in tabs:
            page.get_by_role("tab", name=tab).click()
            page.wait_for_timeout(300)
            snapshot = page.locator("body").aria_snapshot()
            assert not gradio_default.findall(snapshot), (language, tab, gradio_default.findall(snapshot))
            assert re.search(r'- textbox "(Message|消息|Search|搜索|Prompt|提示词)', snapshot), (language, tab)
    page.get_by_text("English", exact=True).click()  # the next test's page starts where this one's language is


def test_two_tabs_generate_at_once_without_cross_talk(browser, app_url, tmp_path):
    from app.bench.browser import HISTORY_CELLS, open_history

    first, second = open_chat(browser, app_url), open_chat(browser, app_url)
    try:
        set_setting(first, "ps-temperature", 0)  # greedy, no penalty: this prompt runs long, no early EOS
        set_setting(first, "ps-repetition-penalty", 1)
        set_setting(first, "ps-max-new", 4000)  # int8 makes ~250 tok/s here: still running when the second ends
        set_setting(second, "ps-temperature", 0)
        set_setting(second, "ps-max-new", 100)  # long enough to overlap the first for a second or more
        send(first, "Write a long story about a lighthouse keeper.")
        first.wait_for_selector("#ps-phase [data-phase=decode]", timeout=60_000)
        send(second, "Write a long story about a penguin.")
        # both decode at once: the engine batches their steps (each page shows it within a refresh)
        first.wait_for_function("() => /batch of 2/.test(document.querySelector('#ps-phase').innerText)",
                                timeout=30_000)
        second.wait_for_function("() => /running with 1 other/.test(document.querySelector('#ps-phase').innerText)",
                                 timeout=30_000)
        second.screenshot(path=str(tmp_path / "together.png"))
        assert "done" == wait_phase(second, "done")
        assert "decode" == wait_phase(first, "decode", "done")  # the long reply goes on after the short one
        open_history(second)  # the first tab's session is not deleted under its reply
        # this test's session (earlier tests' lighthouse keepers have "keeper," in their titles)
        second.locator(HISTORY_CELLS, has_text="lighthouse keeper.").first.click()
        second.wait_for_selector("#ps-history-selected:has-text('lighthouse keeper.')")  # selected, then Delete
        second.click("#ps-history-delete")
        second.click("#ps-history-confirm")
        second.wait_for_selector("#ps-history-selected .ps-attention:has-text('is replying now')")
        second.get_by_role("tab", name="Chat").click()
        assert "decode" == wait_phase(first, "decode", "done")
        first.click("#ps-stop")
        assert wait_phase(first, "stopped", "done") in ("stopped", "done")
        first_users = first.locator("#ps-chatbot [data-testid=user]").all_inner_texts()
        second_users = second.locator("#ps-chatbot [data-testid=user]").all_inner_texts()
        assert (["Write a long story about a lighthouse keeper."], ["Write a long story about a penguin."]) == (
            first_users, second_users)
        # each tab kept its own settings and its own reply
        assert int(kpi(second, "generated_tokens")) <= 100 < int(kpi(first, "generated_tokens"))
        first_reply = first.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
        second_reply = second.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
        assert first_reply.split("\n")[0] != second_reply.split("\n")[0]
    finally:
        first.close()
        second.close()


def test_a_session_opened_while_a_reply_streams_stops_that_reply(page):
    """Open in chat while the tab's reply streams: the reply stopped (saved as stopped), as with New chat;
    it went on, its phase line and points drawn over the session opened."""
    from app.bench.browser import HISTORY_CELLS, open_history

    set_setting(page, "ps-max-new", 8)
    send(page, "A short one to open again")
    wait_phase(page, "done")
    short = kpi(page, "generated_tokens")  # 8, or fewer where the sampled reply ended sooner
    page.click("#ps-new")
    page.wait_for_selector("#ps-phase .ps-idle")
    page.wait_for_selector("#ps-chatbot .placeholder")  # an empty chat again: the welcome
    for name, value in (("ps-max-new", 1500), ("ps-temperature", 0), ("ps-repetition-penalty", 1)):
        set_setting(page, name, value)
    send(page, "Write a long story about a lighthouse keeper who opens things.")
    page.wait_for_selector("#ps-phase [data-phase=decode]", timeout=60_000)
    open_history(page)
    page.locator(HISTORY_CELLS, has_text="A short one to open again").first.click()
    page.wait_for_selector("#ps-history-selected:has-text('A short one to open again')")
    page.click("#ps-history-open")
    page.wait_for_selector("#ps-chatbot [data-testid=user]:has-text('A short one to open again')")
    page.wait_for_timeout(2000)  # some hundreds of the long reply's tokens, had it gone on
    assert page.locator("#ps-phase [data-phase=done]").count() == 1 and short == kpi(page, "generated_tokens")
    assert int(short) == plot_traces(page, "ps-latency")["decode"]


def test_a_history_database_damaged_under_the_app_is_said_in_the_history_and_the_chat_still_loads(browser,
                                                                                                  tmp_path):
    """A database file overwritten while the app runs (a disk, another program): the page still draws
    every tab (the tabs' redraws run as one event, which one tab's failure failed whole: the model line
    stayed "Loading the model…"), and the History and the Lab's saved runs say why they are empty (Gradio said
    "Error", the Lab "none yet")."""
    path = tmp_path / "h.db"
    process, url = start_app("--db", str(path))
    try:
        for file in tmp_path.glob("h.db*"):
            file.write_bytes(b"not a database " * 1000)
        page = open_chat(browser, url)  # waits for the model line, drawn by the load's redraws
        page.get_by_role("tab", name="History").click()
        page.wait_for_selector(f"#ps-history-selected .ps-attention:has-text('cannot read the history database "
                               f"{path}: file is not a database')")
        assert 0 == page.locator(".error, [data-testid=error]").count()
        page.get_by_role("tab", name="Lab").click()  # its saved runs' list too (it said "none yet")
        page.wait_for_selector("#ps-lab-runs:has-text('cannot read the history database')")
        page.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "Traceback" not in "".join(process.output)


def test_history_survives_closing_the_browser_and_the_app(browser, tmp_path):
    from app.bench.browser import HISTORY_CELLS, history_titles, open_history

    db = tmp_path / "history.db"
    process, url = start_app("--db", str(db))
    try:
        page = open_chat(browser, url)
        page.get_by_role("tab", name="History").click()  # empty: said so
        page.wait_for_selector("#ps-history-selected:has-text('No chats yet')")
        page.get_by_role("tab", name="Chat").click()
        set_setting(page, "ps-max-new", 10)
        send(page, "What is prefill?")
        wait_phase(page, "done")
        send(page, "And what is decode?")
        page.wait_for_selector("#ps-chatbot [data-testid=user] >> nth=1")
        wait_phase(page, "done")
        page.wait_for_timeout(500)
        before = (page.locator("#ps-chatbot [data-testid=bot]").all_inner_texts(), plot_traces(page, "ps-kv"),
                  plot_traces(page, "ps-latency"))
        # in the database only: Gradio's run history (a copy of each event in the browser's storage) is off
        assert "What is prefill?" not in page.evaluate("() => Object.values(localStorage).join()")
        page.close()
    finally:
        process.terminate()
        process.wait(timeout=30)

    process, url = start_app("--db", str(db))
    try:
        page = open_chat(browser, url)
        open_history(page)
        assert ["What is prefill?"] == history_titles(page)
        acting = ("#ps-history-open", "#ps-history-rename", "#ps-history-delete")
        assert all(page.is_disabled(button) for button in acting)  # nothing selected yet
        assert "Select a session in the table." == page.inner_text("#ps-history-selected").strip()
        search = "#ps-history-search textarea, #ps-history-search input"
        page.fill(search, "no such words")
        page.press(search, "Enter")
        page.wait_for_selector("#ps-history-selected:has-text('No session matches “no such words”.')")
        page.fill(search, "")
        page.press(search, "Enter")
        page.wait_for_selector("#ps-history-selected:has-text('Select a session in the table.')")
        page.locator(HISTORY_CELLS, has_text="What is prefill?").first.click()
        page.wait_for_selector("#ps-history-selected b")
        page.wait_for_selector("#ps-history-delete:not([disabled])")
        assert not any(page.is_disabled(button) for button in acting)
        percentiles = page.inner_text("#ps-history-selected table.ps-percentiles")  # over its two replies
        assert all(name in percentiles for name in ("p50", "p99", "TTFT", "TPOT", "ITL", "E2E"))
        assert re.search(r"Run in: (int8|fp32) \(2\)", page.inner_text("#ps-history-selected [data-engines]"))
        clicked = time.time() - 1  # ctime's granularity
        with page.expect_download() as download:
            page.click("#ps-export-json")
        exported = json.loads(Path(download.value.path()).read_text())
        assert download.value.suggested_filename == "phasescope-session-1.json"
        assert 4 == len(exported["sessions"][0]["messages"])
        # served from a cache only this user can read (gradio's default, /tmp/gradio, is everyone's)
        served = [f for f in Path(tempfile.gettempdir()).glob("phasescope-gradio-*/*/phasescope-session-1.json")
                  if f.stat().st_ctime >= clicked]
        assert served and all(f.parent.parent.stat().st_mode & 0o777 == 0o700 for f in served)
        with page.expect_download() as download:  # all sessions: written at the click
            page.click("#ps-export-all-csv")
        assert download.value.suggested_filename == "phasescope-all-sessions.csv"
        assert len(Path(download.value.path()).read_text().splitlines()) > 20  # a row per step
        page.click("#ps-history-open")
        page.wait_for_selector("#ps-chatbot [data-testid=user] >> nth=1")
        page.wait_for_timeout(500)
        after = (page.locator("#ps-chatbot [data-testid=bot]").all_inner_texts(), plot_traces(page, "ps-kv"),
                 plot_traces(page, "ps-latency"))
        assert before == after  # the same replies, stats lines and charts
        assert "Done" in page.inner_text("#ps-phase")
        send(page, "One more?")  # the restored chat continues, in the same session
        page.wait_for_selector("#ps-chatbot [data-testid=user] >> nth=2")
        wait_phase(page, "done")
        open_history(page)
        page.locator(HISTORY_CELLS, has_text="What is prefill?").first.click()
        page.click("#ps-history-rename")  # no new title typed: the title stays
        page.wait_for_selector("#ps-history-selected .ps-attention:has-text('Type the new title first.')")
        assert ["What is prefill?"] == history_titles(page)
        assert "#1" in page.inner_text("#ps-history-selected")  # the selection's line stays above it
        page.set_viewport_size({"width": 1024, "height": 768})  # a class's projector: every column in view,
        page.fill("#ps-history-title textarea, #ps-history-title input", "Prefill and decode, step by step: " * 3)
        page.click("#ps-history-rename")  # with a title over the 48 characters shown (the longest cell)
        page.wait_for_function("() => document.querySelector('#ps-history-table').innerText.includes('step by')")
        page.wait_for_timeout(300)
        edges = page.evaluate("""() => [document.querySelector('#ps-history-table .table-wrap'),
                                        ...document.querySelectorAll('#ps-history-table th')]
                                       .map(box => box.getBoundingClientRect().right)""")
        assert max(edges[1:]) <= edges[0] + 1  # TTFT and TPOT went past the table's right edge
        assert edges[-1] >= edges[0] - 4  # and the columns fill the table (~50 px were left empty here)
        cells = page.evaluate("""() => [...document.querySelector('#ps-history-table .virtual-row').children]
                                       .map(cell => cell.getBoundingClientRect().right)""")
        assert [round(x) for x in cells] == [round(x) for x in edges[1:]]  # each cell under its header
        page.fill("#ps-history-title textarea, #ps-history-title input", "Phases")
        page.click("#ps-history-rename")
        page.wait_for_function("() => document.querySelector('#ps-history-table').innerText.includes('Phases')")
        page.wait_for_selector("#ps-history-selected .ps-attention", state="detached")
        page.wait_for_selector("#ps-history-selected:has-text('Phases')")  # its line and its files renamed too
        with page.expect_download() as download:
            page.click("#ps-export-json")
        assert "Phases" == json.loads(Path(download.value.path()).read_text())["sessions"][0]["title"]
        assert ["Phases"] == history_titles(page)
        assert "3" in page.locator(HISTORY_CELLS).all_inner_texts()[4]  # three turns now
        # the selection stays, its line in the new language
        page.locator("#ps-language").get_by_text("简体中文", exact=True).click()
        page.wait_for_selector("#ps-history-selected:has-text('已选择')")
        selected = page.inner_text("#ps-history-selected")
        assert "#1" in selected and "运行方式" in selected  # its line and its run line
        with page.expect_download() as download:  # its file, written at the click: it has no language
            page.click("#ps-export-json")
        assert "Phases" == json.loads(Path(download.value.path()).read_text())["sessions"][0]["title"]
        page.locator("#ps-language").get_by_text("English", exact=True).click()
        page.wait_for_selector("#ps-history-selected:has-text('Selected:')")
        page.locator(HISTORY_CELLS, has_text="Phases").first.click()
        other = open_chat(browser, url)  # a second tab with the same session selected
        open_history(other)
        other.locator(HISTORY_CELLS, has_text="Phases").first.click()
        page.click("#ps-history-delete")
        page.click("#ps-history-confirm")
        page.wait_for_function("() => !document.querySelector('#ps-history-table').innerText.includes('Phases')")
        page.wait_for_selector("#ps-history-open[disabled]")  # nothing selected any more
        other.click("#ps-history-open")  # the session the first tab deleted: said so, and not opened
        other.wait_for_selector("#ps-history-selected .ps-attention:has-text('Session 1 is no longer in the history')")
        assert "History" == other.locator("button[role=tab][aria-selected=true]").inner_text()
        other.fill("#ps-history-title textarea, #ps-history-title input", "Gone")
        other.click("#ps-history-rename")  # said so too, with the list as it is now (it was a server error)
        other.wait_for_function("() => !document.querySelector('#ps-history-table').innerText.includes('Phases')")
        assert "no longer in the history" in other.inner_text("#ps-history-selected")
        other.close()
        page.close()
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_history_over_the_export_limit_is_listed_and_says_why_it_is_not_exported(browser, tmp_path, monkeypatch):
    """The exports of all sessions were written when the tab opened: over the limit, the list came up
    empty (a server error). They are written when their button is clicked, and over the limit, the line
    under the list says why."""
    from app.bench.browser import HISTORY_CELLS, history_titles, open_history

    monkeypatch.setenv("PHASESCOPE_MAX_EXPORT_STEPS", "3")
    process, url = start_app("--db", str(tmp_path / "history.db"))
    try:
        page = open_chat(browser, url)
        set_setting(page, "ps-max-new", 4)
        send(page, "Hi")
        wait_phase(page, "done")
        open_history(page)
        assert ["Hi"] == history_titles(page)
        page.click("#ps-export-all-json")
        page.wait_for_selector("#ps-history-selected .ps-attention:has-text('over the limit of 3')")
        page.locator(HISTORY_CELLS).first.click()  # one session over the limit too: its line, and why
        page.wait_for_selector("#ps-history-selected:has-text('#1') .ps-attention:has-text('one session at a time')")
        page.close()
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.sweep  # a bench's measurement, end to end (a CLI run and a page): with the bench's in `make sweep`
def test_browser_bench_measures_the_page_against_the_cli(browser):
    from app.bench.browser import stream_vs_cli

    folders_before = set(Path(tempfile.gettempdir()).glob("phasescope-bench-*"))
    result = stream_vs_cli("int8", rounds=1, max_new_tokens=16, log=lambda line: None, browser=browser)
    assert result["cli_decode_tokens_per_s"] > 0 and result["browser_decode_tokens_per_s"] > 0
    assert 0 < result["browser_vs_cli"] < 10
    assert 0 < result["chromium_cpu_share"] < 2  # the share of a core the page took while it decoded (two here)
    # each side's stalls, the page's read back from the app's own history file, which is gone with the bench
    for side in ("page", "cli"):
        assert 0 <= result["stalls"][side]["count"] < 16 and 0 <= result["stalls"][side]["share"] < 1
    assert set(Path(tempfile.gettempdir()).glob("phasescope-bench-*")) <= folders_before


def test_stalls_are_the_gaps_of_twice_the_median_and_the_time_they_add():
    from app.bench.browser import stalls

    assert stalls([5.0] * 9 + [20.0]) == {"count": 1, "share": round(15 / 65, 3)}
    assert stalls([5.0, 6.0, 5.5]) == {"count": 0, "share": 0.0}


def _choose_precision(page, precision: str, by_keys: bool = False) -> None:
    page.locator("#ps-precision input").click()
    if by_keys:  # the option above the current one
        page.keyboard.press("ArrowUp")
        page.keyboard.press("Enter")
    else:
        page.get_by_role("option", name=precision, exact=True).click()
    page.wait_for_function(f"() => document.querySelector('#ps-precision-note [data-kpi=precision] b')"
                           f"?.innerText === '{precision}'", timeout=120_000)


# where Gradio's progress timer was shown over the selector, the model line or the note (its tracker is there
# always, hidden by a class), and what the note said, each change
WATCH_PRECISION = """(() => {
  window.progressOver = []; window.notesSaid = [];
  new MutationObserver(() => {
    for (const id of ['ps-precision', 'ps-model-line', 'ps-precision-note']) {
      const timer = document.getElementById(id)?.querySelector('.progress-text');
      if (timer && !timer.closest('.hide') && !progressOver.includes(id)) progressOver.push(id);
    }
    const note = document.querySelector('#ps-precision-note [data-kpi]')?.dataset.kpi;
    if (note && note !== notesSaid[notesSaid.length - 1]) notesSaid.push(note);
  }).observe(document, {subtree: true, childList: true, attributes: true});
})()"""


def test_precision_switch_keeps_the_app_running(page, browser, app_url):
    """Each pick switches the engine, the note saying so meanwhile, and another tab's replies follow; a page's
    load sets the selector to the running precision, which switches nothing and draws no progress over it
    (Gradio's timer flashed over the model line at each load)."""
    assert "weights int8" in page.inner_text("#ps-model-line")  # auto: int8 where the native step runs
    other = open_chat(browser, app_url, script=WATCH_PRECISION)  # a second tab, drawn before the switches
    other.wait_for_timeout(1000)  # the selector's change, after the load's redraw set it
    assert ([], ["precision"]) == (other.evaluate("progressOver"), other.evaluate("notesSaid"))
    page.evaluate(WATCH_PRECISION)
    for tab in (page, other):
        set_setting(tab, "ps-temperature", 0)
        set_setting(tab, "ps-max-new", 8)
    for precision, weights, by_keys in (("fp32", "weights float32", False), ("int8", "weights int8", True)):
        _choose_precision(page, precision, by_keys)
        assert weights in page.inner_text("#ps-model-line")
        assert "decode: fused C++" in page.inner_text("#ps-model-line")
        for tab in (page, other):  # the other tab's reply says the precision it runs in, as its selector does
            send(tab, f"Say something in {precision}.")
            wait_phase(tab, "done")
            tab.wait_for_function("() => /\\d+ tok$/.test([...document.querySelectorAll('#ps-chatbot "
                                  "[data-testid=bot]')].pop().innerText.trim())")  # the stats line: a whole reply
            assert weights in tab.inner_text("#ps-model-line") and precision == tab.input_value("#ps-precision input")
    other.close()
    note = page.inner_text("#ps-precision-note")
    assert re.search(r"int8: [\d.]+% top-1 agreement with fp32, KL [\d.]+ nats .* decode [\d.]+× fp32", note)
    assert ([], ["precision", "switching", "precision", "switching", "precision"]) == (
        page.evaluate("progressOver"), page.evaluate("notesSaid"))  # each switch said, then measured


def wait_toast(page, text: str, timeout_ms: float = 30_000) -> None:
    """A toast that says text. Where none comes, what the page showed instead: the toast of a precision switch
    that a held walk-through refuses did not come in two clean clones' runs (stop 84), and this said why: the
    switch had gone through (the sampled walk-through had ended at its second token, holding nothing)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_selector(f"[data-testid=toast-body]:has-text('{text}')", timeout=timeout_ms)
    except PlaywrightTimeout:
        shown = {"toasts": page.locator("[data-testid=toast-body]").all_inner_texts(),
                 "precision": page.input_value("#ps-precision input"),
                 "note": page.inner_text("#ps-precision-note"), "model": page.inner_text("#ps-model-line")}
        raise AssertionError(f"no toast saying {text!r} within {timeout_ms / 1000:.0f} s: {shown}") from None


def _wait_run_done(page, stall_s: float = 90) -> None:
    """Run to its end, as long as each token comes within stall_s. Run paces its tokens (RUN_STEP_S: 61
    take 18 s at least) and draws each one: at a busy hour on two cores a step and its drawing took over a
    second, and one run did not end in 180 s (stop 65): a slow run passes, a stall says where it stood."""
    state, since = None, time.monotonic()
    while True:
        now = page.evaluate("() => { const e = document.querySelector('#ps-explain-steps [data-explain]');"
                            " return e && [e.dataset.explain, e.dataset.tokens]; }")
        if now and now[0] == "done":
            return
        if now != state:
            state, since = now, time.monotonic()
        assert time.monotonic() - since < stall_s, f"Run stalled at {state} (state, tokens) for {stall_s} s"
        page.wait_for_timeout(250)


def test_explain_tab_steps_one_token_at_a_time(page, browser, app_url):
    page.get_by_role("tab", name="Explain").click()
    page.wait_for_selector("#ps-explain-tokens:has-text('5 tokens')")
    page.click("#ps-explain-next")  # before Start: nothing to step, and the prompt's tokens stay
    page.wait_for_timeout(2500)
    assert "3 characters, 9 UTF-8 bytes → 5 tokens" in page.inner_text("#ps-explain-tokens")
    assert 0 == page.locator("#ps-explain-steps [data-busy]").count()  # the panel, drawn the same, not left dim
    prompt = page.input_value("#ps-explain-prompt textarea")
    page.fill("#ps-explain-prompt textarea", "word " * 9000)  # past the context: said of a prompt, not a chat
    page.click("#ps-explain-start")
    # said where the steps show (Start runs outside Gradio's queue, which alone shows toasts)
    page.wait_for_selector("#ps-explain-steps .ps-attention:has-text('and at most 8,192 fit here: shorten it')")
    box = page.locator("#ps-explain-prompt textarea")
    box.fill("")  # typed, the tokens shown follow to the last key (they stopped at "Pref": keys dropped)
    box.press_sequentially("Prefill reads the prompt at once; decode then makes one token per step.")
    page.wait_for_selector("#ps-explain-tokens:has-text('71 characters')")
    box.fill(prompt)
    # prefill, held after its token; the panel dims from the click until it is drawn, with no progress
    # animated meanwhile (drawing it shared the two cores with the forward)
    assert page.evaluate("""() => new Promise(done => {
        document.querySelector('#ps-explain-start').click();
        const look = () => document.querySelector('#ps-explain-steps .ps-explain[data-busy]') ? done(true)
            : document.querySelector('#ps-explain-steps [data-explain=held]') ? done(false)
            : requestAnimationFrame(look);
        look(); })""")
    page.wait_for_selector("#ps-explain-steps [data-explain=held][data-tokens='1']", timeout=60_000)
    assert 0 == page.locator("#ps-explain-steps [data-busy], #ps-explain-steps .wrap.default").count()
    assert "Prefill" in page.inner_text("#ps-explain-steps")
    assert "Prefill is compute-bound" in page.inner_text("#ps-explain-steps")
    assert re.search(r"attention\s+q \[\d+, 9, 64\]", page.inner_text("#ps-explain-pipeline"))  # prefill's shapes
    page.click("#ps-explain-next")  # exactly one decode step
    page.wait_for_selector("#ps-explain-steps [data-explain=held][data-tokens='2']", timeout=60_000)
    page.locator("#ps-explain-steps").click()  # focus out of the prompt box: → is "next token"
    page.keyboard.press("ArrowRight")
    page.wait_for_selector("#ps-explain-steps [data-explain=held][data-tokens='3']", timeout=60_000)
    assert re.search(r"Its forward took [\d.]+ ms, .* decode is memory-bound", page.inner_text("#ps-explain-steps"))
    assert "id " in page.get_attribute("#ps-explain-steps .ps-tok >> nth=0", "title")
    steps = page.inner_text("#ps-explain-steps")
    assert "Decode step 2" in steps and "hidden state [1, 576]" in steps
    assert "attention to each earlier token (mean of all layers, mean of all heads" in steps
    shaded = page.locator("#ps-explain-steps .ps-tok[style*=box-shadow]").count()
    assert shaded == len(page.locator("#ps-explain-steps .ps-tok").all()) - 1  # all but the step's own output
    grid = page.evaluate("() => document.querySelector('#ps-explain-kv .js-plotly-plot').data[0]")
    assert 30 == len(grid["z"]) and [1, 2] == sorted(set(grid["z"][0]))[-2:]  # layers; prefill and decode columns
    assert len(grid["x"]) == len(grid["z"][0])
    candidates = page.evaluate("() => document.querySelector('#ps-explain-candidates .js-plotly-plot').data[0]")
    assert 5 == len(candidates["x"]) and abs(sum(candidates["x"])) <= 1.0
    other = open_chat(browser, app_url)  # a second tab's walk-through runs beside this one's, not after it
    other.get_by_role("tab", name="Explain").click()
    other.click("#ps-explain-start")
    other.wait_for_selector("#ps-explain-steps [data-explain=held][data-tokens='1']", timeout=60_000)
    page.click("#ps-explain-run")
    other.click("#ps-explain-run")
    other.wait_for_function("() => document.querySelector('#ps-explain-steps [data-explain]')?.dataset.tokens >= 4",
                            timeout=60_000)
    assert page.locator("#ps-explain-steps [data-explain=running]").count() == 1
    other.click("#ps-explain-stop")
    page.click("#ps-explain-pause")
    # each says so after the Run has ended (a Run's last frame, drawn again as it ended, said "running")
    for tab, state in ((other, "done"), (page, "held")):
        tab.wait_for_selector(f"#ps-explain-steps [data-explain={state}]", timeout=30_000)
    page.wait_for_timeout(1500)
    assert 1 == other.locator("#ps-explain-steps [data-explain=done]").count()
    assert 1 == page.locator("#ps-explain-steps [data-explain=held]").count()
    other.close()
    # a Run to the reply's end (at Run's pace a 64-token one took 18 s; this prompt's greedy reply: "Yes.")
    page.fill("#ps-explain-prompt textarea", "Reply with one word: yes or no?")
    page.click("#ps-explain-start")
    page.wait_for_selector("#ps-explain-steps [data-explain=held][data-tokens='1']", timeout=60_000)
    page.click("#ps-explain-run")
    _wait_run_done(page)
    set_setting(page, "ps-explain-temperature", 0.8)  # sampled: the chances after the cut-offs beside the model's
    set_setting(page, "ps-explain-top-k", 2)
    # a reply that goes on: sampled, "yes or no?" could end at its second token ("Yes" and the end), and an
    # ended walk-through holds nothing, so that the precision switch below went through (stop 84)
    page.fill("#ps-explain-prompt textarea", "Tell me a long story about a lighthouse keeper.")
    page.click("#ps-explain-start")
    page.wait_for_selector("#ps-explain-steps [data-explain=held][data-tokens='1']", timeout=60_000)
    page.click("#ps-explain-next")
    page.wait_for_selector("#ps-explain-steps [data-explain=held][data-tokens='2']", timeout=60_000)
    series = page.evaluate("() => document.querySelector('#ps-explain-candidates .js-plotly-plot').data"
                           ".map(d => [d.name, d.x])")
    assert ["model", "after the cut-offs"] == [name for name, _ in series]
    assert [0, 0, 0] == series[1][1][2:]  # top-k 2 cut the third to fifth
    # the held walk-through keeps the precision as it is, and the one warning says where it is
    page.get_by_role("tab", name="Chat").click()
    page.locator("#ps-precision input").click()
    page.get_by_role("option", name="fp32", exact=True).click()
    wait_toast(page, "walk-through holds a reply")
    page.wait_for_timeout(500)
    assert 1 == page.locator("[data-testid=toast-body]:has-text('walk-through holds a reply')").count()
    assert "weights int8" in page.inner_text("#ps-model-line") and "int8" == page.input_value("#ps-precision input")
    page.get_by_role("tab", name="Explain").click()
    page.click("#ps-explain-stop")


def test_a_walk_through_held_by_a_page_ends_when_the_page_closes(browser, app_url):
    """Gradio keeps a closed page's state for an hour: its walk-through stayed held in the engine that long,
    and every page's precision switch was refused meanwhile ("1 replies are running or waiting")."""
    page, other = open_chat(browser, app_url), open_chat(browser, app_url)
    page.get_by_role("tab", name="Explain").click()
    page.click("#ps-explain-start")
    page.wait_for_selector("#ps-explain-candidates .js-plotly-plot")
    other.reload()
    other.wait_for_selector("#ps-pool:has-text('held by 1 request')")
    page.close()
    deadline = time.monotonic() + 30
    while "held by 0 requests" not in other.inner_text("#ps-pool"):  # the gauge is drawn at a page's load
        assert time.monotonic() < deadline, other.inner_text("#ps-pool")
        other.wait_for_timeout(500)
        other.reload()
        other.wait_for_selector("#ps-pool .ps-pool")
    other.close()


def test_the_page_in_chinese_steps_through_the_classic_prompt_offline(browser, app_url, tmp_path):
    """中文: labels, chart titles and an error message change; 「我是小」 is stepped through three
    tokens with the candidates, cache, attention and each stage's time; nothing comes from elsewhere."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, locale="zh-CN")
    hosts = set()
    page.on("request", lambda request: hosts.add(re.match(r"\w+://[^/]+", request.url).group(0)))
    page.goto(app_url)
    page.wait_for_selector("#ps-message textarea")
    # a zh-CN browser gets Chinese on its first visit
    page.wait_for_function("() => document.querySelector('#ps-send')?.innerText.trim() === '发送'")
    page.get_by_role("tab", name="讲解").wait_for(timeout=10_000)
    assert page.get_by_role("tab", name="历史").is_visible()
    assert "就绪" in page.inner_text("#ps-phase")
    page.wait_for_function("() => document.querySelector('#ps-latency .js-plotly-plot')?.layout.title.text "
                           "=== '每一步的延迟'")
    page.get_by_role("tab", name="讲解").click()
    page.fill("#ps-explain-prompt textarea", "   ")
    page.click("#ps-explain-start")
    page.wait_for_selector("#ps-explain-steps .ps-attention:has-text('消息为空')", timeout=30_000)  # in Chinese
    assert "zh-CN" == page.evaluate("() => document.documentElement.lang")  # the page says its language
    page.fill("#ps-explain-prompt textarea", "我是小")
    page.click("#ps-explain-start")
    page.wait_for_selector("#ps-explain-steps [data-explain=held][data-tokens='1']", timeout=60_000)
    assert "预填充" in page.inner_text("#ps-explain-steps")
    for tokens in (2, 3):
        page.click("#ps-explain-next")
        page.wait_for_selector(f"#ps-explain-steps [data-explain=held][data-tokens='{tokens}']", timeout=60_000)
    steps = page.inner_text("#ps-explain-steps")
    assert "解码第 2 步" in steps and "访存密集型" in steps
    pipeline = page.inner_text("#ps-explain-pipeline")
    assert "自注意力" in pipeline and "K,V [" in pipeline and re.search(r"\d\.\d\d ms", pipeline)
    title = page.evaluate("() => document.querySelector('#ps-explain-candidates .js-plotly-plot').layout.title.text")
    assert title.startswith("第 3 个词元的候选")
    assert page.locator("#ps-explain-steps .ps-tok[style*=box-shadow]").count() > 0  # the attention strip
    page.screenshot(path=str(tmp_path / "explain-zh.png"), full_page=True)
    page.get_by_role("tab", name="对话").click()  # a precision switch the held walk-through refuses: a toast
    page.locator("#ps-precision input").click()
    page.get_by_role("option", name="fp32", exact=True).click()
    wait_toast(page, "讲解")
    heading = page.evaluate("() => getComputedStyle(document.querySelector('.toast-title.warning'), '::before')"
                            ".content")
    assert '"提示"' == heading  # the toast's heading in Chinese too (Gradio writes "Warning")
    page.get_by_role("tab", name="讲解").click()
    # and back: the choice is remembered by this browser
    page.locator("#ps-language").get_by_text("English", exact=True).click()
    page.wait_for_function("() => document.querySelector('#ps-explain-start')?.innerText.trim() === 'Start'")
    page.wait_for_selector("#ps-explain-steps:has-text('Decode step 2')", timeout=10_000)  # redrawn in English
    page.reload()
    page.wait_for_selector("#ps-message textarea")
    page.wait_for_timeout(1000)
    assert "Send" == page.inner_text("#ps-send").strip()
    assert {app_url.rstrip("/")} == hosts  # offline: no font, script or call to any other host
    page.close()


def test_lab_tab_runs_an_experiment_and_reopens_it(page, app_db, tmp_path, browser, app_url):
    """The Lab tab: one experiment run from the browser draws both settings in one figure with its table,
    is saved in the database file, comes back from the saved runs, and reads in Chinese on a switch."""
    other = open_chat(browser, app_url)  # a second tab, whose Run waits behind this one's
    other.get_by_role("tab", name="Lab").click()
    other.locator("#ps-lab-quick input").check()
    page.get_by_role("tab", name="Lab").click()
    # nothing saved yet: the list and Open are off, and the list says why
    page.wait_for_selector("#ps-lab-runs:has-text('None yet')")
    assert page.is_disabled("#ps-lab-open") and page.is_disabled("#ps-lab-runs input")
    page.locator("#ps-lab-experiment input").click()
    page.get_by_role("option", name="Batching", exact=True).click()
    page.wait_for_function("() => document.querySelector('#ps-lab-prompt textarea').value.includes('poem')")
    page.locator("#ps-lab-quick input").check()
    page.click("#ps-lab-run")
    page.wait_for_function("() => document.querySelector('#ps-lab-status').innerText.includes('Running')")
    other.click("#ps-lab-run")
    other.wait_for_function("() => document.querySelector('#ps-lab-status').innerText.includes('queue')")
    other.click("#ps-lab-stop")  # while it waits its turn: it ends before it begins (saved runs: below)
    other.wait_for_function("() => document.querySelector('#ps-lab-status').innerText.includes('Stopped')",
                            timeout=120_000)
    other.close()
    page.wait_for_selector("#ps-lab-plot .js-plotly-plot", timeout=120_000)
    page.wait_for_function("() => document.querySelector('#ps-lab-status').innerText.includes('saved as lab run')")
    assert plot_traces(page, "ps-lab-plot") == {"batching · aggregate decode": 3}  # B = 1, 2, 4
    assert page.is_enabled("#ps-lab-open") and "None yet" not in page.inner_text("#ps-lab-runs")
    report = page.inner_text("#ps-lab-report")
    assert "aggregate tok/s" in report and "shown: batching raises aggregate throughput" in report
    with page.expect_download() as download:  # the run as JSON, written in the app's private folder
        page.click("#ps-lab-json")
    assert json.loads(Path(download.value.path()).read_text(encoding="utf-8"))["experiment"] == "batching"
    with page.expect_download() as download:  # the figure as a page that opens offline, written at the click
        page.click("#ps-lab-html")
    assert download.value.suggested_filename.endswith("-batching-en.html")
    assert "Plotly.newPlot" in Path(download.value.path()).read_text(encoding="utf-8")
    size = page.viewport_size
    page.set_viewport_size({"width": 390, "height": 844})  # a phone: whole words in the table, which scrolls alone
    page.wait_for_function("() => document.documentElement.scrollWidth <= 390")
    assert [] == words_broken_in_cells(page, "#ps-lab-report :is(td, th)")  # "requests" was a letter per line
    page.set_viewport_size(size)
    page.screenshot(path=str(tmp_path / "lab.png"), full_page=True)

    page.locator("#ps-lab-experiment input").click()
    page.get_by_role("option", name="KV cache on/off", exact=True).click()
    page.locator("#ps-lab-quick input").check()
    page.fill("#ps-lab-prompt textarea", "")  # runs the experiment's own prompt, and the box says which
    page.click("#ps-lab-run")
    page.wait_for_function("() => document.querySelector('#ps-lab-prompt textarea').value.includes('KV cache is')")
    page.wait_for_function("() => document.querySelector('#ps-lab-status').innerText.includes('lab run #2')",
                           timeout=120_000)
    names = set(plot_traces(page, "ps-lab-plot"))
    assert {"KV cache · ms per token", "no KV cache · ms per token"} <= names  # both settings drawn

    from app.history.store import Store
    saved = Store.open(app_db).lab_runs()
    assert [row["experiment"] for row in saved[:2]] == ["kv-cache", "batching"]
    page.locator("#ps-lab-runs input").click()
    page.get_by_role("option", name=re.compile(r"#1 · Batching")).click()
    page.locator("#ps-lab-quick input").uncheck()
    page.click("#ps-lab-open")
    page.wait_for_function("() => document.querySelector('#ps-lab-report').innerText.includes('aggregate tok/s')")
    assert set(plot_traces(page, "ps-lab-plot")) == {"batching · aggregate decode"}
    # with what it ran: Run repeats it
    page.wait_for_function("() => document.querySelector('#ps-lab-prompt textarea').value.includes('poem')")
    assert page.input_value("#ps-lab-experiment input") == "Batching" and page.is_checked("#ps-lab-quick input")

    # the run on show is drawn again in the page's new language
    page.locator("#ps-language").get_by_text("简体中文", exact=True).click()
    page.wait_for_function("() => document.querySelector('#ps-lab-report').innerText.includes('总词元/秒')")
    assert "已显示：批处理提高总吞吐" in page.inner_text("#ps-lab-report")
    assert set(plot_traces(page, "ps-lab-plot")) == {"批处理 · 总解码吞吐"}
    page.screenshot(path=str(tmp_path / "lab-zh.png"), full_page=True)
    # Run clicked again while it runs, then Stop: the run stops (the second click's Stop event had taken the
    # place of the first's, and the run went on to the end). A run long enough to be stopped: the quick
    # Batching run takes 0.6 s, over before the Stop; the full KV cache one ~11 s, its second setting ~5 s in
    page.locator("#ps-lab-experiment input").click()
    page.get_by_role("option", name="KV 缓存开/关", exact=True).click()
    page.locator("#ps-lab-quick input").uncheck()
    saved_before = len(Store.open(app_db).lab_runs())
    page.click("#ps-lab-run")
    page.wait_for_function("() => document.querySelector('#ps-lab-status').innerText.includes('运行中')")
    page.click("#ps-lab-run")
    page.wait_for_timeout(300)
    page.click("#ps-lab-stop")
    page.wait_for_function("() => document.querySelector('#ps-lab-status').innerText.includes('已停止')",
                           timeout=120_000)
    assert saved_before == len(Store.open(app_db).lab_runs())


def test_chat_with_a_remote_endpoint_from_the_page(page, app_db):
    """The backend selector: the same chat against an OpenAI-compatible server (here `phasescope serve`),
    measured from the app's side, its session saved with the endpoint."""
    from tests.test_serve import start_server

    process, url = start_server()
    try:
        page.click("#ps-backend button")
        page.get_by_label("An OpenAI-compatible endpoint", exact=False).check()
        page.fill("#ps-endpoint-url textarea, #ps-endpoint-url input", "http://127.0.0.1:1")  # nothing listens
        page.click("#ps-use-backend")
        page.wait_for_selector("#ps-model-line .ps-attention")  # why not, under the engine the chat keeps
        assert "SmolLM2-135M-Instruct" in page.inner_text("#ps-model-line")
        page.fill("#ps-endpoint-url textarea, #ps-endpoint-url input", url)
        page.click("#ps-use-backend")
        page.wait_for_function("() => document.querySelector('#ps-model-line').innerText.includes('client-side')")
        assert 0 == page.locator("#ps-model-line .ps-attention").count()
        assert f"{url}/v1" in page.inner_text("#ps-model-line")
        set_setting(page, "ps-temperature", 0)
        set_setting(page, "ps-max-new", 12)
        send(page, "Say hello to the class.")
        assert "done" == wait_phase(page, "done", "error")
        page.wait_for_timeout(500)
        reply = page.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
        assert re.search(r"TTFT \d[\d,]* ms", reply), reply
        assert plot_traces(page, "ps-latency")["decode"] >= 2  # a point per streamed chunk
        # a second turn, whose prompt the server takes from its prefix cache: said in the prompt tile; the
        # server's KV cache itself is out of sight, so neither turn is drawn in the KV chart or its tile
        send(page, "And now say goodbye.")
        page.wait_for_function("() => document.querySelectorAll('#ps-chatbot [data-testid=bot]').length == 2 "
                               "&& document.querySelector('#ps-phase [data-phase=done]')", timeout=120_000)
        page.wait_for_timeout(500)
        assert re.search(r"TTFT \d[\d,]* ms", page.locator("#ps-chatbot [data-testid=bot]").last.inner_text())
        assert re.fullmatch(r"cached [1-9][\d,]* / [\d,]+", kpi_note(page, "prompt_tokens"))
        assert not any(name.startswith("turn") for name in plot_traces(page, "ps-kv"))
        assert page.inner_text('#ps-kpis [data-kpi="kv"]') == "KV cache · on the server\n–"
        assert "" == page.inner_text("#ps-pool").strip()  # this machine's pool is not this chat's
        toasts = page.locator("[data-testid=toast-body]").all_inner_texts()
        assert not toasts, toasts
        page.click("#ps-new")  # a new chat goes on with the backend chosen, as the model line says
        page.wait_for_function("() => !document.querySelector('#ps-chatbot [data-testid=bot]')")
        send(page, "One more thing.")
        page.wait_for_function("() => document.querySelectorAll('#ps-chatbot [data-testid=bot]').length == 1 "
                               "&& document.querySelector('#ps-phase [data-phase=done]')", timeout=120_000)
        assert f"{url}/v1" in page.inner_text("#ps-model-line")
        assert page.inner_text('#ps-kpis [data-kpi="kv"]').startswith("KV cache · on the server")
        from app.history.store import Store
        sessions = {s["title"]: s["device"] for s in Store.open(app_db).sessions()}
        assert sessions["Say hello to the class."] == sessions["One more thing."] == f"endpoint {url}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)
