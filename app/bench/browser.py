"""The app in a real browser: helpers to drive `phasescope ui` in Debian's Chromium through Playwright
(the browser tests use them), and `phasescope bench --browser`: decode speed seen in the page against the
same reply from the CLI."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .load import TICK_S, process_stat

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(*args: str, timeout_s: float = 180) -> tuple[subprocess.Popen, str]:
    """Start `phasescope ui` on a free port, as a user would; return the process and its URL. Its output
    (stdout and stderr) is read on a thread into process.output, its last lines, as it comes: a pipe nobody
    reads fills up (64 KB) and then blocks the app at its next print."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "ui", "--port", str(port), *args], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    process.output = deque(maxlen=2000)
    deadline = time.monotonic() + timeout_s
    for line in process.stdout:
        process.output.append(line)
        if "running at" in line:
            threading.Thread(target=process.output.extend, args=(process.stdout,), daemon=True).start()
            url = re.search(r"http://\S+", line).group(0)
            _wait_http(url, deadline)
            return process, url
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError(f"the app did not start: {''.join(process.output)}{process.stdout.read()}")


def _wait_http(url: str, deadline: float) -> None:
    import urllib.request

    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer")


def launch_browser(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)


def open_chat(browser, url: str, model_drawn: bool = True, color_scheme: str = "light", script: str = ""):
    """A new page on the app's chat; with model_drawn, once the page has drawn what shows the loaded
    model (model line, precision list: drawn on load, after the model has loaded behind the page).
    color_scheme: what the browser prefers, "light" or "dark" (Gradio follows it); script: JavaScript the
    page runs before its own."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, color_scheme=color_scheme)
    if script:
        page.add_init_script(script)
    page.goto(url)
    page.wait_for_selector("#ps-message textarea")
    if model_drawn:
        page.wait_for_selector("#ps-model-line .ps-model:not([data-loading])", timeout=120_000)
    return page


def set_setting(page, elem_id: str, value: float) -> None:
    """Type a value into a slider's number box in the Settings accordion, until it holds: typed just as the
    accordion opens, the slider may still be drawing and put its old value back (a reply then ran with the
    default 256 new tokens instead of 8, one time in three in a fresh page)."""
    if not page.is_visible(f"#{elem_id} input[type=number]"):
        page.click("#ps-settings button")
    box = page.locator(f"#{elem_id} input[type=number]")
    low, high = (float(box.get_attribute(name) or default) for name, default in (("min", "-inf"), ("max", "inf")))
    expected = min(max(float(value), low), high)  # the slider keeps a value past its end at the end
    for _ in range(10):
        box.fill(str(value))
        box.press("Enter")
        box.blur()
        page.wait_for_timeout(50)
        if float(box.input_value() or "nan") == expected:
            return
    raise AssertionError(f"{elem_id} would not take {value}: it holds {box.input_value()}")


def send(page, text: str) -> None:
    page.fill("#ps-message textarea", text)
    page.click("#ps-send")


def wait_phase(page, *phases: str, timeout_ms: int = 180_000) -> str:
    """The phase line showing one of phases; if it does not in time, an error that says what the page shows."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    selector = ", ".join(f"#ps-phase [data-phase={p}]" for p in phases)
    try:
        page.wait_for_selector(selector, timeout=timeout_ms)
    except PlaywrightTimeout:
        shown = page.evaluate("() => [document.querySelector('#ps-phase [data-phase]')?.dataset.phase, "
                              "[...document.querySelectorAll('#ps-chatbot [data-testid]')].slice(-2)"
                              ".map(m => m.innerText.slice(-300))]")
        raise AssertionError(f"no phase {'/'.join(phases)} in {timeout_ms / 1000:g} s: the page shows phase "
                             f"{shown[0]!r}, its last two messages {shown[1]!r}") from None
    return page.get_attribute("#ps-phase [data-phase]", "data-phase")


def kpi(page, key: str) -> str:
    return page.inner_text(f'#ps-kpis [data-kpi="{key}"] .ps-value')


def kpi_note(page, key: str) -> str:
    """The small line under a tile's value (e.g. the prompt tile's cached tokens)."""
    return page.inner_text(f'#ps-kpis [data-kpi="{key}_note"]')


def plot_traces(page, elem_id: str) -> dict[str, int]:
    """Trace name -> number of points, read from the plotly figure in the page, once it is drawn (a page
    loads plotly.js after its controls: static/phasescope.js)."""
    page.wait_for_selector(f"#{elem_id} .js-plotly-plot", state="attached", timeout=30_000)
    return page.evaluate(f"""() => {{
        const plot = document.querySelector('#{elem_id} .js-plotly-plot');
        if (!plot) return {{}};
        return Object.fromEntries(plot.data.map(t => [t.name, (t.x || []).filter(v => v !== null).length]));
    }}""")


HISTORY_CELLS = "#ps-history-table .virtual-row .body-cell"


def open_history(page) -> None:
    page.get_by_role("tab", name="History").click()
    page.locator(HISTORY_CELLS).first.wait_for()


def history_titles(page) -> list[str]:
    """The title column of the History table (the second of seven columns)."""
    cells = page.locator(HISTORY_CELLS).all_inner_texts()
    return [cells[i] for i in range(1, len(cells), 7)]


PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _cli_decode(precision: str, max_new_tokens: int) -> tuple[float, list[float]]:
    """The reply from `phasescope generate`: its decode tok/s and the gaps between its tokens (ms)."""
    out = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--prompt", PROMPT, "--temperature", "0",
                          "--max-new-tokens", str(max_new_tokens), "--precision", precision, "--json"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    metrics = json.loads(out.splitlines()[-1])["metrics"]
    return metrics["decode_tokens_per_s"], metrics["itl_ms"]


def _page_gaps(db: Path, min_tokens: int) -> list[list[float]]:
    """The gaps between the tokens (ms) of each reply of at least min_tokens the page's app saved in db."""
    from ..history.recorder import message_metrics
    from ..history.store import Store

    store = Store.open(db, repair=False)
    try:
        metrics = [message_metrics(message, store.steps(message["id"]))
                   for session in store.sessions() for message in store.messages(session["id"])
                   if message["role"] == "assistant"]
    finally:
        store.close()
    return [m.itl_ms for m in metrics if m.num_generated_tokens >= min_tokens]


def stalls(gaps_ms: list[float]) -> dict:
    """The gaps between tokens at least twice the reply's median gap: how many, and the share of the decode
    time they took beyond the median (on two cores, each page update that takes a core stalls the decode
    step it lands in: that share is most of what the page costs decode)."""
    typical = statistics.median(gaps_ms)
    slow = [gap for gap in gaps_ms if gap >= 2 * typical]
    return {"count": len(slow), "share": round(sum(gap - typical for gap in slow) / sum(gaps_ms), 3)}


def _median_stalls(replies: list[list[float]]) -> dict | None:
    found = [stalls(gaps) for gaps in replies if gaps]
    if not found:
        return None
    return {"count": statistics.median(s["count"] for s in found),
            "share": statistics.median(s["share"] for s in found)}


def chromium_cpu_s() -> float | None:
    """CPU seconds used so far by the Chromium processes alive (every one on the machine), from Linux's
    /proc; None elsewhere."""
    if not Path("/proc/self/stat").exists():
        return None
    ticks = 0
    for found in map(process_stat, Path("/proc").glob("[0-9]*/stat")):
        if found is not None and found[0] == "chromium":  # (None: ended meanwhile)
            ticks += int(found[1][11]) + int(found[1][12])  # user and system time
    return ticks * TICK_S


def _page_decode(page, max_new_tokens: int) -> tuple[float, float | None]:
    """A greedy reply in the page: its decode tok/s (the page's tile), and the share of a core Chromium
    used from the click to the reply's end (None where it cannot be read)."""
    page.click("#ps-new")
    page.wait_for_selector("#ps-phase .ps-idle")
    set_setting(page, "ps-temperature", 0)
    set_setting(page, "ps-repetition-penalty", 1)  # off, as in `phasescope generate`: the same tokens
    set_setting(page, "ps-max-new", max_new_tokens)
    # typed, then sent a second later, as a person would: the page has finished with the new chat and the
    # settings (Gradio events, ~0.3 s of the page's CPU), which sent at once ran into the decode measured
    page.fill("#ps-message textarea", PROMPT)
    page.wait_for_timeout(1000)
    cpu_before, start = chromium_cpu_s(), time.monotonic()
    page.click("#ps-send")
    # poll twice a second: Playwright's default polls every frame, which makes the page draw all the time
    page.wait_for_function("() => !!document.querySelector('#ps-phase [data-phase=done]')", polling=500,
                           timeout=300_000)
    cpu_after, wall = chromium_cpu_s(), time.monotonic() - start
    share = None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before) / wall
    return float(kpi(page, "decode_tps").split()[0].replace(",", "")), share


def stream_vs_cli(precision: str, rounds: int = 3, max_new_tokens: int = 128, log=print, browser=None) -> dict:
    """Decode tok/s of a greedy reply streamed to the page vs the same reply from `phasescope generate`
    (same tokens), in alternating rounds after a warm-up; medians and their ratio, and the share of a core
    Chromium used from each click to the reply's end (what decode competes with for the cores), and the
    stalls of each side's decode (see stalls). The app keeps its history in a file of its own, deleted
    after: the bench's chats stay out of the user's History. browser: a Playwright browser to use (else
    one is launched)."""
    cli, cli_gaps, page_speeds, shares = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="phasescope-bench-") as folder:
        db = Path(folder) / "history.db"
        process, url = start_app("--precision", precision, "--db", str(db))
        try:
            with _browser(browser) as chromium:
                page = open_chat(chromium, url)
                _page_decode(page, 8)
                for _ in range(rounds):
                    speed, gaps = _cli_decode(precision, max_new_tokens)
                    cli.append(speed)
                    cli_gaps.append(gaps)
                    speed, share = _page_decode(page, max_new_tokens)
                    page_speeds.append(speed)
                    shares += [] if share is None else [share]
                    log(f"  browser {precision}: CLI {cli[-1]:.1f} tok/s, page {speed:.1f} tok/s"
                        + ("" if share is None else f", Chromium {share:.2f} of a core"))
                page.close()
        finally:
            process.terminate()
            process.wait(timeout=30)
        page_gaps = _page_gaps(db, max_new_tokens)
    cli_tps, page_tps = statistics.median(cli), statistics.median(page_speeds)
    return {"cli_decode_tokens_per_s": round(cli_tps, 1), "browser_decode_tokens_per_s": round(page_tps, 1),
            "browser_vs_cli": round(page_tps / cli_tps, 3), "rounds": rounds, "tokens": max_new_tokens,
            "chromium_cpu_share": round(statistics.median(shares), 3) if shares else None,
            "stalls": {"page": _median_stalls(page_gaps), "cli": _median_stalls(cli_gaps)}}


@contextmanager
def _browser(given=None) -> Iterator:
    if given is not None:
        yield given
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = launch_browser(playwright)
        try:
            yield chromium
        finally:
            chromium.close()


def browser_available() -> str | None:
    """None when the browser bench can run here, else why not."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} not installed (apt-get install -y chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "Playwright for Python is not installed (pip install playwright)"
    return None
