"""The `phasescope` command's options, command by command."""
from __future__ import annotations

import argparse
import os

from ..i18n import DEFAULT as DEFAULT_LANGUAGE, LANGUAGES
from ..serve.access import bare_host, port_number

DESCRIPTION = "The `phasescope` command: the browser app (default), one-shot generation, and a terminal chat."


DEFAULT_HOST = "127.0.0.1"


DEFAULT_PORT = 7860


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=os.environ.get("PHASESCOPE_MODEL"),
                        help="a local Hugging Face folder or .gguf file (default: bundled SmolLM2-135M-Instruct; "
                             "env PHASESCOPE_MODEL)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16 (see --precision)")
    parser.add_argument("--precision", default=os.environ.get("PHASESCOPE_PRECISION", "auto"),
                        help="auto (int8 on CPU where the native decode step builds), fp32, fp16, bf16 or "
                             "int8 (weights int8, lean path on CPU); env PHASESCOPE_PRECISION")
    parser.add_argument("--kv-cache-mb", type=float, help="the KV cache pool's size in MB (default: an eighth of "
                                                          "the memory, at most 2 GiB)")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="prefill every prompt whole instead of reusing the KV of prefixes already in the pool")
    parser.add_argument("--max-running", type=int, default=16, help="requests decoded together at most (default 16)")
    parser.add_argument("--no-kv-cache", action="store_true",
                        help="keep no KV cache: every decode step computes the whole sequence again (the baseline "
                             "that shows why the cache exists)")
    parser.add_argument("--speculative", metavar="prompt-lookup|draft:PATH",
                        help="speculative decoding: draft tokens from earlier text (the prompt, the reply so far), "
                             "or with a smaller model with the same tokenizer, and verify them in one forward; "
                             "the output is unchanged")
    parser.add_argument("--draft-tokens", type=int, default=8, help="the most tokens drafted at once (default 8)")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "fp16", "int8"],
                        help="the KV cache's number format (auto: the activations', fp32 on CPU); fp16 halves it, "
                             "int8 (a scale per head and position) takes 68 bytes where fp32 takes 256")
    parser.add_argument("--kv-window", type=int, help="a sliding window: keep only the first --kv-sinks tokens and "
                                                      "the last N in the KV cache, which then stops growing")
    parser.add_argument("--kv-sinks", type=int, default=4, help="tokens a --kv-window always keeps (default 4)")
    parser.add_argument("--attention", default="auto", choices=["auto", "sdpa", "eager"],
                        help="prefill's attention: auto (the native kernel), sdpa (PyTorch's fused kernel) or "
                             "eager (the whole score matrix materialized)")
    parser.add_argument("--split-kv", action=argparse.BooleanOptionalAction, default=True,
                        help="Flash Decoding: cut a long sequence's attention into chunks that the threads share "
                             "(default on; --no-split-kv to compare)")
    parser.add_argument("--bind-threads", action="store_true",
                        help="each of the forward's threads on a CPU of its own: far less slowed where another "
                             "program is busy (off by default, as PyTorch and llama.cpp leave them)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="on CUDA: torch.compile each CUDA-graph decode step before it is captured (fewer "
                             "kernels: 1.5x the tokens per second on an H200, for ~25 s of compilation per batch "
                             "and context bucket)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the model over N processes (Megatron-style): each holds a slice of every "
                             "layer, joined by two all-reduces per layer (on CPU through shared memory, else "
                             "gloo); the cores are shared out")
    limits = parser.add_argument_group("limits (each refused with a one-line message)")
    limits.add_argument("--limit-prompt-tokens", type=int, metavar="N", help="prompt tokens (default: the context)")
    limits.add_argument("--limit-new-tokens", type=int, default=8192, metavar="N",
                        help="tokens one request may ask for (default 8192)")
    limits.add_argument("--limit-waiting", type=int, default=64, metavar="N",
                        help="requests waiting behind the batch; more are told to retry (default 64)")
    limits.add_argument("--limit-message-chars", type=int, default=100_000, metavar="N",
                        help="characters in one message (default 100000)")
    limits.add_argument("--limit-request-seconds", type=float, default=600.0, metavar="S",
                        help="a request still running after S seconds ends with an error (default 600; 0: none)")


def _add_sampling_options(parser: argparse.ArgumentParser, max_new_tokens: int, chat: bool = False) -> None:
    """chat: start from a chat's sampling (top-p 0.9, repetition penalty 1.1) where the model sets none."""
    from engine.models.model_defaults import CHAT_SAMPLING, PLAIN_SAMPLING

    start = CHAT_SAMPLING if chat else PLAIN_SAMPLING
    given = "; default: the model's own (generation_config.json, GGUF metadata), else {:g}"
    parser.set_defaults(chat_sampling=chat)
    parser.add_argument("--system", help="a system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, help="0 is greedy" + given.format(start["temperature"]))
    parser.add_argument("--top-p", type=float, help="1: off" + given.format(start["top_p"]))
    parser.add_argument("--top-k", type=int, help="0: off" + given.format(start["top_k"]))
    parser.add_argument("--repetition-penalty", type=float,
                        help="divides the logits of tokens in the prompt or the reply (1: off" +
                             given.format(start["repetition_penalty"]) + ")")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="minus this times a token's count in the reply, from its logit (-2 to 2)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="minus this from the logit of a token already in the reply (-2 to 2)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--prefill-chunk", type=int, default=0, help="prompt tokens per prefill pass (0: all)")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("phasescope")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasescope", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"phasescope {_version()}")
    commands = parser.add_subparsers(dest="command")

    ui = commands.add_parser("ui", help="start the browser app (the default)")
    _add_model_options(ui)
    ui.add_argument("--host", default=DEFAULT_HOST, type=bare_host)
    ui.add_argument("--port", type=port_number, default=DEFAULT_PORT)
    _add_db_option(ui)
    ui.add_argument("--open", action="store_true", help="open the default browser on the app")
    _add_access_options(ui)

    generate = commands.add_parser("generate", help="answer one prompt and print the reply or its events")
    generate.add_argument("text", nargs="?", metavar="PROMPT", help="the prompt (or --prompt); - reads it from stdin")
    generate.add_argument("--prompt", help="the prompt, as PROMPT; - reads it from standard input")
    generate.add_argument("--json", action="store_true", help="print one JSON object per event")
    _add_model_options(generate)
    _add_sampling_options(generate, max_new_tokens=256)

    chat = commands.add_parser("chat", help="chat in the terminal, with a timing line after each reply")
    _add_model_options(chat)
    _add_sampling_options(chat, max_new_tokens=512, chat=True)
    _add_endpoint_options(chat)
    _add_db_option(chat)
    chat.add_argument("--session", type=int, metavar="ID",
                      help="continue a saved conversation (see `phasescope sessions`); its new turns are saved in it")

    sessions = commands.add_parser("sessions", help="list the chat sessions in the history")
    _add_db_option(sessions)
    sessions.add_argument("--search", default="", help="only sessions whose title or messages contain this")

    export = commands.add_parser("export", help="export sessions' timing logs as CSV, JSON or a Chrome trace")
    _add_db_option(export)
    scope = export.add_mutually_exclusive_group(required=True)
    scope.add_argument("--session", type=int, help="the session id (see `phasescope sessions`)")
    scope.add_argument("--all", action="store_true", help="every session")
    export.add_argument("--format", choices=["csv", "json", "trace"], required=True)
    export.add_argument("-o", "--output",
                        help="the file to write, or a folder to write it in (default: standard output)")
    export.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    bench = commands.add_parser("bench", help="prefill and decode speed of each mode vs transformers (and llama.cpp)")
    bench.add_argument("--model", default=os.environ.get("PHASESCOPE_MODEL"))
    bench.add_argument("--device", default="auto")
    bench.add_argument("--modes", default="fp32,fp16,int8", help="comma-separated precisions: fp32, fp16, bf16, int8")
    bench.add_argument("-p", "--n-prompt", help="prompt tokens for pp (default 512), or several, comma-separated, as "
                       "llama-bench's -p: the first is every other measurement's prompt, the rest measure prefill "
                       "only (with -d also at each depth, fp32 cache; and llama.cpp's), e.g. 512,2048")
    bench.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for tg (default 128)")
    bench.add_argument("-r", "--repetitions", type=int, default=3)
    bench.add_argument("--no-baseline", action="store_true", help="skip transformers' generate")
    bench.add_argument("--llama-bench", help="path to llama.cpp's llama-bench (default: found on PATH)")
    bench.add_argument("--output", choices=["md", "csv", "json"], default="md")
    bench.add_argument("--from-json", metavar="FILE", help="measure nothing: render a run saved with --output json "
                       "again, e.g. as the Markdown tables (--output md)")
    bench.add_argument("--concurrency", default="1,2,4,8",
                       help="requests decoding at once, comma-separated (default 1,2,4,8; 0: skip)")
    bench.add_argument("-d", "--depth", default="",
                       help="also decode after this many tokens in the cache, comma-separated (llama-bench's -d), "
                            "with the KV cache in fp32, fp16 and int8, e.g. 0,1024,4096")
    bench.add_argument("--quick", action="store_true", help="a smoke run: pp32 (unless -p is given), tg8, one "
                       "repetition, concurrency 1,2")
    bench.add_argument("--tensor-parallel", type=int, default=2, metavar="N",
                       help="also prefill and decode with the model split over N processes (one thread each) vs one "
                            "rank with one thread and with N threads (default 2; 0 or 1: skip)")
    _add_endpoint_options(bench)
    bench.add_argument("--requests", type=int, default=16, help="with --endpoint: requests per concurrency level")
    bench.add_argument("--request-rate", type=float, help="with --endpoint: Poisson arrivals per second (default: "
                                                         "all at once, up to the concurrency)")
    bench.add_argument("--input-words", type=int, default=100, help="with --endpoint: words per prompt (default 100)")
    bench.add_argument("--output-tokens", type=int, default=64, help="with --endpoint: tokens per reply (default 64)")
    bench.add_argument("--random-lengths", action="store_true", help="with --endpoint: prompt lengths 0.5x to 1.5x")
    bench.add_argument("--seed", type=int, help="with --endpoint: the prompts' seed (default: a new one each run, so "
                       "that a server's prefix cache does not serve an earlier run's prompts; the same seed sends two "
                       "servers the same prompts)")
    bench.add_argument("--slo", metavar="ttft:MS,tpot:MS", help="with --endpoint: goodput counts the requests "
                                                                "within these latencies")
    bench.add_argument("--png", metavar="DIR", help="with --endpoint: write the latency-throughput chart to DIR")
    bench.add_argument("--browser", action="store_true",
                       help="also decode speed streamed to a real browser (Chromium) vs the CLI, per mode")
    serve = commands.add_parser("serve", help="an OpenAI-compatible API (and /metrics) over the engine")
    serve.add_argument("--host", default=DEFAULT_HOST, type=bare_host,
                       help="the address to bind (default 127.0.0.1: this machine only; any other needs --api-key "
                            "or --insecure)")
    serve.add_argument("--port", type=port_number, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("PHASESCOPE_API_KEY"),
                       help="require Authorization: Bearer KEY on /v1 (env PHASESCOPE_API_KEY)")
    serve.add_argument("--ui", action="store_true", help="also serve the browser app at /ui")
    _add_access_options(serve)
    _add_model_options(serve)
    _add_db_option(serve)
    lab = commands.add_parser("lab", help="run an Optimization Lab experiment (or all) both ways on the same prompt")
    lab.add_argument("experiment", help="an experiment's name, or all (see `phasescope lab list`)")
    lab.add_argument("--quick", action="store_true", help="smaller sizes: each experiment in seconds")
    lab.add_argument("--prompt", help="the prompt to run (default: the experiment's own)")
    lab.add_argument("--output", choices=["md", "json"], default="md")
    lab.add_argument("--lang", choices=list(LANGUAGES), default=DEFAULT_LANGUAGE,
                     help="the report's language (a saved run shows in the page's own language)")
    lab.add_argument("--png", metavar="DIR", help="also write each figure to DIR (PNG; standalone HTML where "
                                                  "kaleido cannot draw)")
    _add_model_options(lab)
    _add_db_option(lab)
    return parser


def _add_endpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", metavar="URL", help="measure an OpenAI-compatible server (vLLM, SGLang, "
                        "llama.cpp, Ollama, phasescope serve) instead of the local engine, e.g. http://host:8000/v1")
    parser.add_argument("--endpoint-model", metavar="NAME", help="the model to ask the endpoint for (default: the "
                                                                 "first it lists)")
    parser.add_argument("--endpoint-key", metavar="KEY", default=os.environ.get("PHASESCOPE_ENDPOINT_KEY"),
                        help="the endpoint's API key (env PHASESCOPE_ENDPOINT_KEY)")


def _add_access_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auth", metavar="USER:PASSWORD", help="require this login for the UI (env PHASESCOPE_AUTH)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow binding to a non-loopback address without credentials (a warning is printed)")


def _add_db_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=os.environ.get("PHASESCOPE_DB"),
                        help="history database (default ~/.local/share/phasescope/history.db; env PHASESCOPE_DB)")
