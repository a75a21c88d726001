"""A bounded soak on loopback (`make soak`, not in `make test`): 8 clients, browser tabs and API clients
mixed, chatting with `phasescope serve --ui` for PHASESCOPE_SOAK_S seconds (default 180). No errors, no
cross-talk (each client asks for its own word back and checks its own conversation), every browser message
stored, and afterwards no request running, no KV block held, and the server's resident memory back to its
baseline but for the blocks kept for prefix reuse (start/peak/end RSS printed)."""
from __future__ import annotations

import os
import re
import threading
import time
import urllib.request

import pytest

from app.bench.browser import launch_browser, send, set_setting
from app.history.store import Store
from tests.test_serve import MODEL, start_server

pytestmark = [pytest.mark.soak, pytest.mark.browser, pytest.mark.model]
SOAK_S = float(os.environ.get("PHASESCOPE_SOAK_S", 180))
BLOCK_MB = 16 * 46_080 / 2**20  # the bundled model's KV block: 16 tokens x 46,080 B (fp32 cache)
WORDS = ["amber", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="utf-8") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def gauge(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return float(re.search(rf"^phasescope:{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def test_eight_clients_for_minutes(tmp_path):
    from openai import OpenAI
    from playwright.sync_api import sync_playwright

    db = tmp_path / "h.db"
    process, url = start_server("--ui", "--db", str(db))
    errors: list[str] = []
    counts = {word: 0 for word in WORDS}
    rss = {"start": rss_mb(process.pid), "peak": 0.0}
    deadline = time.monotonic() + SOAK_S

    def api_client(word: str) -> None:
        client = OpenAI(base_url=f"{url}/v1", api_key="x", timeout=120, max_retries=0)
        history = []
        while time.monotonic() < deadline:
            history.append({"role": "user", "content": f"Say the word {word}."})
            stream = client.chat.completions.create(model=MODEL, messages=history[-6:], max_tokens=24,
                                                    temperature=0, stream=True)
            reply = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            history.append({"role": "assistant", "content": reply})
            others = [w for w in WORDS if w != word and w in reply.lower()]
            if others:
                errors.append(f"{word}: another client's word in its reply: {others}")
            counts[word] += 1

    def browser_client(word: str) -> None:
        with sync_playwright() as playwright:
            browser = launch_browser(playwright)
            page = browser.new_page()
            page.goto(f"{url}/ui/")
            page.wait_for_selector("#ps-message textarea", timeout=60_000)
            set_setting(page, "ps-max-new", 24)
            set_setting(page, "ps-temperature", 0)
            while time.monotonic() < deadline:
                before = page.locator("#ps-chatbot [data-testid=bot]").count()
                send(page, f"Say the word {word}.")
                # the new reply, closed with its stats line (or a warning)
                page.wait_for_function(
                    "(n) => { const b = document.querySelectorAll('#ps-chatbot [data-testid=bot]'); "
                    "return b.length > n && /· \\d+ tok|⚠️/.test(b[b.length - 1].innerText); }", arg=before,
                    timeout=180_000)
                reply = page.locator("#ps-chatbot [data-testid=bot]").last.inner_text()
                if "⚠️" in reply:
                    errors.append(f"{word}: a browser reply failed: {reply[:200]}")
                counts[word] += 1
            chat = page.inner_text("#ps-chatbot")
            if any(f"Say the word {w}." in chat for w in WORDS if w != word):
                errors.append(f"{word}: another tab's message in its chat")
            browser.close()

    def watch() -> None:
        while time.monotonic() < deadline + 5:
            rss["peak"] = max(rss["peak"], rss_mb(process.pid))
            time.sleep(1)

    threads = [threading.Thread(target=api_client if i % 2 else browser_client, args=(word,))
               for i, word in enumerate(WORDS)] + [threading.Thread(target=watch)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(SOAK_S + 300)
        time.sleep(12)  # idle: the server hands freed memory back (app.main)
        rss["end"] = rss_mb(process.pid)
        running, usage = gauge(url, "num_requests_running"), gauge(url, "kv_cache_usage_perc")
        cached = gauge(url, "kv_cache_cached_blocks")
    finally:
        process.terminate()
        process.wait(timeout=30)
    print(f"\nsoak {SOAK_S:.0f} s: replies per client {counts}; RSS start {rss['start']:.0f} MB, peak "
          f"{rss['peak']:.0f} MB, end {rss['end']:.0f} MB; KV pool in use after: {usage:.1%}, blocks kept for prefix "
          f"reuse: {cached:.0f} ({cached * BLOCK_MB:.0f} MB, pages of the pool first touched during the load)")
    assert not errors, errors[:5]
    assert all(count >= 2 for count in counts.values()), counts
    assert running == 0 and usage == 0
    # memory back to its baseline but for the prefix cache's blocks, kept on purpose (bounded by --kv-cache-mb)
    assert rss["end"] - cached * BLOCK_MB <= rss["start"] + 100
    store = Store.open(db)
    stored = [m for s in store.sessions() for m in store.messages(s["id"]) if m["role"] == "user"]
    browser_sent = sum(counts[w] for i, w in enumerate(WORDS) if i % 2 == 0)
    assert len(stored) == browser_sent  # every browser message saved (API calls are not chats)
