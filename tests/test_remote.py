"""Measuring a remote OpenAI-compatible server from the client side: against `phasescope serve` end to
end (the chat stored, the load sweep), and against a misbehaving server, where every fault ends the reply
with a clear message, the partial reply kept and nothing hanging."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from app.bench.browser import free_port
from app.history.store import Store
from app.remote import Endpoint
from engine import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SAMPLING = SamplingParams(max_new_tokens=8, temperature=0)


def _chunk(text: str, finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


class Faulty(BaseHTTPRequestHandler):
    """A server that fails in the way its path says."""

    def log_message(self, *args) -> None:
        pass

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

    def _json(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    received: list[dict] = []  # the requests' bodies
    authorizations: list[str | None] = []  # and their Authorization headers

    def do_GET(self) -> None:  # noqa: N802: the model list, refused as a server with an API key does
        if self.path == "/ok/metrics":  # a slow /metrics beside the good stream
            time.sleep(0.5)
            self._json(200, b"phasescope:num_requests_running 2\n")
            return
        self._json(401, b'{"error": {"message": "a valid API key is required", "type": "authentication_error"}}')

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.received.append(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
        self.authorizations.append(self.headers.get("Authorization"))
        fault = self.path.split("/")[1]
        if fault in ("ok", "held", "odd"):  # held: a PhaseScope server whose Lab held the request 1.5 s
            self._start_stream()
            for piece in ("Hello", " there"):
                self.wfile.write(_chunk(piece))
            self.wfile.write(_chunk("", "stop"))
            last = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
            if fault == "held":
                last["timings"] = {"prompt_n": 5, "prompt_ms": 3.0, "held_ms": {"lab": 1500.0, "odd": "x"}}
            elif fault == "odd":  # not llama.cpp's timings: an object of another shape, read as none
                last["timings"] = ["prompt_ms", 3.0]
            self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
        elif fault == "json":
            self._json(200, b'{"choices": [{"message": {"content": "not a stream"}}]}')
        elif fault == "500":
            self._json(500, b'{"error": {"message": "out of memory", "type": "server_error"}}')
        elif fault == "cut":
            self._start_stream()
            self.wfile.write(_chunk("partial"))
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)  # gone mid-stream
        elif fault == "slow":
            self._start_stream()
            self.wfile.write(_chunk("first"))
            self.wfile.flush()
            time.sleep(3)  # longer than the client's read timeout
        elif fault == "endless":  # a word every 20 ms until the client goes (or 30 s)
            self._start_stream()
            try:
                for _ in range(1500):
                    self.wfile.write(_chunk(" word"))
                    self.wfile.flush()
                    time.sleep(0.02)
            except OSError:
                pass


@pytest.fixture(scope="module")
def faulty():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Faulty)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def reply(url: str, sampling: SamplingParams = SAMPLING, **options):
    endpoint = Endpoint(url, "m", read_timeout_s=1.0, scrape_metrics=False, **options)
    start = time.monotonic()
    events = list(endpoint.stream([{"role": "user", "content": "hi"}], sampling))
    return events, time.monotonic() - start


def test_a_good_stream_becomes_the_engines_events(faulty):
    events, _ = reply(f"{faulty}/ok")
    assert [e.type for e in events] == ["Started", "FirstToken", "DecodeStep", "DecodeStep", "Finished"]
    finished = events[-1]
    assert (finished.reason, finished.text, finished.error) == ("eos", "Hello there", None)
    assert finished.metrics.num_prompt_tokens == 5 and finished.metrics.ttft_ms > 0
    assert len(finished.metrics.itl_ms) == 1 and finished.held_ms is None
    held, _ = reply(f"{faulty}/held")  # a PhaseScope server says how long its Lab held the request
    assert held[-1].held_ms == {"lab": 1500.0} and held[-1].text == "Hello there"
    from app.cli.lines import remote_line  # the terminal chat's line after the reply

    assert "· held there 1.5 s by lab" in remote_line(held[-1]) and "held" not in remote_line(events[-1])
    odd, _ = reply(f"{faulty}/odd")
    assert odd[-1].held_ms is None and odd[-1].text == "Hello there" and "server:" not in remote_line(odd[-1])


def test_the_servers_metrics_are_read_outside_the_requests_time(faulty):
    """/metrics is read as a request begins and ends (the terminal chat says what it found): its round trip,
    half a second here, is not the request's TTFT."""
    endpoint = Endpoint(f"{faulty}/ok", "m", read_timeout_s=2.0)
    *_, finished = endpoint.stream([{"role": "user", "content": "hi"}], SAMPLING)
    assert finished.server["metrics_before"] == {"num_requests_running": 2.0} and finished.reason == "eos"
    assert finished.metrics.ttft_ms < 400 and finished.metrics.e2e_ms < 400


def test_the_request_carries_the_sampling_settings(faulty):
    reply(f"{faulty}/ok", SamplingParams(max_new_tokens=7, temperature=0.5, top_k=20, seed=3, stop=("END",),
                                         frequency_penalty=0.5, presence_penalty=-0.25, repetition_penalty=1.1))
    body = Faulty.received[-1]
    assert {k: body[k] for k in ("max_tokens", "temperature", "top_k", "seed", "stop", "frequency_penalty",
                                 "presence_penalty", "repetition_penalty", "repeat_penalty")} == {
        "max_tokens": 7, "temperature": 0.5, "top_k": 20, "seed": 3, "stop": ["END"], "frequency_penalty": 0.5,
        "presence_penalty": -0.25, "repetition_penalty": 1.1, "repeat_penalty": 1.1}  # vLLM's name, llama.cpp's
    reply(f"{faulty}/ok")  # the defaults are left to the server
    assert not {"frequency_penalty", "presence_penalty", "repetition_penalty", "repeat_penalty",
                "top_k"} & set(Faulty.received[-1])


def test_a_local_replys_token_ids_stay_home(faulty):
    """A chat that moves to a server sends its replies as text: their token ids are the local model's."""
    endpoint = Endpoint(f"{faulty}/ok", "m", read_timeout_s=1.0, scrape_metrics=False)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello", "token_ids": [1, 2]},
                    {"role": "user", "content": "again"}]
    list(endpoint.stream(conversation, SAMPLING))
    assert Faulty.received[-1]["messages"] == [{k: m[k] for k in ("role", "content")} for m in conversation]


@pytest.mark.parametrize("fault, message, partial", [
    ("json", "did not answer with a stream (content-type application/json)", ""),
    ("500", "answered HTTP 500: out of memory", ""),
    ("cut", "closed the stream before it ended", "partial"),
    ("slow", "sent nothing for 1 s", "first"),
])
def test_each_fault_is_one_clear_line_with_the_partial_reply(faulty, fault, message, partial):
    events, seconds = reply(f"{faulty}/{fault}")
    finished = events[-1]
    assert finished.reason == "error" and message in finished.error, finished.error
    assert finished.text == partial and "\n" not in finished.error
    assert seconds < 10


def test_each_servers_gauges_read_alike():
    """vLLM's, SGLang's, llama.cpp's and PhaseScope's names for the KV cache in use and the requests running
    and waiting (what Endpoint.scrape keeps of their /metrics) read as the same three."""
    from app.remote.client import gauges_text, server_gauges

    vllm = {"kv_cache_usage_perc": 0.25, "num_requests_running": 3.0, "num_requests_waiting": 1.0}
    sglang = {"token_usage": 0.25, "num_running_reqs": 3.0, "num_queue_reqs": 1.0, "cache_hit_rate": 0.5}
    llama_cpp = {"requests_processing": 3.0, "requests_deferred": 1.0, "prompt_tokens_cached": 1041.0}
    expected = {"kv_cache_usage": 0.25, "running": 3.0, "waiting": 1.0}
    assert server_gauges(vllm) == server_gauges(sglang) == expected
    assert server_gauges(llama_cpp) == {"running": 3.0, "waiting": 1.0}  # this llama.cpp names no KV gauge
    assert gauges_text(expected) == "KV cache 25.0%, 3 running, 1 waiting" and server_gauges({}) == {}


@pytest.mark.parametrize("text", ["ttft:abc", "ttft:-5", "ttft", "speed:10"])
def test_a_bad_slo_is_one_line(text):
    from app.remote.sweep import parse_slo

    with pytest.raises(ValueError, match=f"--slo takes ttft:MS,tpot:MS,e2e:MS with milliseconds above 0, got '{text}'"):
        parse_slo(text)
    assert parse_slo("ttft:500, tpot:50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}


def test_each_sweep_sends_new_prompts_unless_given_a_seed(faulty):
    """A server's prefix cache keeps an earlier run's prompts (llama.cpp's server served a second identical
    sweep's at a sixth of the first's TTFT): each run draws new ones; a seed sends the same again."""
    from app.remote.sweep import sweep

    def sent(seed=None) -> tuple[int, list[str]]:
        Faulty.received.clear()
        report = sweep(Endpoint(f"{faulty}/ok", "m", scrape_metrics=False), (1,), 2, 5, 4, seed=seed)
        return report["seed"], [body["messages"][-1]["content"] for body in Faulty.received]

    (first_seed, first), (second_seed, second) = sent(), sent()
    assert first_seed != second_seed and len(first) == 2 and not set(first) & set(second)
    assert sent(7) == sent(7) and sent(7)[1] != first


def test_a_key_refused_or_missing_is_said_as_such_and_a_sweep_where_all_fail_stops(faulty):
    from app.remote.sweep import sweep

    for key, said in ((None, "needs an API key (HTTP 401)"), ("k", "refused the API key (HTTP 401)")):
        with pytest.raises(ValueError) as error:
            Endpoint(faulty, api_key=key).resolve_model()
        assert str(error.value) == f"{faulty}/v1 {said}"
    out = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--endpoint", faulty], capture_output=True,
                         text=True, cwd=ROOT, input="")
    assert out.stderr.strip().endswith("needs an API key (HTTP 401): give it with --endpoint-key or "
                                       "PHASESCOPE_ENDPOINT_KEY"), out.stderr
    lines = []
    with pytest.raises(ValueError, match=r"^every request failed; the first: .*HTTP 500.*out of memory"):
        sweep(Endpoint(f"{faulty}/500", "m", scrape_metrics=False), (1, 2), 2, 5, 4, log=lines.append)
    assert "first error:" in lines[-1] and not any("concurrency 2" in line for line in lines)


def test_connection_refused_is_said_at_once():
    events, seconds = reply(f"http://127.0.0.1:{free_port()}")
    assert "connection refused" in events[-1].error and seconds < 10


def test_no_server_at_the_endpoint_is_said_as_such_when_listing_its_models():
    """Not "give the model's name": no name helps where nothing answers."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ValueError) as error:
        Endpoint(url).resolve_model()
    assert str(error.value) == f"cannot reach {url}: connection refused or host unreachable"


def test_ctrl_c_in_the_terminal_chat_stops_the_reply_and_saves_it_as_stopped(faulty, tmp_path):
    db = tmp_path / "h.db"
    chat = subprocess.Popen([sys.executable, "-m", "app.cli", "chat", "--endpoint", f"{faulty}/endless",
                             "--endpoint-model", "m", "--db", str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    chat.stdin.write("Hi\n")
    chat.stdin.flush()
    seen = ""
    while seen.count(" word") < 3:  # the reply streams
        seen += chat.stdout.read(1)
    chat.send_signal(signal.SIGINT)
    out, err = chat.communicate("/bye\n", timeout=60)
    assert chat.returncode == 0, err
    assert "(client-side)" in out  # the reply ended, with its timing line, and the chat went on
    assert "\nTTFT " in out and "prompt 0 tok" not in out  # the server never said the prompt's size
    [session] = Store.open(db).sessions()
    [reply] = [m for m in Store.open(db).messages(session["id"]) if m["role"] == "assistant"]
    assert reply["status"] == "stopped" and reply["content"].startswith(" word word word")
    assert len(Store.open(db).steps(reply["id"])) == reply["generated_tokens"] < 1500


def test_a_reply_the_server_refused_in_the_terminal_chat_is_its_error_without_a_timing_line(faulty, tmp_path):
    out = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--endpoint", f"{faulty}/500", "--endpoint-model",
                          "m", "--db", str(tmp_path / "h.db")], input="Hi\n", capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "answered HTTP 500: out of memory" in out.stdout, out.stderr
    assert "TTFT" not in out.stdout  # nothing was measured: no line of n/a


@pytest.fixture(scope="module")
def own_server(tmp_path_factory):
    from tests.test_serve import start_server

    process, url = start_server()
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.mark.model
def test_chat_against_an_endpoint_is_measured_and_stored(own_server, tmp_path):
    db = tmp_path / "h.db"
    out = subprocess.run([sys.executable, "-m", "app.cli", "chat", "--endpoint", own_server, "--temperature", "0",
                          "--max-new-tokens", "12", "--db", str(db)], input="Hello!\nAnd again?\n/bye\n",
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("(client-side)") == 2 and "server: prompt" in out.stdout
    store = Store.open(db)
    [session] = store.sessions()
    assert session["model"] == "SmolLM2-135M-Instruct" and session["device"] == f"endpoint {own_server}/v1"
    replies = [m for m in store.messages(session["id"]) if m["role"] == "assistant"]
    assert len(replies) == 2 and all(m["ttft_ms"] > 0 and m["status"] == "complete" for m in replies)
    assert replies[1]["cached_prompt_tokens"] > 0  # the server's prefix cache, as its usage reported it
    steps = store.steps(replies[0]["id"])
    assert len(steps) == replies[0]["generated_tokens"] and all(s["phase"] == "decode" for s in steps)


@pytest.mark.model
def test_load_sweep_against_phasescope_serve_shows_batching(own_server):
    out = subprocess.run([sys.executable, "-m", "app.cli", "bench", "--endpoint", own_server, "--concurrency", "1,4",
                          "--requests", "8", "--input-words", "20", "--output-tokens", "32", "--slo",
                          "ttft:60000,tpot:60000", "--output", "json"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    one, four = report["levels"]
    assert one["completed"] == four["completed"] == 8 and one["errors"] == four["errors"] == 0
    assert four["output_tokens_per_s"] > one["output_tokens_per_s"]  # continuous batching
    assert four["goodput"] > 0 and set(four["ttft_ms"]) == {"p50", "p90", "p99"}
    # how the server runs, as its /metrics says: a comparison of two servers says what it compared
    assert {"phasescope:engine_info": {"precision": "int8", "switches": ""}} == report["server_info"]
    # and what it was doing, as its /metrics said while each level ran
    assert one["server_peak"]["running"] <= 1 and four["server_peak"]["running"] >= 2
    assert 0 < four["server_peak"]["kv_cache_usage"] <= 1 and four["server_peak"]["waiting"] >= 0


def test_a_password_in_the_endpoints_url_is_sent_and_never_shown(faulty):
    """A server behind a proxy's basic auth, given as http://user:password@host: the password goes with
    each request and appears nowhere the URL does (the model line, the history, exports, errors)."""
    import base64

    endpoint = Endpoint(faulty.replace("http://", "http://ada:s%40cret@") + "/ok", "m", scrape_metrics=False)
    events = list(endpoint.stream([{"role": "user", "content": "hi"}], SAMPLING))
    assert events[-1].text == "Hello there" and events[-1].error is None
    assert Faulty.authorizations[-1] == "Basic " + base64.b64encode(b"ada:s@cret").decode()
    shown = " ".join(map(str, [endpoint, endpoint.url, endpoint.info(), *events]))
    assert "cret" not in shown and endpoint.url == f"{faulty}/ok/v1"
    assert "sk-1" not in repr(Endpoint(faulty, api_key="sk-1"))
