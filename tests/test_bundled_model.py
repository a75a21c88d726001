"""The engine on the bundled SmolLM2-135M-Instruct: token-for-token parity with transformers, the
event stream of a real reply, and the CLI."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from app.history.store import Store
from engine import (CHAT_REPETITION_PENALTY, CHAT_TOP_P, DecodeStep, Engine, EngineConfig, PrefillChunk,
                    SamplingParams, render_prompt)

pytestmark = pytest.mark.model

CONVERSATIONS = {
    "english": [{"role": "user", "content": "What is the capital of France?"}],
    "chinese": [{"role": "user", "content": "请用一句话介绍一下北京。"}],
    "multi-turn": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Name another one."},
    ],
}

FP32 = EngineConfig(precision="fp32")  # exact comparisons need the reference precision


@pytest.fixture(scope="module")
def engine(bundled) -> Engine:
    return Engine(bundled, EngineConfig(precision="fp32"))  # the reference: transformers' own numbers


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_greedy_tokens_equal_transformers_generate(bundled, engine, name):
    messages = CONVERSATIONS[name]
    prompt = render_prompt(bundled.tokenizer, messages)
    with torch.no_grad():
        expected = bundled.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                          max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    request = engine.new_request(messages, SamplingParams(max_new_tokens=32, temperature=0))
    finished = list(engine.run(request))[-1]
    assert expected == request.generated_ids
    # a reply cut at the token limit may end inside a character, which is never released
    assert bundled.tokenizer.decode(expected, skip_special_tokens=True).rstrip("\ufffd") == finished.text


def test_a_reply_comes_back_into_the_prompt_as_the_tokens_it_was_generated_as(bundled):
    """Where a reply's generated ids spell its text, the next prompt holds them instead of the text tokenized
    again, which can split it otherwise (SmolLM2 writes "\n\n" as one token; its tokenizer, before a digit,
    makes two); the prompt's text is the same either way."""
    tok = bundled.tokenizer
    text = "Two planets:\n\n1. Mars"
    generated = tok("Two planets:\n\n", add_special_tokens=False)["input_ids"] + \
        tok("1. Mars", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # closed by its end of turn
    assert tok.decode(generated[:-1]) == text and generated[:-1] != tok(text, add_special_tokens=False)["input_ids"]
    first, then = [{"role": "user", "content": "Name two planets."}], {"role": "user", "content": "Which is larger?"}

    def prompt(reply: dict, before: list[dict] = first) -> list[int]:
        return render_prompt(tok, [*before, {"role": "assistant", "content": text, **reply}, then])

    plain, reused = prompt({}), prompt({"token_ids": generated})
    opening = render_prompt(tok, first)
    assert reused[:len(opening) + len(generated) - 1] == opening + generated[:-1] and reused != plain
    assert tok.decode(reused) == tok.decode(plain)
    assert prompt({"token_ids": [5, 6, 7]}) == prompt({"token_ids": [10 ** 9]}) == plain  # ids that do not spell it
    echo = [{"role": "user", "content": f"Say: {text}"}]  # the reply's text in the message before it too
    echoed = prompt({"token_ids": generated}, echo)
    assert tok.decode(echoed) == tok.decode(prompt({}, echo))
    at = next(i for i in range(len(echoed)) if echoed[i:i + len(generated) - 1] == generated[:-1])
    assert tok.decode(echoed[:at]).endswith("<|im_start|>assistant\n")  # in the reply's place, not the message's


def test_a_second_turn_finds_the_whole_first_turn_in_the_prefix_cache(engine):
    """With its reply's token ids, a chat's second turn prefills only what is new: the first turn's prompt
    and every token of its reply come from the cache (all but the last, which no forward took in)."""
    first = [{"role": "user", "content": "List three colours, one per line, numbered."}]
    request = engine.new_request(first, SamplingParams(max_new_tokens=40, temperature=0))
    finished = list(engine.run(request))[-1]
    conversation = [*first, {"role": "assistant", "content": finished.text, "token_ids": request.generated_ids},
                    {"role": "user", "content": "And a fourth?"}]
    second = engine.generate(conversation, SamplingParams(max_new_tokens=1, temperature=0))
    assert second.metrics.num_cached_tokens == request.num_prompt_tokens + len(request.generated_ids) - 1


def test_event_stream_of_a_32_token_reply(engine):
    request = engine.new_request(CONVERSATIONS["english"], SamplingParams(max_new_tokens=32, temperature=0,
                                                                           ignore_eos=True))
    events = list(engine.run(request))
    types = [e.type for e in events]
    assert ["Started", "PrefillChunk", "FirstToken"] + ["DecodeStep"] * 32 + ["Finished"] == types
    steps = [e for e in events if isinstance(e, DecodeStep)]
    prompt = request.num_prompt_tokens
    assert list(range(prompt, prompt + 32)) == [s.kv_tokens for s in steps]
    assert [46080 * s.kv_tokens for s in steps] == [s.kv_bytes for s in steps]  # 30 layers x 3 heads x 64 x fp32
    finished = events[-1]
    assert finished.metrics.ttft_ms > 0 and finished.metrics.tpot_ms > 0
    assert "".join(s.text for s in steps) == finished.text


def test_chunked_prefill_gives_the_same_reply(bundled):
    messages = CONVERSATIONS["multi-turn"]
    params = SamplingParams(max_new_tokens=12, temperature=0)
    whole = Engine(bundled, FP32).generate(messages, params)
    events = list(Engine(bundled, EngineConfig(precision="fp32", prefill_chunk=8)).stream(messages, params))
    assert len([e for e in events if isinstance(e, PrefillChunk)]) > 1
    assert whole.text == events[-1].text


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_generate_json_prints_every_event():
    result = run_cli("generate", "--prompt", "What is a KV cache?", "--max-new-tokens", "32", "--json",
                     "--temperature", "0", "--kv-dtype", "fp16")
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    types = [e["type"] for e in events]
    assert types[:3] == ["Started", "PrefillChunk", "FirstToken"] and types[-1] == "Finished"
    assert {"precision": "int8", "kv_dtype": "fp16"} == events[0]["engine"]  # a log says how it was made
    kv = [e["kv_tokens"] for e in events if e["type"] == "DecodeStep"]
    assert kv == list(range(kv[0], kv[0] + len(kv))) and 1 <= len(kv) <= 32
    metrics = events[-1]["metrics"]
    assert metrics["ttft_ms"] > 0 and (metrics["tpot_ms"] or 0) > 0


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "the message is empty"),
    (["--prompt", " ", "--model", "/no/such/model"], "the message is empty"),  # said before any model loads
    (["--prompt", "hi", "--model", "/no/such/model"], "model path not found: /no/such/model"),
    (["--prompt", "hi", "--top-p", "2"], "--top-p must be in (0.0, 1.0], got 2.0"),  # named as typed
    (["--prompt", "hi", "--kv-cache-mb", "0"], "--kv-cache-mb must be a number of MB > 0, got 0.0"),
    (["--prompt", "hi", "--max-running", "4096"], "--max-running (4096) must be below max_step_tokens (2048, "),
    (["--prompt", "word " * 9000], "context window is 8,192 tokens"),
    ([], "no prompt: phasescope generate"),
    (["hi", "--prompt", "hi"], "give the prompt once"),
])
def test_cli_errors_are_one_line(args, message):
    result = run_cli("generate", *args)
    assert 2 == result.returncode
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_cli_output_read_in_part_ends_quietly():
    """`phasescope generate --json | head -1`: the reader goes away; the command stops as Unix tools do
    (the shell's 141), without 'error: [Errno 32] Broken pipe' twice."""
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "generate", "--json", "--max-new-tokens", "200",
                                "--temperature", "0", "Write a long story."], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert '"type": "Started"' in process.stdout.readline()
    process.stdout.close()
    assert 141 == process.wait(timeout=120) and "" == process.stderr.read()


def test_cli_generate_takes_the_prompt_as_an_argument_an_option_or_from_stdin():
    prompt = "Name two colours.\nThen name a fruit."
    greedy = ["--max-new-tokens", "8", "--temperature", "0"]
    replies = [run_cli("generate", prompt, *greedy), run_cli("generate", "--prompt", prompt, *greedy),
               subprocess.run([sys.executable, "-m", "app.cli", "generate", "-", *greedy], input=prompt,
                              capture_output=True, text=True, timeout=300)]
    assert all(r.returncode == 0 for r in replies), [r.stderr for r in replies]
    assert replies[0].stdout.strip() and replies[0].stdout == replies[1].stdout == replies[2].stdout


@pytest.mark.parametrize("flags", ["--no-prefix-cache --no-split-kv --kv-window 256 --kv-sinks 8 --attention eager "
                                   "--kv-dtype int8",
                                   "--speculative prompt-lookup --draft-tokens 4 --compile-decode --bind-threads",
                                   "--no-kv-cache --tensor-parallel 2", ""])
def test_switches_are_told_as_the_flags_that_set_them(flags):
    from app.cli import build_parser, engine_config, switch_flags

    config = engine_config(build_parser().parse_args(["generate", "--prompt", "hi", *flags.split()]))
    assert set(switch_flags(config.switches()).split(" --")) == set(flags.split(" --"))


def test_cli_chat_goes_on_past_the_prompt_limit_without_its_earliest_messages(tmp_path):
    db = tmp_path / "history.db"
    out = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--temperature", "0", "--max-new-tokens", "4",
                          "--limit-prompt-tokens", "90", "--db", str(db)],
                         input="One two three.\nFour five six.\nSeven eight nine.\nTen eleven twelve.\nThirteen.\n",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    prompts = [(int(p), int(c)) for p, c in re.findall(r"prompt (\d+) tok \(cached (\d+)\)", out.stdout)]
    assert 5 == len(prompts) and all(p <= 90 for p, _ in prompts)  # every message answered, none refused
    assert 1 == out.stderr.count("this chat outgrew the 90 tokens a prompt may take here")
    assert "its first 6 messages are no longer sent" in out.stderr
    (dropped, _), (after, cached) = prompts[3:]
    assert dropped < prompts[2][0] and cached >= dropped  # the turn after: its prompt starts as the last one's
    assert [("One two three.", 5)] == [(s["title"], s["turns"]) for s in Store.open(db).sessions()]


def test_cli_chat_at_a_terminal_edits_the_line_and_brings_back_the_last_one(tmp_path):
    """In a terminal the arrow keys move in the line (without readline they went into the message as
    escape codes) and the up arrow brings back the line sent before, as `ollama run` does; Ctrl-C at the
    prompt drops the line typed, and only that."""
    import os
    import pty
    import select
    import signal
    import time

    db = tmp_path / "history.db"
    terminal, child = pty.openpty()
    # SIGINT as a terminal's shell leaves it: a suite started in the background (nohup, &) ignores it, and
    # a Python started so never turns it into KeyboardInterrupt
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "chat", "--max-new-tokens", "2", "--db", str(db)],
                               stdin=child, stdout=child, stderr=child, env={**os.environ, "TERM": "xterm"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(child)
    shown = b""

    def until(text: bytes, count: int = 1) -> None:
        nonlocal shown
        deadline = time.monotonic() + 120
        while shown.count(text) < count and time.monotonic() < deadline:
            if select.select([terminal], [], [], 0.2)[0]:
                shown += os.read(terminal, 4096)
        assert shown.count(text) >= count, shown.decode(errors="replace")[-2000:]

    try:
        until(b">>> ")
        os.write(terminal, b"abd\x1b[Dc\r")  # left arrow, then c: abcd
        until(b">>> ", 2)  # each key waits for its prompt: one sent before goes to the terminal's own echo
        os.write(terminal, b"\x1b[A\r")  # up arrow: abcd again
        until(b">>> ", 3)
        os.write(terminal, b"half a li")
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)  # Ctrl-C at the prompt: the line is dropped, the chat goes on
        until(b"(/bye or Ctrl-D leaves)")
        until(b">>> ", 4)  # the next prompt: a key sent before it went to the interrupted one
        os.write(terminal, b"\x04")  # Ctrl-D leaves
        assert process.wait(60) == 0
    finally:
        process.kill()
        os.close(terminal)
    asked = [m["content"] for m in Store.open(db).messages(1) if m["role"] == "user"]
    assert asked == ["abcd", "abcd"]


def test_cli_chat_takes_a_message_of_several_lines_between_triple_quotes(tmp_path):
    db = tmp_path / "history.db"
    out = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--max-new-tokens", "2", "--db", str(db)],
                         input='"""Fix this:\n    return x +\n"""\n"""One line."""\nPlain.\n/?\n/bye\n',
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    asked = [m["content"] for m in Store.open(db).messages(1) if m["role"] == "user"]
    assert asked == ["Fix this:\n    return x +", "One line.", "Plain."]  # three messages, not five
    assert 'begins and ends with """' in out.stdout


def test_cli_chat_keeps_the_conversation_until_clear_and_saves_it(tmp_path):
    db = tmp_path / "history.db"
    out = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--temperature", "0", "--max-new-tokens", "6",
                          "--db", str(db), "--system", "Be brief."],
                         input="/retry\nMy name is Ada.\n/?\n/claer\nWhat is my name?\n/clear\nHello\n/retry\n/bye\n",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = re.findall(r"prompt (\d+) tok \(cached (\d+)\)", out.stdout)
    assert len(lines) == 4 and "(new chat)" in out.stdout and "Any other line is sent to the model" in out.stdout
    assert "(no reply to retry yet)" in out.stdout and "(again: Hello)" in out.stdout
    assert "(no command /claer: /? lists them)" in out.stdout  # a typo is not sent to the model
    (first, _), (second, cached), (third, _), (again, cached_again) = [(int(p), int(c)) for p, c in lines]
    assert second > first and cached > 0  # the second turn carries the first, from the cache
    assert third < second  # after /clear the conversation starts again
    assert again == third and cached_again > 0  # /retry: the same prompt, from the cache
    store = Store.open(db)  # each conversation saved as the browser's are: messages, metrics, every step
    assert [(s["title"], s["turns"]) for s in store.sessions()] == [("Hello", 1), ("My name is Ada.", 2)]
    # a chat's default penalty and top-p, which `generate` leaves off
    settings = [json.loads(s["settings"]) for s in store.sessions()]
    assert {(CHAT_REPETITION_PENALTY, CHAT_TOP_P)} == {(s["repetition_penalty"], s["top_p"]) for s in settings}
    for session in store.sessions():
        replies = [m for m in store.messages(session["id"]) if m["role"] == "assistant"]
        assert all(m["status"] == "complete" and m["ttft_ms"] > 0 for m in replies)
        assert [len(store.steps(m["id"])) for m in replies] == [1 + m["generated_tokens"] for m in replies]
    _, replaced, retried = store.messages(store.sessions()[0]["id"])  # /retry kept the reply it replaced
    assert (retried["id"], None) == (replaced["replaced_by"], retried["replaced_by"])
    ada = store.sessions()[1]["id"]  # continued in a new process: the conversation so far is shown and sent
    out = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--temperature", "0", "--max-new-tokens", "6",
                          "--db", str(db), "--session", str(ada), "--no-prefix-cache"],
                         input="And again?\n/edit\n/edit And once more?\n/bye\n",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "decode: fused C++) with --no-prefix-cache; history: " in out.stdout  # the first line says how it runs
    assert ">>> My name is Ada." in out.stdout and ">>> What is my name?" in out.stdout
    assert "system prompt (the session's): Be brief." in out.stdout  # it goes on as it was asked
    (prompt, _), (edited, _) = re.findall(r"prompt (\d+) tok \(cached (\d+)\)", out.stdout)
    assert int(prompt) > second and [s["turns"] for s in store.sessions() if s["id"] == ada] == [3]
    assert abs(int(edited) - int(prompt)) <= 2  # the chat before "And again?" and its reply, and the new text
    assert "(/edit TEXT sends TEXT in place of your last message)" in out.stdout
    asked = [m for m in store.messages(ada) if m["turn"] == 3 and m["role"] == "user"]
    assert [("And again?", True), ("And once more?", False)] == [  # /edit: the turn again, the first kept
        (m["content"], m["replaced_by"] is not None) for m in asked]
    assert "\033[" not in out.stdout  # to a pipe: no terminal styling
