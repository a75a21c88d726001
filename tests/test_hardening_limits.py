"""Limits: what one request may ask for and how many may wait, each refused with a one-line message in
the engine, the CLI and the API; a request past its time limit ends with its text so far."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from app.history.export import render
from engine import Engine, EngineConfig, Limits, PromptTooLong, QueueFull, SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def engine_with(tiny, **limits) -> Engine:
    return Engine(tiny, EngineConfig(limits=Limits(**limits)))


def test_message_prompt_and_new_token_limits_refuse_with_one_line(tiny):
    engine = engine_with(tiny, max_message_chars=50, max_prompt_tokens=30, max_new_tokens=10)
    with pytest.raises(ValueError, match=r"^a message holds 51 characters; the limit is 50 \(--limit-message-chars\)$"):
        engine.new_request([{"role": "user", "content": "x" * 51}])
    with pytest.raises(ValueError, match=r"^the system prompt holds 60 characters; the limit is 50"):
        engine.new_request([{"role": "system", "content": "y" * 60}, {"role": "user", "content": "hi"}])
    with pytest.raises(PromptTooLong, match=r"40 tokens, but the limit is 30 prompt tokens \(--limit-prompt-tokens\)"):
        engine.new_request_from_ids(list(range(100, 140)))
    from app.ui.language import user_error
    with pytest.raises(PromptTooLong) as refused:
        engine.new_request_from_ids(list(range(100, 140)))
    assert "提示词元上限为 30 个（--limit-prompt-tokens）" in user_error("zh", refused.value)
    with pytest.raises(ValueError, match=r"11 new tokens asked for; the limit is 10 \(--limit-new-tokens\)"):
        engine.new_request_from_ids([5, 6], SamplingParams(max_new_tokens=11))
    engine.new_request_from_ids([5, 6], SamplingParams(max_new_tokens=10))  # at the limit: fine


def test_a_full_queue_says_busy_instead_of_growing(tiny):
    engine = engine_with(tiny, max_waiting=2)
    for _ in range(2):
        engine.submit(engine.new_request_from_ids([5, 6, 7]))
    with pytest.raises(QueueFull, match=r"busy: 2 requests are already waiting"):
        engine.submit(engine.new_request_from_ids([5, 6, 7]))
    while engine.step():
        pass
    engine.submit(engine.new_request_from_ids([5, 6, 7]))  # room again once they ran


def test_a_request_past_its_time_limit_ends_with_its_text_so_far(tiny):
    engine = engine_with(tiny, request_timeout_s=0.2)
    request = engine.new_request_from_ids([5, 6, 7], SamplingParams(max_new_tokens=200, temperature=0,
                                                                    ignore_eos=True))
    events = []
    engine.submit(request, [events.append])
    for _ in range(4):
        engine.step()
    time.sleep(0.25)
    while not request.is_finished:
        engine.step()
    finished = events[-1]
    assert finished.reason == "error" and "ran past the time limit of 0.2 s" in finished.error
    assert 1 <= finished.metrics.num_generated_tokens < 200


def test_a_held_request_is_paced_by_its_user_not_the_time_limit(tiny):
    engine = engine_with(tiny, request_timeout_s=0.05)
    request = engine.new_request_from_ids([5, 6, 7], SamplingParams(max_new_tokens=5, temperature=0))
    engine.allow(request, 0)  # explain mode: held after its first token
    engine.submit(request)
    engine.step()
    time.sleep(0.1)
    engine.step()
    assert not request.is_cancelled
    request.cancel()
    engine.step()


def test_an_export_over_the_limit_is_refused_before_it_is_built(store, tiny_engine, monkeypatch):
    from tests.conftest import record

    record(tiny_engine, store, "Hi")
    monkeypatch.setenv("PHASESCOPE_MAX_EXPORT_STEPS", "2")
    with pytest.raises(ValueError, match=r"the export would hold \d+ steps, over the limit of 2"):
        render(store, "json")


def test_the_cli_says_which_limit(tmp_path):
    out = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--prompt", "hi", "--max-new-tokens", "10",
                          "--limit-new-tokens", "5"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "phasescope: error: 10 new tokens asked for; the limit is 5 (--limit-new-tokens)"


@pytest.mark.model
def test_the_api_answers_a_full_queue_with_429_and_retry_after():
    from tests.test_serve import start_server

    process, url = start_server("--max-running", "1", "--limit-waiting", "1")
    body = json.dumps({"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 300,
                       "temperature": 0, "ignore_eos": True}).encode()
    answers: list[tuple[int, str | None]] = []

    def ask() -> None:
        request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as answer:
                answers.append((answer.status, None))
        except urllib.error.HTTPError as error:
            answers.append((error.code, error.headers.get("Retry-After")))

    try:
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert {code for code, _ in answers} <= {200, 429} and len(answers) == 4
    assert (429, "1") in answers and (200, None) in answers
