"""Decode speed of a reply streamed to a real browser vs the same reply from the CLI.

Starts `phasescope ui`, drives Debian's Chromium with Playwright, and alternates with
`phasescope generate --json` on the same prompt (greedy, so both produce the same tokens).
Prints the medians and their ratio.
Usage: .venv/bin/python scripts/ui_stream_bench.py [--rounds 3] [--precision int8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from browser import kpi, launch_browser, open_chat, send, set_setting, start_app, wait_phase  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def cli_run(max_new_tokens: int, precision: str) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--prompt", PROMPT, "--temperature", "0",
                          "--max-new-tokens", str(max_new_tokens), "--precision", precision, "--json"],
                         capture_output=True, text=True, check=True).stdout
    metrics = json.loads(out.splitlines()[-1])["metrics"]
    return metrics["decode_tokens_per_s"], metrics["num_generated_tokens"]


def browser_run(page, max_new_tokens: int) -> tuple[float, int]:
    page.click("#ps-new")
    page.wait_for_selector("#ps-phase .ps-idle")
    set_setting(page, "ps-temperature", 0)
    set_setting(page, "ps-max-new", max_new_tokens)
    send(page, PROMPT)
    wait_phase(page, "done")
    return float(kpi(page, "decode_tps").split()[0]), int(kpi(page, "generated_tokens"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    process, url = start_app("--precision", args.precision)
    cli, web = [], []
    try:
        with sync_playwright() as playwright:
            browser = launch_browser(playwright)
            page = open_chat(browser, url)
            browser_run(page, 8)  # warm-up
            for _ in range(args.rounds):
                cli.append(cli_run(args.max_new_tokens, args.precision))
                web.append(browser_run(page, args.max_new_tokens))
                print(f"cli {cli[-1][0]:.2f} tok/s ({cli[-1][1]} tok)   browser {web[-1][0]:.2f} tok/s "
                      f"({web[-1][1]} tok)", flush=True)
            browser.close()
    finally:
        process.terminate()
    cli_tps, web_tps = statistics.median(c[0] for c in cli), statistics.median(w[0] for w in web)
    print(f"median decode: CLI {cli_tps:.2f} tok/s, browser {web_tps:.2f} tok/s, "
          f"browser/CLI = {web_tps / cli_tps:.3f}")


if __name__ == "__main__":
    main()
