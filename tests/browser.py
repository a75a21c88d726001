"""Helpers to drive the running app in Debian's Chromium through Playwright (tests and benchmarks)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(*args: str, timeout_s: float = 180) -> tuple[subprocess.Popen, str]:
    """Start `phasescope ui` on a free port, as a user would; return the process and its URL."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "ui", "--port", str(port), *args], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout_s
    for line in process.stdout:
        if "running at" in line:
            url = re.search(r"http://\S+", line).group(0)
            _wait_http(url, deadline)
            return process, url
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError(f"the app did not start: {process.stdout.read() if process.stdout else ''}")


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


def open_chat(browser, url: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    page.wait_for_selector("#ps-message textarea")
    return page


def set_setting(page, elem_id: str, value: float) -> None:
    """Type a value into a slider's number box in the Settings accordion."""
    if not page.is_visible(f"#{elem_id} input[type=number]"):
        page.click("#ps-settings button")
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")
    box.blur()


def send(page, text: str) -> None:
    page.fill("#ps-message textarea", text)
    page.click("#ps-send")


def wait_phase(page, *phases: str, timeout_ms: int = 180_000) -> str:
    selector = ", ".join(f"#ps-phase [data-phase={p}]" for p in phases)
    page.wait_for_selector(selector, timeout=timeout_ms)
    return page.get_attribute("#ps-phase [data-phase]", "data-phase")


def kpi(page, key: str) -> str:
    return page.inner_text(f'#ps-kpis [data-kpi="{key}"] .ps-value')


def kpi_note(page, key: str) -> str:
    """The small line under a tile's value (e.g. the prompt tile's cached tokens)."""
    return page.inner_text(f'#ps-kpis [data-kpi="{key}_note"]')


def plot_traces(page, elem_id: str) -> dict[str, int]:
    """Trace name -> number of points, read from the plotly figure in the page."""
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
