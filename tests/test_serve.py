"""`phasescope serve`: the OpenAI-compatible API driven by the official `openai` client, /metrics parsed
with prometheus_client's parser, llama.cpp's timings against the events, bad requests answered 4xx, and
who may bind where."""
from __future__ import annotations

import json
import re
from collections import deque
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from app.bench.browser import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
KEY = "test-key"


def start_server(*args: str, timeout_s: float = 180) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port), *args], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # its output read as it comes (as start_app does): a pipe nobody reads fills up and blocks the server
    process.output = deque(maxlen=2000)
    reader = threading.Thread(target=process.output.extend, args=(process.stdout,), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return process, url
        except OSError:
            if process.poll() is not None:
                break
            time.sleep(0.3)
    process.kill()
    process.wait(timeout=30)
    reader.join(timeout=10)  # its last lines, up to the pipe's end
    raise RuntimeError(f"the server did not start: {''.join(process.output)}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process, url = start_server("--api-key", KEY, "--db", str(tmp_path_factory.mktemp("db") / "h.db"))
    yield url
    process.terminate()
    process.wait(timeout=30)
    said = "".join(process.output)
    assert "Traceback" not in said and "Warning" not in said, said[-3000:]  # no request broke the server


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=120, max_retries=0)


def post(url: str, body, key: str | None = KEY, content_type: str = "application/json") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    def key(sample) -> str:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
        return f"{sample.name}{{{labels}}}" if labels else sample.name

    return {key(sample): sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if "_bucket" not in sample.name}


pytestmark = pytest.mark.model


def test_chat_whole_and_streamed_give_the_same_greedy_text_with_usage_and_timings(client):
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    assert whole.choices[0].message.content and whole.choices[0].finish_reason in ("stop", "length")
    timings = whole.model_extra["timings"]
    assert timings["predicted_n"] == whole.usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == whole.usage.prompt_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},  # the same text in parts
                                          {"type": "text", "text": " of France? One word."}]}]
    stream = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: prefix cache
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.model_extra["timings"]["cache_n"] == chunks[-1].usage.prompt_tokens_details.cached_tokens


def test_a_reply_sent_back_as_text_is_prompted_as_the_tokens_it_was(client, tokenizer):
    """A client's second turn sends the first reply back as text; the server prompts it with the ids the
    model wrote (app/serve/replies.py), so the whole first turn comes from the prefix cache: all but the
    reply's last token, which no forward took in."""
    messages = [{"role": "user", "content": "What are the steps to make tea?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                           logprobs=True)
    reply = first.choices[0].message.content
    written = [t.token for t in first.choices[0].logprobs.content]  # as the model wrote it ("\n\n" one token)
    again = [tokenizer.decode([i]) for i in tokenizer(reply, add_special_tokens=False)["input_ids"]]
    assert written != again  # tokenized again, the reply splits otherwise ("\n", "\n")
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens + first.usage.completion_tokens - 1 < second.usage.prompt_tokens


def test_completions_logprobs_and_stop(client):
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                       logprobs=3)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == answer.usage.completion_tokens == len(logprobs.token_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs) and all(len(top) == 3 for top in logprobs.top_logprobs)
    # the candidates are text as the tokens are (" Paris", not the tokenizer's piece "ĠParis"): greedy took the first
    assert all(token == next(iter(top)) for token, top in zip(logprobs.tokens, logprobs.top_logprobs))
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count: 1, 2, 3, 4"}],
                                          temperature=0, max_tokens=20, logprobs=True, top_logprobs=2, stop=["7"])
    content = chat.choices[0].logprobs.content
    assert content and all(len(entry.top_logprobs) == 2 for entry in content)
    assert "7" not in chat.choices[0].message.content
    # a character split over several tokens: each token's bytes are its own, and together they spell the reply
    chinese = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "用中文说你好"}],
                                             temperature=0, max_tokens=12, logprobs=True, top_logprobs=1)
    entries, text = chinese.choices[0].logprobs.content, chinese.choices[0].message.content
    spelled = b"".join(bytes(entry.bytes) for entry in entries)
    assert any(entry.token == "\ufffd" for entry in entries) and spelled.startswith(text.encode())
    assert all(entry.bytes == entry.top_logprobs[0].bytes for entry in entries)
    streamed = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                              stream=True))
    assert sum(1 for c in streamed if c.choices and c.choices[0].finish_reason) == 1


def test_echo_gives_the_prompts_logprobs_as_lm_eval_reads_them(client, tokenizer):
    """lm-evaluation-harness's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1): every
    prompt token but the first with its logprob, then the one generated; " Paris" after "The capital of
    France is" is likely and the greedy choice (its is_greedy). A string prompt echoes as given."""
    context = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    ids = context + tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    answer = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice, logprobs = answer.choices[0], answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    paris, top = logprobs.token_logprobs[len(context)], logprobs.top_logprobs[len(context)]
    assert paris > -1.5 and paris == max(top.values())  # lm-eval's is_greedy
    assert choice.text.startswith("The capital of France is Paris") and answer.usage.prompt_tokens == len(ids)
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    # the same prompt again is prefilled whole, not taken from the prefix cache: the same numbers
    again = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert again.choices[0].logprobs.token_logprobs == logprobs.token_logprobs
    prompt = "Once upon a time"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert texts[0] == prompt and "".join(texts) == whole.choices[0].text != prompt


def test_logit_bias_bans_and_forces_a_token(client, tokenizer):
    prompt = "The capital of France is"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0).choices[0].text
    [token] = tokenizer(greedy, add_special_tokens=False)["input_ids"]  # " Paris"
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(token): -100}).choices[0].text
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=1.0, seed=1,
                                       logit_bias={str(token): 100}).choices[0].text
    assert banned and banned != greedy and forced == greedy * 3


def test_several_choices_and_prompts_in_one_request(client):
    """n choices for each prompt run as one request each, decoded together: greedy ones equal the one
    answer alone; sampled ones differ and repeat with the seed; each prompt is counted once in usage."""
    messages = [{"role": "user", "content": "Name a fruit."}]
    alone = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    greedy = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.message.content for c in greedy.choices} == {alone.choices[0].message.content}
    assert greedy.usage.prompt_tokens == alone.usage.prompt_tokens
    assert greedy.usage.completion_tokens == sum(c.model_extra["timings"]["predicted_n"] for c in greedy.choices)

    def sampled(**options) -> dict[int, str]:
        answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, max_tokens=10,
                                                n=3, seed=11, **options)
        if not options:
            return {c.index: c.message.content for c in answer.choices}
        texts: dict[int, str] = {}
        for chunk in answer:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        return texts

    whole = sampled()
    assert len(set(whole.values())) > 1 and sampled(stream=True) == whole

    prompts = ["The sky is", "Water boils at"]
    each = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0) for p in prompts]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.text for c in both.choices] == [e.choices[0].text for e in each for _ in range(2)]
    assert both.usage.prompt_tokens == sum(e.usage.prompt_tokens for e in each)
    status, error = post(f"{client.base_url}completions", {"model": MODEL, "prompt": ["a"] * 9, "n": 2})
    assert status == 400 and "at most 16 choices" in error["error"]["message"]


def test_concurrent_clients_get_their_own_answers(client):
    prompts = {i: f"Repeat exactly: {word}" for i, word in enumerate(["apple", "river", "castle", "orange"])}
    alone = {i: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}], temperature=0,
                                               max_tokens=8).choices[0].message.content for i, p in prompts.items()}
    together: dict[int, str] = {}

    def ask(i: int) -> None:
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i]}],
                                                temperature=0, max_tokens=8, stream=True)
        together[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert together == alone


def test_metrics_count_what_was_asked(server, client):
    before = metrics(server)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                            temperature=0, max_tokens=5)
    after = metrics(server)

    def grew(name: str) -> float:
        key = f"phasescope:{name}"
        return after[key] - before.get(key, 0.0)

    assert grew("prompt_tokens_total") == answer.usage.prompt_tokens
    assert grew("generation_tokens_total") == answer.usage.completion_tokens
    assert grew("time_to_first_token_seconds_count") == 1
    assert grew("e2e_request_latency_seconds_count") == 1
    assert grew("inter_token_latency_seconds_count") == answer.usage.completion_tokens - 1
    assert grew("prefix_cache_queries_total") == answer.usage.prompt_tokens
    assert after["phasescope:num_requests_running"] == 0 and 0 <= after["phasescope:kv_cache_usage_perc"] <= 1
    assert after['phasescope:engine_info{precision="int8",switches=""}'] == 1
    models = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"}), timeout=10).read())
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    from openai import NotFoundError
    with pytest.raises(NotFoundError, match="this server runs"):
        client.models.retrieve("gpt-9")


@pytest.mark.parametrize("body, status", [
    (b"{not json", 400),
    ({"model": MODEL}, 400),  # no messages
    ({"model": MODEL, "messages": "hi"}, 400),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": True}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "  "}]}, 400),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, 400),
    # what would change the reply is refused rather than ignored
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "weather"}}]}, 400),
])
def test_bad_requests_get_openai_errors(server, body, status):
    code, answer = post(f"{server}/v1/chat/completions", body)
    assert code == status, answer
    assert answer["error"]["message"] and answer["error"]["type"]


@pytest.mark.parametrize("method, path", [("POST", "/v1/embeddings"), ("GET", "/v1/chat/completions"),
                                          ("GET", "/docs")])
def test_a_path_not_served_is_answered_with_those_that_are(server, method, path):
    request = urllib.request.Request(f"{server}{path}", method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=10)
    message = json.loads(answer.value.read())["error"]["message"]
    assert answer.value.code in (404, 405) and message.startswith(f"{method} {path} is not served here; this "
                                                                   "server serves GET /health, ")
    assert "POST /v1/chat/completions" in message and "GET /v1/models/{name}," in message


def test_null_is_a_field_not_set(server):
    """OpenAI's API allows null for its optional fields (some clients send it for what their user left unset)."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "logprobs", "presence_penalty", "stop", "seed"])
    code, answer = post(f"{server}/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **nulls})
    assert code == 200 and 1 == len(answer["choices"]) and 3 == answer["usage"]["completion_tokens"], answer
    code, answer = post(f"{server}/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": None, **nulls})
    assert code == 200 and 2 == answer["usage"]["completion_tokens"], answer


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
    ("completions", {"prompt": "word " * 9000}, "prompt"),
])
def test_a_prompt_longer_than_the_context_window_is_said_as_openai_says_it(server, path, body, param):
    code, answer = post(f"{server}/v1/{path}", body)
    error = answer["error"]
    assert (code, error["code"], error["param"]) == (400, "context_length_exceeded", param)
    assert re.fullmatch(r"the prompt is [\d,]+ tokens, but the model's context window is 8,192 tokens: shorten it",
                        error["message"])


@pytest.mark.parametrize("body, content_type, said", [
    (b'{"messages": [', "application/json", "the request body is not valid JSON (Expecting value at character 14)"),
    (b"messages=hi", "application/x-www-form-urlencoded", "the request body must be a JSON object"),
    (b"", "application/json", "the request body must be a JSON object"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]}, "application/json",
     "the last message must be the user's, not the assistant's"),
    ({"messages": []}, "application/json", "messages is empty"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}]},
     "application/json", "content parts of type 'image_url' are not supported here: the model reads text"),
])
def test_bad_request_bodies_are_said_in_one_line(server, body, content_type, said):
    code, answer = post(f"{server}/v1/chat/completions", body, content_type=content_type)
    assert code == 400 and answer["error"]["message"].startswith(said), answer


def test_more_choices_than_the_queue_takes_are_a_400_not_a_429_to_retry_forever():
    process, url = start_server("--limit-waiting", "2", "--no-split-kv")
    try:
        assert metrics(url)['phasescope:engine_info{precision="int8",switches="--no-split-kv"}'] == 1
        code, answer = post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3},
                            key=None)
        assert code == 400 and answer["error"]["message"] == ("3 choices in one request (prompts × n), but this "
                                                              "server queues at most 2 requests (--limit-waiting)")
        assert post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                   "max_tokens": 2}, key=None)[0] == 200
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_bad_completion_prompts_and_a_missing_key(server):
    assert post(f"{server}/v1/completions", {"model": MODEL, "prompt": [10**9]})[0] == 400
    assert post(f"{server}/v1/completions", {"model": MODEL, "prompt": [[5, 6], [10**9]]})[0] == 400
    for empty in ([], "", [[]], ["a", ""]):
        code, answer = post(f"{server}/v1/completions", {"model": MODEL, "prompt": empty})
        assert code == 400 and answer["error"]["message"] == "the prompt is empty", answer
    code, answer = post(f"{server}/v1/completions", {"model": MODEL, "prompt": "def f(", "suffix": "return 1"})
    assert code == 400 and answer["error"]["param"] == "suffix"
    assert post(f"{server}/v1/completions", {"model": MODEL, "prompt": "a", "best_of": 3})[0] == 400
    code, answer = post(f"{server}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, key=None)
    assert code == 401 and answer["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("stream, n", [(True, 1), (False, 1), (False, 2)])
def test_a_client_that_leaves_cancels_its_request(server, stream, n):
    import http.client

    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}],
                       "max_tokens": 5000, "stream": stream, "temperature": 0, "ignore_eos": True, "n": n})
    cancelled = 'phasescope:request_success_total{finished_reason="cancelled"}'
    before = metrics(server).get(cancelled, 0)
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {KEY}"})
    if stream:
        connection.getresponse().readline()  # the stream has started
    else:  # the tokens have started to come (a whole answer sends nothing until the end)
        deadline = time.monotonic() + 30
        while metrics(server)["phasescope:num_requests_running"] < n and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
    connection.close()  # the client goes away mid-answer
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metrics(server).get(cancelled, 0) < before + n:
        time.sleep(0.1)
    now = metrics(server)
    assert now.get(cancelled, 0) == before + n and now["phasescope:num_requests_running"] == 0


@pytest.mark.parametrize("command", [["ui", "--host", "0.0.0.0"], ["serve", "--host", "0.0.0.0"],
                                     ["serve", "--host", "0.0.0.0", "--ui", "--api-key", "k"]])
def test_binding_beyond_this_machine_needs_credentials(command):
    out = subprocess.run([sys.executable, "-m", "app.cli", *command, "--port", str(free_port())],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("phasescope: error: binding to 0.0.0.0 lets anyone on the network in")


def test_an_ipv6_host_is_bracketed_in_urls_and_not_in_binds():
    from app.serve.access import bare_host, is_loopback, url_host, url_of

    assert "::1" == bare_host("[::1]") == bare_host("::1") and "localhost" == bare_host("localhost")
    assert is_loopback(bare_host("[::1]"))  # so it needs no credentials, as 127.0.0.1 does not
    assert ("http://[::1]:7860", "[::1]") == (url_of("::1", 7860), url_host("::1"))  # Gradio takes "[::1]"
    assert "http://127.0.0.1:8000" == url_of("127.0.0.1", 8000)


@pytest.mark.parametrize("port", ["99999", "0", "80a"])
def test_a_port_out_of_range_is_one_line(port):
    out = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--port", port],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert 2 == out.returncode  # argparse's usage, then one line that says what is wrong
    assert "argument --port: a port is" in out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("command", ["ui", "serve"])
def test_a_port_in_use_is_said_before_the_model_loads(command):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "app.cli", command, "--port", str(port)],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "Loading the model" not in out.stderr and not out.stdout
    assert out.stderr.strip() == (f"phasescope: error: cannot serve on 127.0.0.1:{port}: another program is "
                                  "listening there; choose another with --port")


def test_on_the_network_the_api_needs_its_key_and_the_ui_a_login():
    process, url = start_server("--host", "0.0.0.0", "--api-key", KEY, "--auth", "teacher:s3cret", "--ui")
    try:
        assert post(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                    key="wrong")[0] == 401
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/ui/config", timeout=10)
        assert refused.value.code == 401
        import http.cookiejar

        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        with pytest.raises(urllib.error.HTTPError):
            opener.open(f"{url}/ui/login", b"username=teacher&password=wrong", timeout=10)
        opener.open(f"{url}/ui/login", b"username=teacher&password=s3cret", timeout=10)
        assert opener.open(f"{url}/ui/config", timeout=10).status == 200
        for path in ("/", "/favicon.ico"):  # a browser at the server's root is sent to the page
            assert opener.open(f"{url}{path}", timeout=10).geturl() == f"{url}/ui{path}"
        with pytest.raises(urllib.error.HTTPError) as missing:  # a mistyped address is told where the page is
            opener.open(f"{url}/iu/", timeout=10)
        assert json.loads(missing.value.read())["error"]["message"].endswith(", GET /ui/ (the page)")
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_stream_waiting_behind_a_measurement_of_the_lab_says_so(tokenizer):
    """A streamed answer queued while the page's Lab holds the engine (Engine.call, `serve --ui`) gets one
    comment line saying so, which OpenAI clients skip; its tokens come once the measurement ends."""
    from starlette.testclient import TestClient

    from app.serve.api import create_api
    from app.ui.session import EngineThread
    from engine import Engine, EngineConfig
    from tests.conftest import tiny_model

    thread = EngineThread().start()
    engine = thread.call(lambda: Engine(tiny_model(tokenizer), EngineConfig()))
    thread.serve(engine)
    release = threading.Event()
    lab = threading.Thread(target=engine.call, args=(lambda: release.wait(30),), kwargs={"name": "lab"})
    try:
        lab.start()
        while engine.calling != "lab":
            time.sleep(0.01)
        lines = []
        with TestClient(create_api(engine)) as client, client.stream(
                "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                      "temperature": 0, "ignore_eos": True, "stream": True}) as answer:
            for line in filter(None, answer.iter_lines()):  # events' lines, without the blank ones between
                lines.append(line)
                if line.startswith(":"):  # said: the Lab's run ends (without the comment, in 30 s)
                    release.set()
    finally:
        release.set()
        lab.join(30)
        thread.stop()
    said = [line for line in lines if line.startswith(":")]
    assert said == [": waiting: a measurement of the Lab holds the engine until it ends"], lines
    assert lines.index(said[0]) < next(i for i, line in enumerate(lines) if '"content": "' in line and
                                       '"role"' not in line)
    assert lines[-1] == "data: [DONE]"
    timed = [json.loads(line.removeprefix("data: ")) for line in lines if '"timings"' in line]
    assert 0 < timed[-1]["timings"]["held_ms"]["lab"] < 30_000  # the wait, which its TTFT includes


def test_the_server_forgets_its_least_recently_used_reply_first():
    from app.serve.replies import RecentReplies

    replies = RecentReplies(limit=2)
    for text, ids in (("one", [1]), ("two", [2]), ("", [9]), ("nothing", [])):
        replies.remember(text, ids)  # an empty reply, or one without ids, is not kept
    conversation = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "one"}]
    assert replies.attach(conversation) == [conversation[0], {**conversation[1], "token_ids": [1]}]  # used
    replies.remember("three", [3])  # "two" goes: "one" was used since
    assert [m.get("token_ids") for m in replies.attach([{"role": "assistant", "content": t}
                                                        for t in ("one", "two", "three")])] == [[1], None, [3]]
